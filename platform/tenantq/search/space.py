"""Search spaces: how an Optuna trial's parameters become a `QuantPlan`.

`suggest(trial, space, config)` asks the trial for its parameters (define-by-run, so every
sampler sees the same names); `plan_from_params(space, params, config)` is the one function
that turns parameters into the plan a worker runs and MLflow records. Plans are made
canonical (rules that match nothing dropped, KV details that cannot matter reset) so two
parameter sets meaning the same thing share a fingerprint and are evaluated once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenantq.model.config import ModelConfig
from tenantq.quant.plan import (
    DEFAULT_KV_AXES,
    STATIC_KV_AXES,
    STATIC_KV_FORMATS,
    KVPlan,
    QuantPlan,
    Rule,
)
from tenantq.search.spec import SpaceSpec

# Structured tensor classes: parameter name -> regex over tensor paths (DESIGN.md paths).
TENSOR_CLASSES: dict[str, str] = {
    "w.attn_qkv": r"layers/\d+/attn/(q|k|v)_proj",
    "w.attn_o": r"layers/\d+/attn/o_proj",
    "w.mlp_gate_up": r"layers/\d+/mlp/(gate|up)_proj",
    "w.mlp_down": r"layers/\d+/mlp/down_proj",
    "w.embed": "embed",
    "w.lm_head": "lm_head",
}
EMBED_CLASSES = ("w.embed", "w.lm_head")
# Formats whose default granularity is per channel; the spec's group size applies to these.
GROUPED_FORMATS = ("int4", "int8")
KV_BF16_LAYERS = {"none": (), "first": (0,), "last": (-1,), "first_last": (0, -1)}


def suggest(trial: Any, space: SpaceSpec, config: ModelConfig, profile=None) -> dict[str, Any]:
    """Ask `trial` (an optuna Trial) for this space's parameters; returns them."""
    params: dict[str, Any] = {}
    for name, choices in parameter_choices(space, config, profile).items():
        if isinstance(choices, range):
            params[name] = trial.suggest_int(name, choices.start, choices.stop - 1)
        else:
            params[name] = trial.suggest_categorical(name, list(choices))
    return params


