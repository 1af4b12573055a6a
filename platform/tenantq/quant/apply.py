"""The one path from a plan to quantized params: `apply_plan` (in memory) and `load_quantized`
(a checkpoint's tensor stream) both run the one loop `_quantized`, once per tensor.

A plan resolves to one `TensorQuant` per quantized tensor; each is produced by the algorithm
its rule names (`quant.algorithms.ALGORITHMS`: rtn, GPTQ, AWQ, SmoothQuant), per tp shard
when the caller names split axes (`quantize_per_shard`). Quantized params then go to the
engine as they are: `check_quantized` is how a consumer verifies them against a plan
without quantizing again, and applying a plan to params that are already quantized fails.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tenantq.model.config import ModelConfig, TensorInfo
from tenantq.model.layers import StaticActQArray
from tenantq.numerics import QArray, compute_scale_zero_point, get_format
from tenantq.quant.algorithms import ALGORITHMS
from tenantq.quant.plan import QuantPlan, TensorQuant, check_w8a8


class UnusedRuleWarning(UserWarning):
    """A plan rule was the first match for no tensor (a typo, or shadowed by an earlier rule)."""


def registered_algorithms() -> tuple[str, ...]:
    return tuple(ALGORITHMS)


def quantize_tensor(weight, how: TensorQuant, *, act_amax=None, **inputs: Any) -> QArray:
    """Quantize one tensor as `how` says, with the algorithm its rule names.

    Static W8A8 (`how.activation_scale == "static"`) also needs `act_amax`, the calibrated
    max |x| of the tensor's input (`site_inputs.site_inputs` passes it); the activation scale is
    the activation format's own scale for that amax, stored with the weight.
    """
    check_w8a8(how)
    algorithm = ALGORITHMS.get(how.algorithm)
    if algorithm is None:
        raise ValueError(
            f"{how.path}: algorithm {how.algorithm!r} is not available; "
            f"registered: {', '.join(ALGORITHMS)}"
        )
    if how.activation_scale != "static":
        return algorithm(jnp.asarray(weight, dtype=jnp.float32), how, **inputs)
    if act_amax is None:
        raise ValueError(
            f"{how.path}: static activation scales need calibration statistics; run "
            "tenantq.quant.site_inputs.site_inputs(params, plan, config, stats) and pass its "
            "inputs to apply_plan"
        )
    q = algorithm(jnp.asarray(weight, dtype=jnp.float32), how, **inputs)
    return StaticActQArray.wrap(q, static_activation_scale(act_amax, how.activations))


def static_activation_scale(act_amax, activations: str) -> jax.Array:
    """The one per-tensor scale `activations` prescribes for inputs of max |x| `act_amax`."""
    amax = np.float32(act_amax)
    if not np.isfinite(amax) or amax < 0:
        raise ValueError(f"act_amax must be a finite max |x| >= 0, got {act_amax!r}")
    scale, _ = compute_scale_zero_point(jnp.zeros((1,)), activations, axis=None, amax=amax)
    return scale.reshape(())


def infer_tensors(params: Mapping[str, Any]) -> dict[str, TensorInfo]:
    """The tensor inventory read off params keyed by tensor path, for callers without a config.

    Same conventions as `ModelConfig.tensors()`: `embed` [vocab, hidden] is quantized along
    axis 1, 2-D `*_proj` and `lm_head` [in, out] along axis 0, everything else never.
    """
    out = {}
    for path, value in params.items():
        shape = tuple(int(d) for d in getattr(value, "shape", ()))
        if isinstance(value, QArray):
            shape = value.shape
        name = path.rsplit("/", 1)[-1]
        if path == "embed" and len(shape) == 2:
            out[path] = TensorInfo(path, shape, "embedding", 1)
        elif (name.endswith("_proj") or path == "lm_head") and len(shape) == 2:
            out[path] = TensorInfo(path, shape, "linear", 0)
        else:
            kind = "bias" if name.endswith("_bias") else "norm"
            out[path] = TensorInfo(path, shape, kind, None)
    return out


def quantize_per_shard(weight, how: TensorQuant, axis: int, tp: int) -> QArray:
    """Quantize each of `tp` slices of `weight` along `axis` on its own; one QArray back.

    Fields are concatenated along `axis`, so device i holds exactly what quantizing its
    slice gives. Where the per-shard scales change the layout, the QArray says so:
    a per-tensor scale (axis=None) becomes `axis=axis, group_size=shard` with a scale of
    `tp` entries along `axis` and 1 elsewhere (dequantize broadcasts it), and one group
    over a split axis becomes groups of one shard. nvfp4's per-tensor scale has no
    per-shard form in `dequantize`, so it is refused, as are the embedding's per-tensor
    scale (its row gather reads one scale) and W8A8 over split rows.
    """
    spec = get_format(how.format)
    if spec.has_tensor_scale:
        raise ValueError(
            f"{how.path}: scales='shard' cannot store {how.format}'s per-tensor scale per "
            "shard (dequantize takes one tensor scale); use scales='global' for it"
        )
    if how.path == "embed" and how.axis is None:
        raise ValueError(
            "embed: the row gather reads one scale per row or per tensor; "
            "per-shard per-tensor scales would need per-shard gathers"
        )
    if how.activations is not None and axis == how.axis:
        raise ValueError(
            f"{how.path}: W8A8 needs one scale per output channel; per-shard scales "
            f"over split rows break that (use scales='global')"
        )
    shard = weight.shape[axis] // tp
    if spec.packed and axis == len(weight.shape) - 1 and shard % 2:
        raise ValueError(f"{how.path}: {how.format} shards of {shard} would split a packed byte")
    parts = [quantize_tensor(s, how) for s in jnp.split(jnp.asarray(weight), tp, axis=axis)]
    first = parts[0]
    q_axis, group = first.axis, first.group_size
    if q_axis is None:
        q_axis, group = axis, shard
    elif q_axis == axis:
        n_groups = first.scale.shape[axis] if first.scale is not None else 1
        if group is None or n_groups == 1:
            group = shard
        elif shard % group:
            raise ValueError(
                f"{how.path}: groups of {group} leave a partial group inside each shard of "
                f"{shard} along axis {axis}; use a group size dividing {shard}"
            )

    def cat(field: int):
        arrays = [(q.data, q.scale, q.zero_point)[field] for q in parts]
        return None if arrays[0] is None else jnp.concatenate(arrays, axis=axis)

    return QArray(cat(0), cat(1), cat(2), None, tuple(weight.shape), first.fmt, q_axis, group)


def _checked_resolve(
    plan: QuantPlan, expected: Mapping[str, TensorInfo], strict: bool
) -> dict[str, TensorQuant]:
    """The plan resolved over `expected`, its unused rules warned about (or raised)."""
    unused = plan.unused_rules(expected)
    if unused:
        names = ", ".join(repr(r.pattern) for r in unused)
        message = f"plan rules matched no tensor (first match wins): {names}"
        if strict:
            raise ValueError(message)
        warnings.warn(message, UnusedRuleWarning, stacklevel=3)
    return plan.resolve(expected)


def _quantized(
    items: Iterable[tuple[str, Any]],
    resolved: Mapping[str, TensorQuant],
    *,
    inputs: Mapping[str, Mapping[str, Any]],
    shard_axes: Mapping[str, int | None] | None,
    tp: int,
    full_precision: Any,
    stored: str | None,
) -> Iterator[tuple[str, Any]]:
    """The one loop from a plan to quantized tensors, for in-memory params and for a
    checkpoint's stream alike: planned tensors become their `QArray` (per tp shard where
    `shard_axes` names a split axis), the rest go through `full_precision`. A QArray leaf
    is accepted only from a stored checkpoint (`stored` names it) in the planned format."""
    for path, value in items:
        how = resolved.get(path)
        if isinstance(value, QArray):
            if stored is None:
                raise ValueError(
                    f"{path} is already a {value.fmt} QArray: a plan is applied once, to "
                    "full-precision params (pass quantized params to the engine as they are)"
                )
            check_quantized({path: value}, resolved, where=stored)
            yield path, value
        elif how is None:
            yield path, full_precision(value)
        else:
            axis = None if shard_axes is None else shard_axes.get(path)
            if axis is not None and tp > 1:
                yield path, quantize_per_shard(value, how, axis, tp)
            else:
                yield path, quantize_tensor(value, how, **dict(inputs.get(path, {})))
        del value


def check_quantized(
    params: Mapping[str, Any],
    plan: QuantPlan | Mapping[str, TensorQuant],
    config: ModelConfig | None = None,
    *,
    where: str = "params",
) -> None:
    """Raise unless every tensor of `params` is stored as the plan says: a QArray of its
    rule's format where the plan quantizes it, full precision where it does not. This is how
    the engine (and a compressed checkpoint's loader) accepts params quantized elsewhere
    without quantizing them again, and refuses params quantized under another plan."""
    if isinstance(plan, QuantPlan):
        expected = config.tensors() if config is not None else infer_tensors(params)
        resolved = plan.resolve(expected)
    else:
        resolved = plan
    for path, value in params.items():
        how = resolved.get(path)
        stored = value.fmt if isinstance(value, QArray) else "full precision"
        planned = "full precision" if how is None else how.format
        if stored == planned and how is not None:  # same format: the same layout too
            stored, planned = _layout_words(value, how)
        if stored != planned:
            raise ValueError(
                f"{where}: {path} is stored as {stored} but the plan wants {planned}; "
                "quantize full-precision params under this plan (apply_plan), or pass the "
                "plan they were quantized under"
            )


def _layout_words(value: QArray, how: TensorQuant) -> tuple[str, str]:
    """(stored, planned) layouts of one quantized tensor in words, equal iff they match:
    the groups (and their axis), zero points, and a static activation scale (the layout
    `quantize` gives under `how`, `numerics.layout.resolve_layout`; no array is made)."""
    from tenantq.numerics.layout import resolve_layout

    layout = resolve_layout(
        value.shape, how.format, axis=how.axis, group_size=how.group_size,
        symmetric=how.symmetric,
    )  # fmt: skip

    def words(axis, group, zero_point: bool, static: bool) -> str:
        out = f"{how.format} with " + (
            "one scale" if axis is None else
            f"groups of {group} along axis {axis}" if group else f"one scale per axis-{axis} slice"
        )  # fmt: skip
        out += ", zero points" if zero_point else ""
        return out + (", a static activation scale" if static else "")

    static = isinstance(value, StaticActQArray) and value.act_scale is not None
    axis, group = value.axis, value.group_size
    if layout.group_size is None:
        # An ungrouped plan (one scale per slice) also runs per-tensor and per-shard forms
        # of its scale (a tp shard's, tests/engine/_sharding_check.py's per-tensor study):
        # zero points and the static scale are compared, not where the scale runs.
        axis, group = layout.axis, layout.group_size
    return (
        words(axis, group, value.zero_point is not None, static),
        words(layout.axis, layout.group_size, not layout.symmetric,
              how.activation_scale == "static"),
    )  # fmt: skip


def apply_plan(
    params: Mapping[str, Any],
    plan: QuantPlan | None,
    config: ModelConfig | None = None,
    *,
    strict: bool = False,
    inputs: Mapping[str, Mapping[str, Any]] | None = None,
    shard_axes: Mapping[str, int | None] | None = None,
    tp: int = 1,
) -> dict[str, Any]:
    """Params with every tensor the plan quantizes replaced by its `QArray`.

    `params` maps tensor paths (`config.tensors()`) to full-precision arrays; tensors the
    plan leaves alone are returned as they are (casting is the engine's business). Without
    `config` the inventory is read off the params themselves (`infer_tensors`). A QArray leaf
    is an error: a plan is applied once (re-quantizing quantized values compounds error; to
    check quantized params against a plan, `check_quantized`). Unused rules warn
    (`UnusedRuleWarning`), or raise with `strict=True`. `inputs[path]` is passed to that
    tensor's algorithm as keyword arguments (calibration statistics). `shard_axes[path]`
    with `tp > 1`: quantize each of the tp slices along that axis on its own (the engine's
    scale_scope="shard").
    """
    plan = plan or QuantPlan()
    expected = config.tensors() if config is not None else infer_tensors(params)
    unknown = sorted(set(params) - set(expected))
    if unknown:
        raise ValueError(f"params hold tensors the model does not have: {unknown[:5]}")
    resolved = _checked_resolve(plan, expected, strict)
    return dict(
        _quantized(
            params.items(), resolved, inputs=inputs or {}, shard_axes=shard_axes, tp=tp,
            full_precision=lambda v: v, stored=None,
        )
    )  # fmt: skip


def load_quantized(
    folder: str | Path,
    config: ModelConfig,
    plan: QuantPlan | None = None,
    *,
    dtype: Any = "bfloat16",
    strict: bool = False,
) -> dict[str, Any]:
    """Params of a checkpoint folder with `plan` applied as each tensor streams in.

    The same loop as `apply_plan` (`_quantized`) over the loader's stream: tensors the plan
    quantizes go straight from the loader's float array to their `QArray`; the rest are cast
    to `dtype`. Peak host memory stays near the result plus one full-precision tensor.
    A compressed-tensors folder (`tenantq export`) gives its quantized tensors as stored;
    the plan must quantize them to the same formats (`model.compressed.checkpoint_plan`).
    """
    from tenantq.model.compressed import iter_compressed
    from tenantq.model.config import is_compressed_tensors
    from tenantq.model.loader import iter_checkpoint

    resolved = _checked_resolve(plan or QuantPlan(), config.tensors(), strict)
    compressed = is_compressed_tensors(folder)
    stream = iter_compressed(folder, config) if compressed else iter_checkpoint(folder, config)
    cast = jnp.dtype(dtype)
    return dict(
        _quantized(
            ((path, a if isinstance(a, QArray) else np.asarray(a)) for path, a in stream),
            resolved, inputs={}, shard_axes=None, tp=1,
            full_precision=lambda v: jnp.asarray(v, dtype=cast),
            stored=f"{folder} (load a compressed-tensors folder with plan=None: its own plan)",
        )
    )  # fmt: skip
