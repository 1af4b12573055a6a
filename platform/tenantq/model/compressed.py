"""Read a compressed-tensors checkpoint (config.json `quantization_config`) back as tenantq params.

vLLM and SGLang serve this layout and `tenantq export` writes it. Quantized modules come back
as the `QArray`s they encode (codes, float32 scales, the same group layout), not as floats,
so an engine over an export computes what the engine under the plan computed. The plan is
read off the checkpoint itself (`checkpoint_plan`): one rule per quantized tensor and the
`kv_cache_scheme`, whose static `k_scale`/`v_scale` come back as `StoredKVScales`. Schemes
tenantq has no format for (asymmetric zero points, nvfp4, MX, blocks) are one-line errors.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from tenantq.model.config import ModelConfig, quantization_config
from tenantq.model.safetensors_header import SafetensorsHeader

# safetensors dtype codes a compressed-tensors checkpoint uses.
_DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "I64": np.int64,
    "I32": np.int32,
    "I8": np.int8,
    "U8": np.uint8,
}
_FLOAT_CODES = ("F64", "F32", "F16", "BF16")


@dataclass(frozen=True)
class _Scheme:
    fmt: str
    strategy: str
    group_size: int | None
    activations: str | None
    activation_scale: str
    packed: bool  # pack-quantized (weight_packed int32); else a plain `weight` of codes


# Group formats read: packed int32 codes, or plain int8 / F8_E4M3 codes in `weight`.
PACKED_FORMATS = ("pack-quantized",)
PLAIN_FORMATS = ("int-quantized", "float-quantized", "naive-quantized")


def check_supported(qc: dict, where: str) -> None:
    """One line for a quantization_config whose parts tenantq does not reproduce as a whole
    (transforms, sparsity); per-group parts are checked by `_scheme`."""
    for key in ("transform_config", "sparsity_config"):
        if qc.get(key):
            raise ValueError(
                f"{where}: quantization_config.{key} is set; tenantq does not apply "
                f"{key.split('_')[0]}s, so it cannot read this checkpoint (only plain "
                "quantized weights)"
            )


def _activations(acts: dict, fmt: str, here: str) -> tuple[str, str]:
    """(activation format, scale kind) of a group's input_activations, or one line naming
    what tenantq does not reproduce: 8-bit symmetric per-token dynamic or per-tensor
    static, int8 with int8 weights or fp8 with fp8 weights."""
    kind = {"int": "int8", "float": "fp8_e4m3"}.get(acts.get("type"))
    dynamic, strategy = acts.get("dynamic"), acts.get("strategy")
    scale = {(True, "token"): "dynamic", (False, "tensor"): "static"}.get((dynamic, strategy))
    ok = (
        kind is not None
        and acts.get("num_bits") == 8
        and acts.get("symmetric", True)
        and acts.get("group_size") is None
        and scale is not None
    )
    if not ok:
        raise ValueError(
            f"{here}: input_activations {acts.get('type')} {acts.get('num_bits')}-bit, "
            f"symmetric {acts.get('symmetric')}, strategy {strategy!r}, dynamic {dynamic!r}: "
            "tenantq reproduces 8-bit symmetric activations per token (dynamic) or per tensor "
            "(static) only"
        )
    if fmt != ("int8" if kind == "int8" else "fp8_e4m3"):
        raise ValueError(
            f"{here}: {fmt} weights with {kind} input activations (W{fmt[-1]}A8) have no "
            f"tenantq format; W8A8 needs {'int8' if kind == 'int8' else 'fp8_e4m3'} weights "
            "per channel"
        )
    return kind, scale


def _scheme(qc: dict, module: str, kind: str, where: str) -> _Scheme | None:
    """The scheme of `module` (a HF module name of class `kind`), or None (not quantized)."""
    ignore = qc.get("ignore") or []
    if any(_matches(t, module, kind) for t in ignore):
        return None
    for name, group in (qc.get("config_groups") or {}).items():
        if not any(_matches(t, module, kind) for t in group.get("targets", [])):
            continue
        w = group.get("weights") or {}
        here = f"{where}: quantization_config.config_groups.{name} ({module})"
        form = group.get("format") or qc.get("format")
        if form not in PACKED_FORMATS + PLAIN_FORMATS:
            raise ValueError(
                f"{here}: format {form!r} is not read; readable: "
                f"{', '.join(PACKED_FORMATS + PLAIN_FORMATS)}"
            )
        if group.get("output_activations"):
            raise ValueError(
                f"{here}: output_activations are set; tenantq does not quantize "
                "outputs (input_activations only)"
            )
        if w.get("actorder") or w.get("dynamic") or w.get("block_structure"):
            raise ValueError(
                f"{here}: weights with actorder {w.get('actorder')!r}, dynamic "
                f"{w.get('dynamic')!r}, block_structure {w.get('block_structure')!r}: tenantq "
                "reads static weight scales without reordering or blocks only"
            )
        kind_bits = (w.get("type"), w.get("num_bits"))
        fmt = {("int", 8): "int8", ("int", 4): "int4", ("float", 8): "fp8_e4m3"}.get(kind_bits)
        if fmt is None or w.get("strategy") not in ("tensor", "channel", "group"):
            raise ValueError(
                f"{here}: {w.get('type')} {w.get('num_bits')}-bit weights with strategy "
                f"{w.get('strategy')!r} have no tenantq format; readable: int8, int4, fp8 "
                "(float 8-bit) with strategy tensor, channel or group"
            )
        if not w.get("symmetric", True):
            raise ValueError(
                f"{here}: asymmetric weights (zero points) are not read; symmetric only"
            )
        acts = group.get("input_activations")
        activations, activation_scale = None, "dynamic"
        if acts:
            if w.get("strategy") == "group":
                raise ValueError(
                    f"{here}: grouped weights with input_activations have no tenantq format "
                    "(W8A8 needs per-channel weight scales)"
                )
            activations, activation_scale = _activations(acts, fmt, here)
        gs = w.get("group_size") if w.get("strategy") == "group" else None
        packed = form in PACKED_FORMATS
        return _Scheme(fmt, w["strategy"], gs, activations, activation_scale, packed)
    return None


def _matches(target: str, module: str, kind: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target in (module, kind)


class _Reader:
    """Tensors of a folder's safetensors files by name, with their dtypes."""

    def __init__(self, folder: Path):
        from tenantq.model.loader import checkpoint_files

        self.where = checkpoint_files(folder)
        self.headers: dict[Path, SafetensorsHeader] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def read(self, name: str) -> np.ndarray:
        file = self.where[name]
        if file not in self.headers:
            self.headers[file] = SafetensorsHeader.read(file)
        header = self.headers[file]
        entry = header.entries[name]
        dtype = _DTYPES.get(entry.dtype)
        if dtype is None:
            raise ValueError(
                f"{file.name}: tensor {name} has dtype {entry.dtype}; "
                f"readable: {', '.join(_DTYPES)}"
            )
        with file.open("rb") as f:
            f.seek(header.data_offset_bytes + entry.begin)
            raw = f.read(entry.end - entry.begin)
        return np.frombuffer(raw, dtype).reshape(entry.shape)