def distributions(choices: dict[str, list | range]) -> dict[str, Any]:
    """The Optuna distribution `suggest` asks each parameter with (samplers that declare a
    search space must declare these: Optuna refuses a suggestion of another kind)."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    return {
        name: IntDistribution(c.start, c.stop - 1)
        if isinstance(c, range)
        else CategoricalDistribution(list(c))
        for name, c in choices.items()
    }


def parameter_choices(
    space: SpaceSpec, config: ModelConfig, profile: SensitivityProfile | None = None
) -> dict[str, list | range]:
    """Every parameter of the space and its choices, in a fixed order."""
    out: dict[str, list | range] = {}
    embed_formats = space.embed_formats or space.weight_formats
    if space.kind == "structured":
        if space.uniform_weights:
            out["w.linear"] = space.weight_formats
        for name in TENSOR_CLASSES:
            if space.uniform_weights and name not in EMBED_CLASSES:
                continue
            if name == "w.lm_head" and "lm_head" not in config.tensors():
                continue  # tied embeddings: one tensor
            out[name] = embed_formats if name in EMBED_CLASSES else space.weight_formats
        out["bf16_first_layers"] = _layer_choices(space.bf16_first_layers, config)
        out["bf16_last_layers"] = _layer_choices(space.bf16_last_layers, config)
    elif space.kind == "per_tensor":
        for path, info in config.tensors().items():
            if info.quantizable:
                kind_formats = embed_formats if info.kind == "embedding" else space.weight_formats
                fmts = embed_formats if path == "lm_head" else kind_formats
                out[f"w.{path}"] = fmts
    else:
        if profile is None:
            raise ValueError("the sensitivity space needs its profile loaded")
        out["sens.format"] = [f for f in space.weight_formats if f != "bf16"] or ["bf16"]
        top = len(profile.tensor_order)
        # max_keep_bf16 = 0 keeps no tensor in bf16; absent (None), every ranked one may be
        cap = top if space.max_keep_bf16 is None else min(top, space.max_keep_bf16)
        out["sens.keep_bf16"] = range(0, cap + 1)
        if profile.kv_layer_order:
            out["sens.kv_keep_bf16"] = range(0, len(profile.kv_layer_order) + 1)
    out["kv.key_format"] = space.key_formats
    out["kv.key_axis"] = space.key_axes
    out["kv.value_format"] = space.value_formats
    if space.value_axes != ["token"]:  # a parameter only when searched (older studies: none)
        out["kv.value_axis"] = space.value_axes
    out["kv.sink_tokens"] = space.sink_tokens
    if space.kv_scale_dtypes != ["float32"]:  # a parameter only when searched (older: none)
        out["kv.scale_dtype"] = space.kv_scale_dtypes
    if space.kind != "sensitivity" or profile is None or not profile.kv_layer_order:
        out["kv.bf16_layers"] = space.kv_bf16_layers
    return out


def _layer_choices(choices: list[int], config: ModelConfig) -> list[int]:
    bad = [c for c in choices if c > config.num_layers]
    if bad:
        raise ValueError(
            f"space: bf16 edge-layer choices {bad} exceed the model's {config.num_layers} layers"
        )
    return choices


def plan_from_params(
    space: SpaceSpec,
    params: dict[str, Any],
    config: ModelConfig,
    *,
    algorithm: str = "rtn",
    profile: SensitivityProfile | None = None,
) -> QuantPlan:
    """The one function from trial parameters to the canonical `QuantPlan`."""
    expected = parameter_choices(space, config, profile)
    missing = sorted(set(expected) - set(params))
    if missing:
        raise ValueError(f"parameters missing for space {space.kind!r}: {missing}")

    def rule(pattern: str, fmt: str, how: str = algorithm) -> Rule:
        group = space.group_size if fmt in GROUPED_FORMATS else None
        return Rule(pattern, fmt, group_size=group, algorithm=how)

    # The embedding is a gather, not a matmul: it has no input activations for gptq, awq or
    # smoothquant to use, so it is always rounded to nearest (RTN) whatever the spec says.
    embed_patterns = {"embed"}  # the embedding's path, a regex matching only itself

    rules: list[Rule] = []
    kv_bf16: tuple[int, ...] = KV_BF16_LAYERS[params.get("kv.bf16_layers", "none")]
    if space.kind == "structured":
        edge = _edge_layers(params["bf16_first_layers"], params["bf16_last_layers"], config)
        if edge:
            rules.append(Rule(rf"layers/({'|'.join(map(str, edge))})/.*", "bf16"))
        for name, pat in TENSOR_CLASSES.items():
            fmt = params.get(name, params.get("w.linear") if name not in EMBED_CLASSES else None)
            if fmt is not None:
                rules.append(rule(pat, fmt, "rtn" if pat in embed_patterns else algorithm))
    elif space.kind == "per_tensor":
        for name, fmt in params.items():
            if name.startswith("w."):
                pat = re.escape(name[2:])
                rules.append(rule(pat, fmt, "rtn" if pat in embed_patterns else algorithm))
    else:
        assert profile is not None
        keep = profile.tensor_order[: params["sens.keep_bf16"]]
        rules += [Rule(re.escape(path), "bf16") for path in keep]
        if algorithm != "rtn":
            rules.append(rule(re.escape("embed"), params["sens.format"], "rtn"))
        rules.append(rule(".*", params["sens.format"]))
        if "sens.kv_keep_bf16" in params:
            kv_bf16 = tuple(sorted(profile.kv_layer_order[: params["sens.kv_keep_bf16"]]))
    # bf16 tensors need no rule unless they shadow a later one; drop rules that match nothing.
    rules = _drop_trailing_bf16(rules)
    draft = QuantPlan(rules=tuple(rules))
    unused = {id(r) for r in draft.unused_rules(config)}
    rules = _drop_trailing_bf16([r for r in rules if id(r) not in unused])
    kv = _canonical_kv(params, kv_bf16, config)
    return QuantPlan(rules=tuple(rules), kv=kv)


def _edge_layers(first: int, last: int, config: ModelConfig) -> list[int]:
    n = config.num_layers
    return sorted(set(range(min(first, n))) | set(range(max(0, n - last), n)))


def _drop_trailing_bf16(rules: list[Rule]) -> list[Rule]:
    """A bf16 rule with no quantizing rule after it changes nothing: unmatched stays bf16."""
    while rules and rules[-1].format == "bf16":
        rules = rules[:-1]
    return [
        r
        for i, r in enumerate(rules)
        if r.format != "bf16" or any(later.format != "bf16" for later in rules[i + 1 :])
    ]


def _canonical_kv(params: dict[str, Any], bf16_layers: tuple[int, ...], config: ModelConfig):
    key, value = params["kv.key_format"], params["kv.value_format"]
    n = config.num_layers
    layers = tuple(sorted({i % n for i in bf16_layers}))
    if key == "bf16" and value == "bf16":
        return KVPlan()  # axis, sinks and bf16 layers cannot matter
    if len(layers) == n:
        return KVPlan()
    kv = KVPlan(
        key_format=key,
        key_axis=_kv_axis(key, params["kv.key_axis"], 0),
        value_format=value,
        value_axis=_kv_axis(value, params.get("kv.value_axis", "token"), 1),
        sink_tokens=int(params["kv.sink_tokens"]),
        bf16_layers=layers,
    )
    scale_dtype = params.get("kv.scale_dtype", "float32")
    # the plan refuses a scale dtype that cannot apply (e8m0 with int2, MX/nvfp4, static
    # axes only): float32 stays, so such parameters share the float32 plan's fingerprint
    with contextlib.suppress(ValueError):
        kv = dataclasses.replace(kv, scale_dtype=scale_dtype)
    return kv


def _kv_axis(fmt: str, axis: str, which: int) -> str:
    """The axis a KV tensor of `fmt` really gets: bf16 has none (the default stands in); a
    static axis on a format without one float scale falls back to the format's default."""
    if fmt == "bf16" or (axis in STATIC_KV_AXES and fmt not in STATIC_KV_FORMATS):
        return DEFAULT_KV_AXES[fmt][which] if fmt != "bf16" else ("channel", "token")[which]
    return axis


