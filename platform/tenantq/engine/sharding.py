"""Tensor parallelism: a 1-d device mesh, where every weight and KV-cache array goes on it.

The layout is `tenantq.storage.tp`'s table, the one the capacity planner budgets
(Megatron: q/k/v and gate/up split their output columns, o and down their input rows,
embed and an untied lm_head the vocabulary when tp divides it, norms replicated), and the
KV cache by KV head. Arrays are placed with `NamedSharding` and jit propagates the rest.
Only placement happens here: a quantized tensor arrives with scales from the whole tensor
("global") or from each device's slice alone ("shard", `quant.apply.quantize_per_shard`).
Under multi-controller JAX (one process per host of a slice, `jax.distributed`) the mesh spans
every process's devices: each process places only its own shards (`place`) and the engine's
outputs are replicated to every host (`to_every_host`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tenantq.model.checks import check_positive_int
from tenantq.model.config import ModelConfig
from tenantq.model.layers import StaticActQArray
from tenantq.numerics import QArray, get_format
from tenantq.storage.tp import check_tp, tp_split_axis

AXIS = "tp"  # the mesh's one axis name
SCALE_SCOPES = ("global", "shard")
HEAD_AXIS = 2  # every KV-cache array is [..., ..., kv_heads, ...]


def make_mesh(tp: int, config: ModelConfig | None = None) -> Mesh:
    """A 1-d mesh named "tp" over the first `tp` local devices (checked against `config`).

    Under multi-controller JAX (`jax.process_count() > 1`) the mesh is every device of every
    process, in process order: tp must be the slice's whole device count, since a process
    outside the mesh would wait for a program that never includes it."""
    check_positive_int("tp", tp)
    if config is not None:
        check_tp(config, tp)
    if jax.process_count() > 1:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        if tp != len(devices):
            raise ValueError(
                f"tp={tp} but this slice runs {jax.process_count()} processes with "
                f"{len(devices)} devices in all: under multi-controller JAX tp must be "
                f"{len(devices)} (every device of every host)"
            )
        return Mesh(np.array(devices), (AXIS,), axis_types=(AxisType.Auto,))
    devices = jax.local_devices()
    if tp > len(devices):
        raise ValueError(
            f"tp={tp} but this process sees {len(devices)} {devices[0].platform} device(s): "
            f"valid tp values are 1..{len(devices)} (on CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax)"
        )
    return Mesh(np.array(devices[:tp]), (AXIS,), axis_types=(AxisType.Auto,))


def _spec(ndim: int, axis: int | None) -> P:
    return P() if axis is None else P(*(AXIS if i == axis else None for i in range(ndim)))


def param_spec(path: str, value: Any, config: ModelConfig, tp: int):
    """The PartitionSpec of one params leaf; for a QArray, a QArray of specs (one per field).

    Data is split like the logical tensor (packed int4/fp4 data along its packed last axis:
    each shard must hold an even number of elements). A scale/zero point is split on the
    same axis when it runs the tensor's full length there (per-channel along an unsharded
    axis) or holds whole groups per shard; a scale of length 1 there is replicated.
    """
    axis = tp_split_axis(path, config, tp)
    if not isinstance(value, QArray):
        return _spec(len(value.shape), axis)
    spec = _qarray_spec(path, value, config, tp, axis)
    if isinstance(value, StaticActQArray):  # same pytree node; its one scale is replicated
        return StaticActQArray.wrap_spec(spec, P())
    return spec


def _qarray_spec(path: str, value: QArray, config: ModelConfig, tp: int, axis: int | None):
    if axis is None:
        return QArray(*(None if a is None else P() for a in _fields(value)), *_aux(value))
    length = value.shape[axis]
    if length % tp:
        raise ValueError(f"{path}: tp={tp} does not divide its axis {axis} of length {length}")
    shard = length // tp
    per_byte = get_format(value.fmt).elements_per_byte
    if axis == value.ndim - 1 and shard % per_byte:
        raise ValueError(
            f"{path}: {value.fmt} packs {per_byte} elements per byte along axis {axis}; a "
            f"shard of {shard} elements would split a byte (use a shard width that is a "
            f"multiple of {per_byte})"
        )
    data = _spec(value.ndim, axis)
    scale = None if value.scale is None else _scale_spec(path, value, axis, shard, tp)
    zero = None if value.zero_point is None else scale
    tensor = None if value.tensor_scale is None else P()
    return QArray(data, scale, zero, tensor, *_aux(value))


def _scale_spec(path: str, q: QArray, axis: int, shard: int, tp: int) -> P:
    n = q.scale.shape[axis]
    if n == 1:
        return P()  # one scale along the split axis: every device needs it
    if n == q.shape[axis]:
        return _spec(q.ndim, axis)  # one scale per element of the split axis
    group = q.group_size if q.axis == axis and q.group_size else -(-q.shape[axis] // n)
    if n % tp or shard % group:
        raise ValueError(
            f"{path}: groups of {group} along axis {axis} do not align with the {tp} shards "
            f"of {shard}; use a group size dividing {shard}, or scales='shard'"
        )
    return _spec(q.ndim, axis)


def _fields(q: QArray):
    return (q.data, q.scale, q.zero_point, q.tensor_scale)


def _aux(q: QArray):
    return (q.shape, q.fmt, q.axis, q.group_size)


def shard_params(params: Mapping[str, Any], config: ModelConfig, mesh: Mesh) -> dict[str, Any]:
    """Params placed on `mesh` with their `param_spec`; nothing is quantized or cast here.

    The params arrive as the engine will hold them (`quant.apply.apply_plan` quantized them,
    per shard where scale_scope="shard" asked); sharding only places arrays.
    """
    tp = mesh.shape[AXIS]
    check_tp(config, tp)
    out: dict[str, Any] = {}
    for path, value in params.items():
        specs = param_spec(path, value, config, tp)
        out[path] = jax.tree.map(place, value, _named(specs, mesh))
    return out


def check_shard_scales(params: Mapping[str, Any], config: ModelConfig, tp: int) -> None:
    """Raise unless every quantized tensor's scales lie inside one of the `tp` shards, as
    scale_scope="shard" promises (each device dequantizes its slice from its own scales).

    Quantized params pass as they are when no scale spans a shard boundary: per-shard ones
    (`apply_plan(..., shard_axes=..., tp=tp)`), and any whose scales run along the split axis
    or in groups dividing a shard. One scale for a whole split tensor does not."""
    for path, q in params.items():
        axis = tp_split_axis(path, config, tp)
        if not isinstance(q, QArray) or axis is None or tp == 1:
            continue
        shard = q.shape[axis] // tp
        if q.tensor_scale is not None:
            spans = f"a {q.fmt} tensor scale"
        elif q.scale is not None and q.axis is None:
            spans = "one scale for the whole tensor"
        elif q.axis == axis and (q.group_size is None or shard % q.group_size):
            spans = f"groups of {q.group_size or q.shape[axis]} along axis {axis}"
        else:
            continue
        # quantize_per_shard has no per-shard form for these: only whole-tensor scales work.
        static = isinstance(q, StaticActQArray) and q.act_scale is not None and q.axis == axis
        if q.tensor_scale is not None or static or (path == "embed" and q.axis is None):
            remedy = "it has no per-shard form: use scale_scope='global'"
        else:
            remedy = (
                f"quantize it per shard (apply_plan with shard_axes and tp={tp}), pass "
                "full-precision params, or use scale_scope='global'"
            )
        raise ValueError(
            f"scale_scope='shard': {path} has {spans}, which spans its {tp} shards of {shard} "
            f"along axis {axis}; {remedy}"
        )


def spans_processes(mesh: Mesh | None) -> bool:
    """Whether `mesh` holds devices of more than one process (a multi-host slice)."""
    return mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1


def place(value: Any, sharding: NamedSharding) -> jax.Array:
    """`value` (the same host or device array on every process) laid out as `sharding`.

    On one process this is `jax.device_put`. Across processes each one builds only the shards
    its own devices hold (`jax.make_array_from_callback` slices the host copy), so no process
    sends another's shards anywhere: the per-host memory is the per-host share."""
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


