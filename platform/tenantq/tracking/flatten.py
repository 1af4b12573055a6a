"""A plan flattened to MLflow params with the same keys in every trial.

Regex rules differ from plan to plan, so they make poor params; what stays comparable is what
each tensor class and the KV cache ended up in, resolved against the model. Those keys are
identical across a study, which the MLflow UI's compare and parallel-coordinates views need.
"""

from __future__ import annotations

import re
from collections import Counter

from tenantq.model.config import ModelConfig
from tenantq.quant.plan import QuantPlan

# Tensor class -> path regex (DESIGN.md tensor paths).
PARAM_CLASSES = {
    "attn_qkv": r"layers/\d+/attn/(q|k|v)_proj",
    "attn_o": r"layers/\d+/attn/o_proj",
    "mlp_gate_up": r"layers/\d+/mlp/(gate|up)_proj",
    "mlp_down": r"layers/\d+/mlp/down_proj",
    "embed": "embed",
    "lm_head": "lm_head",
}


def flatten_plan(plan: QuantPlan, config: ModelConfig) -> dict[str, str]:
    """`weights.<class>` -> format mix ("int4/g128", "bf16 x2, int8 x6"), `kv.*`, fingerprint."""
    resolved = plan.resolve(config)
    out: dict[str, str] = {}
    for name, members in _class_members(config).items():
        labels = Counter(_label(resolved.get(p)) for p in members)
        if not labels:
            out[f"weights.{name}"] = "absent"
        elif len(labels) == 1:
            out[f"weights.{name}"] = next(iter(labels))
        else:
            out[f"weights.{name}"] = ", ".join(f"{k} x{v}" for k, v in sorted(labels.items()))
    kv = plan.kv
    out["kv.key_format"] = kv.key_format
    out["kv.key_axis"] = kv.key_axis
    out["kv.value_format"] = kv.value_format
    out["kv.value_axis"] = kv.value_axis
    out["kv.sink_tokens"] = str(kv.sink_tokens)
    out["kv.bf16_layers"] = ",".join(map(str, kv.bf16_layers)) or "none"
    out["kv.scale_dtype"] = kv.scale_dtype
    out["plan.rules"] = str(len(plan.rules))
    out["plan.fingerprint"] = plan.fingerprint()
    return out


_MEMBERS: dict[int, tuple[ModelConfig, dict[str, list[str]]]] = {}


def _class_members(config: ModelConfig) -> dict[str, list[str]]:
    """Tensor class -> the model's quantizable paths in it, once per config object (a study
    flattens every trial's plan against the same model)."""
    held = _MEMBERS.get(id(config))
    if held is not None and held[0] is config:
        return held[1]
    paths = [p for p, info in config.tensors().items() if info.quantizable]
    members = {
        name: [p for p in paths if re.fullmatch(pattern, p)]
        for name, pattern in PARAM_CLASSES.items()
    }
    if len(_MEMBERS) >= 8:
        _MEMBERS.clear()
    _MEMBERS[id(config)] = (config, members)
    return members


def _label(tq) -> str:
    """A tensor's label: "int4/g128", plus "+gptq" for a calibrated algorithm and "+W8A8 int8"
    (", static") for quantized activations: plans that differ only there must differ here."""
    if tq is None:
        return "bf16"
    label = tq.format + (f"/g{tq.group_size}" if tq.group_size else "")
    if tq.algorithm != "rtn":
        label += f"+{tq.algorithm}"
    if tq.activations:
        static = ", static" if tq.activation_scale == "static" else ""
        label += f"+W8A8 {tq.activations}{static}"
    return label
