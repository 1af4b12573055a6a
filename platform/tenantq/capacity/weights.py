"""Bytes each chip holds for every weight tensor, in the plan's formats, under tensor parallelism.

Sharding follows the Megatron layout the engine uses: q/k/v and gate/up split their output
columns (by head, by MLP unit), o and down split their input rows; the embedding and an
untied lm_head split the vocabulary when the chip count divides it and are replicated whole
otherwise (as the engine's sharding does); norms are replicated on every chip. A chip's
shard is stored as its own quantized tensor, so its bytes are `storage_nbytes` of the
shard's shape (scales, zero points, packing padding and nvfp4's tensor scale included, per
chip).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tenantq.model.config import ModelConfig
from tenantq.quant.plan import QuantPlan

# Tensor path suffix -> (budget line, axis split across chips or None = replicated).
_SHARDING = {
    "q_proj": ("attention", 1),
    "k_proj": ("attention", 1),
    "v_proj": ("attention", 1),
    "o_proj": ("attention", 0),
    "q_bias": ("attention", 0),
    "k_bias": ("attention", 0),
    "v_bias": ("attention", 0),
    "gate_proj": ("mlp", 1),
    "up_proj": ("mlp", 1),
    "down_proj": ("mlp", 0),
}
SHARDING_LABELS = {
    "embed": "sharded over vocab (whole if chips do not divide it)",
    "lm_head": "sharded over vocab (whole if chips do not divide it)",
    "attention": "sharded over heads",
    "mlp": "sharded over MLP units",
    "norms": "replicated",
}
WEIGHT_LINE_ORDER = ("embed", "lm_head", "attention", "mlp", "norms")


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


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
    """Chips must split attention heads, KV heads and MLP units evenly (no KV replication)."""
    config.check_tensor_parallel(tp, valid_name="chip counts")


def _shard(path: str, shape: tuple[int, ...], tp: int) -> tuple[str, tuple[int, ...]]:
    name = path.rsplit("/", 1)[-1]
    if path == "embed":
        return "embed", (shape[0] // tp, shape[1]) if shape[0] % tp == 0 else shape
    if path == "lm_head":
        return "lm_head", (shape[0], shape[1] // tp) if shape[1] % tp == 0 else shape
    if name in _SHARDING:
        line, axis = _SHARDING[name]
        return line, tuple(d // tp if i == axis else d for i, d in enumerate(shape))
    return "norms", shape  # norms (and anything else 1-d) stay whole on every chip


@lru_cache(maxsize=4096)
def _nbytes(shape: tuple[int, ...], fmt: str, axis: int, group: int | None, sym: bool) -> int:
    from tenantq.numerics import storage_nbytes

    if fmt == "bf16":
        return storage_nbytes(shape, "bf16")
    return storage_nbytes(shape, fmt, axis=axis, group_size=group, symmetric=sym)


def tensor_bytes(config: ModelConfig, plan: QuantPlan, tp: int = 1) -> tuple[TensorBytes, ...]:
    """Every tensor the engine holds, with the bytes one of `tp` chips stores for it."""
    check_tensor_parallel(config, tp)
    resolved = plan.resolve(config)
    out = []
    for path, info in config.tensors().items():
        line, shard_shape = _shard(path, info.shape, tp)
        tq = resolved.get(path)
        if tq is None:
            fmt, group, nbytes = "bf16", None, _nbytes(shard_shape, "bf16", -1, None, True)
        else:
            fmt, group = tq.format, tq.group_size
            nbytes = _nbytes(shard_shape, fmt, tq.axis, group, tq.symmetric)
        out.append(TensorBytes(path, line, info.shape, shard_shape, fmt, group, nbytes))
    return tuple(out)
