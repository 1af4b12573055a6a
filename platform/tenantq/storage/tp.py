"""The tensor-parallel layout: which axis of each tensor is split across chips (Megatron).

One table, read by the engine when it places arrays (`engine.sharding`) and by the capacity
planner when it counts the bytes one chip holds (`capacity.weights`), so both split the
same tensors the same way. Pure Python: no JAX.
"""

from __future__ import annotations

from typing import Any

from tenantq.model.checks import check_positive_int
from tenantq.model.config import ModelConfig

# Megatron layout. Tensor name -> (budget line, axis split across chips); weights are stored
# [in, out], so q/k/v and gate/up split their output columns (by head, by MLP unit), o and
# down their input rows (the all-reduce follows), the q/k/v biases their one axis.
# Everything not named here (norms, o_bias) is replicated on every chip.
TP_LAYOUT: dict[str, tuple[str, int]] = {
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
# The vocabulary axis of the embedding [vocab, hidden] and an untied lm_head [hidden, vocab].
# Split only when the chips divide the vocabulary (even shards, as `NamedSharding` needs);
# otherwise both tensors are replicated whole on every chip (no padding is added).
VOCAB_AXIS = {"embed": 0, "lm_head": 1}


def check_tp(config: ModelConfig, tp: Any, *, valid_name: str = "tp values") -> int:
    """`tp` as an int once it is a positive integer that splits heads, KV heads and MLP units
    evenly (KV heads are sharded, never replicated); the one check the engine and planner use."""
    check_positive_int("tp (chips)", tp)
    config.check_tensor_parallel(tp, valid_name=valid_name)
    return tp


def vocab_replicated(config: ModelConfig, tp: int) -> bool:
    """True when `tp` chips do not divide the vocabulary, so embed/lm_head stay whole."""
    return config.vocab_size % tp != 0


def tp_line(path: str) -> str:
    """The budget line of tensor `path`: embed, lm_head, attention, mlp or norms (replicated)."""
    if path in VOCAB_AXIS:
        return path
    entry = TP_LAYOUT.get(path.rsplit("/", 1)[-1])
    return "norms" if entry is None else entry[0]


def tp_split_axis(path: str, config: ModelConfig, tp: int) -> int | None:
    """The axis of tensor `path` split across `tp` chips, or None when it is replicated."""
    if path in VOCAB_AXIS:
        return None if vocab_replicated(config, tp) else VOCAB_AXIS[path]
    entry = TP_LAYOUT.get(path.rsplit("/", 1)[-1])
    return None if entry is None else entry[1]


def shard_shape(path: str, shape: tuple[int, ...], config: ModelConfig, tp: int) -> tuple[int, ...]:
    """The shape one of `tp` chips stores of tensor `path` (whole shape when replicated)."""
    axis = tp_split_axis(path, config, tp)
    return tuple(d // tp if i == axis else d for i, d in enumerate(shape))


def kv_heads_per_chip(config: ModelConfig, tp: int) -> int:
    """KV heads one of `tp` chips holds (checked: chips divide them)."""
    return config.num_kv_heads // check_tp(config, tp)
