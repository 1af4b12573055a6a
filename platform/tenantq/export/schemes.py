"""What each tenantq format becomes in a compressed-tensors checkpoint, and what is refused.

The mapping is decided here once, from the plan alone (no weights needed), so that the
search and the report can ask whether a front plan is exportable before anything is
written. compressed-tensors describes a weight by `num_bits`, `type` (int/float),
`strategy` (tensor/channel/group) and `group_size`; its compressors `pack-quantized`
(int weight-only, packed into int32), `int-quantized` (int W8A8, plain int8) and
`float-quantized`/`naive-quantized` (fp8 E4M3 with/without input activations, as the
library's `infer_module_format` names them) store codes and float32 scales
whose dequantization, `(q - zero_point) * scale`, is the same float32 product tenantq's
codec computes, so the export is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenantq.model.config import ModelConfig, TensorInfo
from tenantq.quant.plan import QuantPlan, TensorQuant

# The compressed-tensors release the format was written against and tested with (the
# `parity` extra pins it).
COMPRESSED_TENSORS_VERSION = "0.20.1"
PACK_QUANTIZED = "pack-quantized"  # int weight-only: codes packed into int32
INT_QUANTIZED = "int-quantized"  # int W8A8: plain int8 `weight`
FLOAT_QUANTIZED = "float-quantized"  # fp8 W8A8: plain F8_E4M3 `weight`
NAIVE_QUANTIZED = "naive-quantized"  # fp8 weight-only: plain F8_E4M3 `weight`
# The compressor of each (weight type, with input activations?) pair, as compressed-tensors
# 0.20.1's own `infer_module_format` picks it (vLLM reads wNa16 only without input quant).
COMPRESSORS = {
    ("int", False): PACK_QUANTIZED,
    ("int", True): INT_QUANTIZED,
    ("float", False): NAIVE_QUANTIZED,
    ("float", True): FLOAT_QUANTIZED,
}
# tenantq weight format -> (compressed-tensors type, num_bits).
WEIGHT_FORMATS = {"int8": ("int", 8), "int4": ("int", 4), "fp8_e4m3": ("float", 8)}
# Weight formats refused, and why (one line each; `docs/guide/export.md` has the table).
REFUSED_WEIGHT_FORMATS = {
    "fp16": "a plain fp16 cast has no compressed-tensors scheme (keep it bf16)",
    "fp8_e5m2": "compressed-tensors' float scheme is E4M3 only",
    "mxfp8": "compressed-tensors 0.20.1 reads MX blocks, but tenantq's export is not "
    "verified bit-exact for them yet",
    "mxfp4": "compressed-tensors 0.20.1 reads MX blocks, but tenantq's export is not "
    "verified bit-exact for them yet",
    "nvfp4": "compressed-tensors 0.20.1 decompresses nvfp4 in bfloat16 and stores the "
    "tensor scale as its reciprocal, so no export of it can be bit-exact",
}


QUANTIZED_EMBEDDING = (
    "a quantized embedding does not run from compressed-tensors (transformers cannot run "
    "one it loads; vLLM serves embeddings unquantized): keep embed bf16"
)


FP8_GROUPS = (
    "fp8 weights with group_size: vLLM's fp8 schemes read tensor, channel or block scales, "
    "not group (drop group_size for per-channel fp8)"
)
LM_HEAD = "lm_head"
QUANTIZED_LM_HEAD = (
    "a quantized lm_head does not load in vLLM (its ParallelLMHead gets no "
    "compressed-tensors method): keep lm_head bf16 or pass --quantize-lm-head"
)


class NotExportable(ValueError):
    """A plan part compressed-tensors cannot express (one line naming it)."""


@dataclass(frozen=True)
class WeightScheme:
    """One quantized weight's compressed-tensors description (hashable: equal schemes share
    a config group)."""

    type: str
    num_bits: int
    compressor: str
    strategy: str  # "channel" | "group"
    group_size: int | None
    symmetric: bool
    activations: str | None  # W8A8 activation format
    activation_scale: str  # "dynamic" | "static"

    def weights_args(self) -> dict:
        return {
            "num_bits": self.num_bits,
            "type": self.type,
            "symmetric": self.symmetric,
            "group_size": self.group_size,
            "strategy": self.strategy,
            "dynamic": False,
            "actorder": None,
            "block_structure": None,
            "observer": "minmax",
            "observer_kwargs": {},
        }

    def input_args(self) -> dict | None:
        if self.activations is None:
            return None
        static = self.activation_scale == "static"
        return {
            "num_bits": 8,
            "type": "int" if self.activations == "int8" else "float",
            "symmetric": True,
            "group_size": None,
            "strategy": "tensor" if static else "token",
            "dynamic": not static,
            "actorder": None,
            "block_structure": None,
            "observer": "minmax" if static else None,
            "observer_kwargs": {},
        }


def weight_scheme(
    how: TensorQuant, info: TensorInfo, *, quantize_lm_head: bool = False
) -> WeightScheme:
    """The scheme of one resolved tensor, or NotExportable naming the tensor and why.
    `quantize_lm_head` lets a quantized lm_head through (transformers reads it, vLLM not)."""
    if info.kind == "embedding":
        raise NotExportable(f"{how.path}: {how.format}: {QUANTIZED_EMBEDDING}")
    if how.format in REFUSED_WEIGHT_FORMATS:
        raise NotExportable(f"{how.path}: {how.format}: {REFUSED_WEIGHT_FORMATS[how.format]}")
    if how.path == LM_HEAD and not quantize_lm_head:
        raise NotExportable(f"{how.path}: {how.format}: {QUANTIZED_LM_HEAD}")
    kind, bits = WEIGHT_FORMATS[how.format]
    compressor = COMPRESSORS[(kind, how.activations is not None)]
    length = info.shape[how.axis]
    groups = 1 if how.group_size is None else -(-length // how.group_size)
    if kind == "float" and groups > 1:
        raise NotExportable(f"{how.path}: group_size {how.group_size}: {FP8_GROUPS}")
    if groups > 1 and length % how.group_size:
        raise NotExportable(
            f"{how.path}: group_size {how.group_size} does not divide its input dimension "
            f"{length} (compressed-tensors groups must; use a divisor of {length})"
        )
    if not how.symmetric:
        raise NotExportable(
            f"{how.path}: asymmetric {how.format} (zero points): compressed-tensors "
            f"{COMPRESSED_TENSORS_VERSION} cannot load them (its load path expects the zero "
            "points unpacked, then unpacks them); use symmetric: true"
        )
    strategy = "group" if groups > 1 else "channel"
    return WeightScheme(
        kind, bits, compressor, strategy, how.group_size if groups > 1 else None,
        how.symmetric, how.activations, how.activation_scale,
    )  # fmt: skip


def kv_scheme(plan: QuantPlan, config: ModelConfig) -> dict | None:
    """The `kv_cache_scheme` of the plan's KV part (None: bf16 cache), or NotExportable.

    compressed-tensors (and vLLM, which serves it) has one KV scheme for every layer: fp8
    E4M3 with static scales per tensor or per KV head. Sink tokens, bf16 layers, per-layer
    formats, other formats and per-page (channel/token) scales are refused.
    """
    layers = plan.kv_layers(config)
    if all(layer.is_bf16 for layer in layers):
        return None
    kv = plan.kv
    if kv.sink_tokens:
        raise NotExportable(
            f"kv.sink_tokens = {kv.sink_tokens}: compressed-tensors has no unquantized sink "
            "tokens (use 0)"
        )
    for i, layer in enumerate(layers):
        if (layer.key_format, layer.value_format) != ("fp8_e4m3", "fp8_e4m3"):
            raise NotExportable(
                f"kv layer {i}: keys {layer.key_format}, values {layer.value_format}: "
                "compressed-tensors stores one KV format for every layer, fp8_e4m3 only"
            )
    if kv.key_axis != kv.value_axis or kv.key_axis not in ("tensor", "head"):
        raise NotExportable(
            f"kv.key_axis {kv.key_axis!r}, kv.value_axis {kv.value_axis!r}: compressed-tensors "
            "KV scales are static and shared by keys and values, 'tensor' or 'head' for both"
        )
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": None,
        "strategy": "tensor" if kv.key_axis == "tensor" else "attn_head",
        "dynamic": False,
        "actorder": None,
        "block_structure": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }


def export_problems(
    plan: QuantPlan, config: ModelConfig, *, quantize_lm_head: bool = False
) -> list[str]:
    """Every part of `plan` a compressed-tensors export of `config` would refuse, one line
    each (empty: exportable as it stands). For the search's front and the report."""
    problems = []
    tensors = config.tensors()
    for path, how in plan.resolve(config).items():
        try:
            weight_scheme(how, tensors[path], quantize_lm_head=quantize_lm_head)
        except NotExportable as err:
            problems.append(str(err))
    try:
        kv_scheme(plan, config)
    except (NotExportable, ValueError) as err:
        problems.append(str(err))
    return problems
