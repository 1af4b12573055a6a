"""Bytes each chip holds for every weight tensor, in the plan's formats, under tensor parallelism.

Sharding follows `tenantq.storage.tp`'s layout table, the one the engine places arrays
with (Megatron: q/k/v and gate/up split their output columns, o and down their input rows;
embed and an untied lm_head split the vocabulary when the chips divide it and are
replicated whole otherwise; norms are replicated). A chip's shard is stored as its own
quantized tensor, so its bytes are `storage_nbytes` of the shard's shape (scales, zero
points, packing padding and nvfp4's tensor scale included, per chip).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tenantq.model.config import ModelConfig
from tenantq.quant.plan import STATIC_ACT_SCALE_BYTES, QuantPlan
from tenantq.storage.tp import check_tp, shard_shape, tp_line

_SHARDING_LABELS = {
    "attention": "sharded over heads",
    "mlp": "sharded over MLP units",
    "norms": "replicated",
}
WEIGHT_LINE_ORDER = ("embed", "lm_head", "attention", "mlp", "norms")


def sharding_label(line: str, tp: int, vocab_replicated: bool) -> str:
    """How budget line `line` is laid out over `tp` chips, in words."""
    if tp == 1:
        return "whole (1 chip)"
    if line in ("embed", "lm_head"):
        if vocab_replicated:
            return f"replicated (vocab not divisible by {tp} chips)"
        return "sharded over vocab"
    return _SHARDING_LABELS[line]


@dataclass(frozen=True)
class TensorBytes:
    """One tensor of the model as one chip holds it."""

    path: str
    line: str  # embed | lm_head | attention | mlp | norms
    shape: tuple[int, ...]  # the whole tensor
    shard_shape: tuple[int, ...]  # what one chip stores
    format: str  # "bf16" or the plan's format
    group_size: int | None
    bytes_per_chip: int

    @property
    def label(self) -> str:
        return self.format if self.group_size is None else f"{self.format}/g{self.group_size}"


@lru_cache(maxsize=4096)
def _nbytes(shape: tuple[int, ...], fmt: str, axis: int, group: int | None, sym: bool) -> int:
    from tenantq.numerics import storage_nbytes

    if fmt == "bf16":
        return storage_nbytes(shape, "bf16")
    return storage_nbytes(shape, fmt, axis=axis, group_size=group, symmetric=sym)


def tensor_bytes(config: ModelConfig, plan: QuantPlan, tp: int = 1) -> tuple[TensorBytes, ...]:
    """Every tensor the engine holds, with the bytes one of `tp` chips stores for it."""
    check_tp(config, tp, valid_name="chip counts")
    resolved = plan.resolve(config)
    out = []
    for path, info in config.tensors().items():
        shard = shard_shape(path, info.shape, config, tp)
        tq = resolved.get(path)
        if tq is None:
            fmt, group, nbytes = "bf16", None, _nbytes(shard, "bf16", -1, None, True)
        else:
            fmt, group = tq.format, tq.group_size
            nbytes = _nbytes(shard, fmt, tq.axis, group, tq.symmetric)
            if tq.activation_scale == "static":  # replicated: every chip holds it
                nbytes += STATIC_ACT_SCALE_BYTES
        out.append(TensorBytes(path, tp_line(path), info.shape, shard, fmt, group, nbytes))
    return tuple(out)