# ---------------------------------------------------------------- baselines
def baseline_params(space: SpaceSpec, config: ModelConfig, profile=None) -> list[dict[str, Any]]:
    """The baselines the study starts with, as this space's parameters: all bf16; fp8 weights
    with fp8 KV; int4 (group 128) weights with bf16 KV. Ones the space cannot express are
    left out."""
    choices = parameter_choices(space, config, profile)
    wanted = [("bf16", "bf16"), ("fp8_e4m3", "fp8_e4m3"), ("int4", "bf16")]
    out = []
    for weights, kv in wanted:
        params: dict[str, Any] = {}
        for name, opts in choices.items():
            if name.startswith("w."):
                params[name] = weights
            elif name in ("bf16_first_layers", "bf16_last_layers", "sens.kv_keep_bf16"):
                params[name] = 0
            elif name == "sens.format":
                params[name] = weights
            elif name == "sens.keep_bf16":
                params[name] = len(profile.tensor_order) if weights == "bf16" else 0
            elif name in ("kv.key_format", "kv.value_format"):
                params[name] = kv
            elif name == "kv.key_axis":
                params[name] = "channel" if "channel" in opts else opts[0]
            elif name == "kv.value_axis":
                params[name] = "token" if "token" in opts else opts[0]
            elif name == "kv.sink_tokens":
                params[name] = min(opts)
            elif name == "kv.scale_dtype":
                params[name] = "float32" if "float32" in opts else opts[0]
            elif name == "kv.bf16_layers":
                params[name] = "none" if "none" in opts else opts[0]
        if all(_allowed(choices[k], v) for k, v in params.items()):
            out.append(params)
    return out


def _allowed(choices: list | range, value: Any) -> bool:
    return value in choices


# ---------------------------------------------------------------- sensitivity profile
@dataclass(frozen=True)
class SensitivityProfile:
    """Tensors (and KV layers, rows `kv/{i}`) ordered most sensitive first by mean KL."""

    tensor_order: tuple[str, ...]
    kv_layer_order: tuple[int, ...]

    @classmethod
    def load(cls, path: str | Path, config: ModelConfig) -> SensitivityProfile:
        """Read the table `tenantq sensitivity` writes (Parquet or Arrow IPC) with columns
        tensor, format, kl_mean; a tensor's sensitivity is its largest kl_mean over formats."""
        from tenantq.evals.profile import read_profile_table  # evals loads JAX: only here

        p = Path(path)
        table = read_profile_table(p, config.num_layers)
        worst: dict[str, float] = {}
        for tensor, kl in zip(
            table.column("tensor").to_pylist(), table.column("kl_mean").to_pylist(), strict=True
        ):
            worst[tensor] = max(worst.get(tensor, float("-inf")), float(kl))
        inventory = {p for p, info in config.tensors().items() if info.quantizable}
        kv_rows = {t: v for t, v in worst.items() if t.startswith("kv/")}
        weight_rows = {t: v for t, v in worst.items() if not t.startswith("kv/")}
        unknown = sorted(set(weight_rows) - inventory)
        if unknown:
            raise ValueError(
                f"sensitivity profile {p}: tensors not in the model: {unknown[:3]} "
                "(was it measured on another model?)"
            )

        def ranked(rows: dict[str, float]) -> list[str]:
            return sorted(rows, key=lambda t: (-rows[t], t))

        kv_layers = [int(t.split("/", 1)[1]) for t in ranked(kv_rows)]
        return cls(tuple(ranked(weight_rows)), tuple(kv_layers))