def unpack_int32(packed: np.ndarray, num_bits: int, cols: int) -> np.ndarray:
    """compressed-tensors' int32 packing undone: int8 codes [rows, cols] (4 or 8 bits)."""
    raw = np.ascontiguousarray(packed.astype("<i4")).view(np.uint8)
    if num_bits == 4:
        raw = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(raw.shape[0], -1)
    return (raw[:, :cols].astype(np.int16) - (1 << (num_bits - 1))).astype(np.int8)


def _qarray(reader: _Reader, module: str, scheme: _Scheme, transpose: bool, where: str):
    import jax.numpy as jnp

    from tenantq.model.layers import StaticActQArray
    from tenantq.numerics import QArray, pack_int4

    if f"{module}.weight_zero_point" in reader:
        raise ValueError(f"{where}: {module} has zero points; asymmetric weights are not read")
    if f"{module}.weight_g_idx" in reader:
        raise ValueError(
            f"{where}: {module} has weight_g_idx (activation reordering); tenantq does not "
            "reorder inputs"
        )
    scale = np.asarray(reader.read(f"{module}.weight_scale"), np.float32)
    if not scheme.packed:  # plain codes: F8_E4M3 for fp8, int8 for int
        codes = reader.read(f"{module}.weight")
        want = np.int8 if scheme.fmt != "fp8_e4m3" else ml_dtypes.float8_e4m3fn
        if codes.dtype != want:
            raise ValueError(
                f"{where}: {module}.weight is {codes.dtype}; {scheme.fmt} codes are "
                f"{np.dtype(want).name}"
            )
        if scheme.fmt == "int4" and (codes.min(initial=0) < -8 or codes.max(initial=0) > 7):
            raise ValueError(f"{where}: {module}.weight holds codes outside int4's -8..7")
    else:
        shape = tuple(int(d) for d in reader.read(f"{module}.weight_shape"))
        bits = 8 if scheme.fmt == "int8" else 4
        codes = unpack_int32(reader.read(f"{module}.weight_packed"), bits, shape[-1])
    if scheme.strategy == "tensor":
        scale = scale.reshape(1, 1)
    if transpose:  # HF [out, in] -> tenantq [in, out], scales along axis 0
        codes, scale, axis = codes.T, scale.T, 0
    else:
        axis = 1
    codes = np.ascontiguousarray(codes)
    shape = codes.shape
    data = pack_int4(codes) if scheme.fmt == "int4" else codes
    group = scheme.group_size
    if scheme.strategy != "group" or -(-shape[axis] // group) == 1:
        group = None if scheme.fmt != "int4" else shape[axis]
    q = QArray(
        jnp.asarray(data), jnp.asarray(np.ascontiguousarray(scale)), None, None, shape,
        scheme.fmt, None if scheme.strategy == "tensor" else axis, group,
    )  # fmt: skip
    if scheme.activation_scale == "static":
        act = reader.read(f"{module}.input_scale")
        return StaticActQArray.wrap(q, np.asarray(act, np.float32).reshape(()))
    return q


def iter_compressed(folder: str | Path, config: ModelConfig) -> Iterator[tuple[str, Any]]:
    """(engine path, QArray or float array in engine layout) for every tensor of the model."""
    from tenantq.model.loader import check_finite, hf_names

    folder = Path(folder)
    qc = quantization_config(folder)
    if qc is None:
        raise ValueError(f"{folder}/config.json has no compressed-tensors quantization_config")
    where = f"{folder}/config.json"
    check_supported(qc, where)
    reader = _Reader(folder)
    for path, (hf, transpose) in hf_names(config).items():
        module = hf.removesuffix(".weight")
        kind = "Embedding" if path == "embed" else "Linear"
        scheme = _scheme(qc, module, kind, where) if config.tensors()[path].quantizable else None
        if scheme is not None:
            yield path, _qarray(reader, module, scheme, transpose, where)
            continue
        if hf not in reader:
            raise ValueError(f"tensor {hf} ({path}) is missing from {folder}")
        array = reader.read(hf)
        if array.dtype.name not in ("float64", "float32", "float16", "bfloat16"):
            raise ValueError(f"tensor {hf} ({path}) has dtype {array.dtype}; expected a float")
        check_finite(array, f"tensor {hf} ({path})")
        yield path, array.T if transpose else array


@dataclass(frozen=True)
class StoredKVScales:
    """Static KV scales read from a checkpoint's `k_scale`/`v_scale`, in the interface the
    pool reads calibrated ones through (`for_tensor`, `fingerprint`)."""

    scales: dict  # ("keys" | "values", layer) -> float32 array

    def for_tensor(self, layer: int, tensor: str, spec) -> tuple[np.ndarray, None]:
        return self.scales[(tensor, layer)].reshape(-1), None

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for key in sorted(self.scales):
            h.update(repr(key).encode())
            h.update(np.ascontiguousarray(self.scales[key], np.float32).tobytes())
        return h.hexdigest()[:16]


def checkpoint_plan(folder: str | Path, config: ModelConfig) -> tuple[dict, StoredKVScales | None]:
    """The plan (as QuantPlan's dict) a compressed-tensors folder was written under, read off
    its schemes: one exact rule per quantized tensor, the KV part from `kv_cache_scheme`;
    and the stored static KV scales (None without a KV scheme)."""
    from tenantq.model.loader import hf_names

    folder = Path(folder)
    qc = quantization_config(folder)
    if qc is None:
        raise ValueError(f"{folder}/config.json has no compressed-tensors quantization_config")
    where = f"{folder}/config.json"
    check_supported(qc, where)
    g_idx = [name for name in _Reader(folder).where if name.endswith("_g_idx")]
    if g_idx:
        raise ValueError(
            f"{where}: the checkpoint has {g_idx[0]} (activation reordering, actorder); "
            "tenantq does not reorder inputs"
        )
    rules = []
    tensors = config.tensors()
    for path, (hf, _) in hf_names(config).items():
        if not tensors[path].quantizable:
            continue
        kind = "Embedding" if path == "embed" else "Linear"
        s = _scheme(qc, hf.removesuffix(".weight"), kind, where)
        if s is None:
            continue
        rule: dict[str, Any] = {"pattern": re.escape(path), "format": s.fmt}
        length = tensors[path].shape[tensors[path].quant_axis or 0]
        if s.strategy == "group":
            rule["group_size"] = s.group_size
        elif s.fmt == "int4":  # channel: one group over the whole input dimension
            rule["group_size"] = length
        if s.strategy == "tensor":
            raise ValueError(
                f"{where}: {hf}: per-tensor weight scales are not read (channel/group)"
            )
        if s.activations:
            rule["activations"] = s.activations
            if s.activation_scale == "static":
                rule["activation_scale"] = "static"
        rules.append(rule)
    kv = qc.get("kv_cache_scheme")
    if not kv:
        return {"rules": rules, "kv": {}}, None
    axis = {"tensor": "tensor", "attn_head": "head"}.get(kv.get("strategy"))
    if (kv.get("type"), kv.get("num_bits"), kv.get("dynamic")) != ("float", 8, False) or not axis:
        raise ValueError(
            f"{where}: kv_cache_scheme {kv.get('type')} {kv.get('num_bits')}-bit, strategy "
            f"{kv.get('strategy')!r}, dynamic {kv.get('dynamic')}: tenantq reads static fp8 "
            "KV scales per tensor or attn_head only"
        )
    reader = _Reader(folder)
    scales = {}
    for layer in range(config.num_layers):
        for tensor, name in (("keys", "k_scale"), ("values", "v_scale")):
            key = f"model.layers.{layer}.self_attn.{name}"
            if key not in reader:
                raise ValueError(f"{folder}: kv_cache_scheme is set but {key} is missing")
            scales[(tensor, layer)] = np.asarray(reader.read(key), np.float32)
    kv_part = {
        "key_format": "fp8_e4m3", "key_axis": axis, "value_format": "fp8_e4m3",
        "value_axis": axis,
    }  # fmt: skip
    return {"rules": rules, "kv": kv_part}, StoredKVScales(scales)