@functools.cache
def _replicator(mesh: Mesh):
    return jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, P()))


def to_every_host(tree: Any, mesh: Mesh | None) -> Any:
    """Outputs of a step replicated on every device of `mesh`, when it spans processes (an
    all-gather), so each host can read them (`np.asarray`); unchanged otherwise."""
    if not spans_processes(mesh):
        return tree
    return _replicator(mesh)(tree)


def on_every_host(flag: bool) -> bool:
    """Whether `flag` holds on every process of a multi-host slice (a collective: every
    process must call it at the same point); `flag` itself on one process. Hosts that decide
    apart (a cache one has on disk, another must compute) would leave one host waiting in a
    collective the others never start: they decide together with this."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.array([int(bool(flag))], np.int32))
    return bool(np.all(flags))


def _named(specs, mesh: Mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def shard_cache_state(state: Any, mesh: Mesh) -> Any:
    """Every KV-cache array split on its KV-head axis (index 2); smaller arrays replicated."""
    tp = mesh.shape[AXIS]

    def by_head(array):
        if array.ndim <= HEAD_AXIS:
            return place(array, NamedSharding(mesh, P()))
        if array.shape[HEAD_AXIS] % tp:
            raise ValueError(
                f"cache array {tuple(array.shape)}: tp={tp} does not divide its KV-head axis "
                f"(index {HEAD_AXIS}) of {array.shape[HEAD_AXIS]}"
            )
        return place(array, NamedSharding(mesh, _spec(array.ndim, HEAD_AXIS)))

    return jax.tree.map(by_head, state)


def device_bytes(tree: Any) -> dict[int, int]:
    """Bytes each device holds for the arrays of `tree` (a replicated array counts on each);
    on a multi-host slice, the devices of this process only."""
    out: dict[int, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            size = int(np.prod(shard.data.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
            out[shard.device.id] = out.get(shard.device.id, 0) + size
    return out
