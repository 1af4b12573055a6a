"""Search spaces: trial parameters -> the canonical QuantPlan, on the shipped reference model.

Bounds are exact: a plan either resolves each tensor to the format its parameter names or it
does not; byte counts are compared with `capacity.budget` of an equivalent hand-written plan.
"""

from __future__ import annotations

import optuna
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tenantq.capacity import Deployment, budget, get_model_config
from tenantq.quant.plan import KVPlan, QuantPlan
from tenantq.search.space import (
    SensitivityProfile,
    baseline_params,
    parameter_choices,
    plan_from_params,
    suggest,
)
from tenantq.search.spec import SpaceSpec

CONFIG = get_model_config("tenantq-ref")  # 4 layers, untied lm_head
QUANTIZABLE = [p for p, i in CONFIG.tensors().items() if i.quantizable]


def structured(**kw) -> dict:
    params = {
        "w.attn_qkv": "int4",
        "w.attn_o": "int4",
        "w.mlp_gate_up": "int4",
        "w.mlp_down": "int4",
        "w.embed": "int4",
        "w.lm_head": "int4",
        "bf16_first_layers": 0,
        "bf16_last_layers": 0,
        "kv.key_format": "bf16",
        "kv.key_axis": "channel",
        "kv.value_format": "bf16",
        "kv.sink_tokens": 0,
        "kv.bf16_layers": "none",
    }
    params.update(kw)
    return params


def test_structured_all_int4_equals_uniform_plan_bytes() -> None:
    space = SpaceSpec(group_size=64)
    plan = plan_from_params(space, structured(), CONFIG)
    resolved = plan.resolve(CONFIG)
    assert sorted(resolved) == sorted(QUANTIZABLE)
    assert {(q.format, q.group_size) for q in resolved.values()} == {("int4", 64)}
    # Same bytes to the byte as the one-rule uniform plan (capacity arithmetic is exact).
    dep = Deployment.of("cpu", memory_bytes="9830KiB")
    uniform = QuantPlan.uniform("int4", group_size=64)
    assert (
        budget(CONFIG, plan, dep, 256).weights_bytes
        == budget(CONFIG, uniform, dep, 256).weights_bytes
    )


def test_structured_classes_and_edge_layers() -> None:
    space = SpaceSpec(group_size=64)
    params = structured(**{"w.attn_qkv": "fp8_e4m3", "w.mlp_down": "int8", "w.embed": "bf16"})
    params.update(bf16_first_layers=1, bf16_last_layers=1)
    resolved = plan_from_params(space, params, CONFIG).resolve(CONFIG)
    assert "embed" not in resolved and resolved["lm_head"].format == "int4"
    for layer in (0, 3):  # the first and the last layer keep bf16 weights
        assert not any(p.startswith(f"layers/{layer}/") for p in resolved)
    assert resolved["layers/1/attn/k_proj"].format == "fp8_e4m3"
    assert resolved["layers/2/mlp/down_proj"].format == "int8"
    assert resolved["layers/2/mlp/down_proj"].group_size == 64
    assert resolved["layers/2/attn/o_proj"].format == "int4"


def test_plans_meaning_the_same_share_a_fingerprint() -> None:
    space = SpaceSpec(group_size=64)
    # Every layer kept bf16 by the edge choices: the per-class formats cannot matter.
    a = structured(bf16_first_layers=2, bf16_last_layers=2)
    b = structured(bf16_first_layers=2, bf16_last_layers=2, **{"w.attn_o": "fp8_e4m3"})
    fa = plan_from_params(space, a, CONFIG)
    assert fa.fingerprint() == plan_from_params(space, b, CONFIG).fingerprint()
    assert fa.unused_rules(CONFIG) == []
    # bf16 KV: key axis, sinks and bf16 layers cannot matter either.
    c = structured(**{"kv.key_axis": "token", "kv.sink_tokens": 4, "kv.bf16_layers": "first"})
    assert plan_from_params(space, c, CONFIG).kv == KVPlan()
    assert (
        plan_from_params(space, c, CONFIG).fingerprint()
        == plan_from_params(space, structured(), CONFIG).fingerprint()
    )
    # A quantized KV keeps them.
    d = structured(**{"kv.key_format": "int8", "kv.sink_tokens": 4, "kv.bf16_layers": "first_last"})
    kv = plan_from_params(space, d, CONFIG).kv
    assert (kv.key_format, kv.sink_tokens, kv.bf16_layers) == ("int8", 4, (0, 3))


def test_all_bf16_params_give_the_empty_plan() -> None:
    space = SpaceSpec()
    params = structured(**{k: "bf16" for k in structured() if k.startswith("w.")})
    assert plan_from_params(space, params, CONFIG) == QuantPlan()


def test_missing_parameter_is_named() -> None:
    params = structured()
    del params["kv.key_axis"]
    with pytest.raises(ValueError, match=r"missing .*kv.key_axis"):
        plan_from_params(SpaceSpec(), params, CONFIG)


def test_baselines() -> None:
    space = SpaceSpec(group_size=128)
    plans = [plan_from_params(space, p, CONFIG) for p in baseline_params(space, CONFIG)]
    assert plans[0] == QuantPlan()
    fp8 = plans[1].resolve(CONFIG)
    assert sorted(fp8) == sorted(QUANTIZABLE) and {q.format for q in fp8.values()} == {"fp8_e4m3"}
    assert (plans[1].kv.key_format, plans[1].kv.value_format) == ("fp8_e4m3", "fp8_e4m3")
    int4 = plans[2].resolve(CONFIG)
    assert {(q.format, q.group_size) for q in int4.values()} == {("int4", 128)}
    assert plans[2].kv == KVPlan()
    # A space without int4 cannot express the third baseline: it is left out, not bent.
    assert len(baseline_params(SpaceSpec(weight_formats=["bf16", "fp8_e4m3"]), CONFIG)) == 2


def test_per_tensor_space_one_parameter_per_tensor() -> None:
    space = SpaceSpec(kind="per_tensor", weight_formats=["bf16", "int8"], group_size=64)
    choices = parameter_choices(space, CONFIG)
    weights = [k for k in choices if k.startswith("w.")]
    assert sorted(w[2:] for w in weights) == sorted(QUANTIZABLE)  # 4 x 7 + embed + lm_head
    assert len(weights) == 30
    params = {k: (v[0] if isinstance(v, list) else v.start) for k, v in choices.items()}
    params["w.layers/2/mlp/up_proj"] = "int8"
    resolved = plan_from_params(space, params, CONFIG).resolve(CONFIG)
    assert list(resolved) == ["layers/2/mlp/up_proj"]


def test_sensitivity_space_keeps_the_most_sensitive_in_bf16(tmp_path) -> None:
    # KL per tensor/format, as `tenantq sensitivity` writes it; the larger a tensor's worst
    # kl_mean, the earlier it stays bf16. kv/{i} rows rank the KV layers.
    rows = [
        ("layers/0/mlp/down_proj", "int4", 0.50),
        ("layers/0/mlp/down_proj", "fp8_e4m3", 0.01),
        ("lm_head", "int4", 0.30),
        ("layers/3/attn/v_proj", "int4", 0.20),
        ("embed", "int4", 0.001),
        ("kv/3", "int4", 0.40),
        ("kv/1", "int4", 0.10),
    ]
    path = tmp_path / "profile.parquet"
    pq.write_table(
        pa.table({k: [r[i] for r in rows] for i, k in enumerate(["tensor", "format", "kl_mean"])}),
        path,
    )
    profile = SensitivityProfile.load(path, CONFIG)
    assert profile.tensor_order[:3] == ("layers/0/mlp/down_proj", "lm_head", "layers/3/attn/v_proj")
    assert profile.kv_layer_order == (3, 1)
    space = SpaceSpec(kind="sensitivity", profile=str(path), weight_formats=["int4"])
    params = {
        "sens.format": "int4",
        "sens.keep_bf16": 2,
        "sens.kv_keep_bf16": 1,
        "kv.key_format": "int8",
        "kv.key_axis": "channel",
        "kv.value_format": "int8",
        "kv.sink_tokens": 0,
    }
    plan = plan_from_params(space, params, CONFIG, profile=profile)
    resolved = plan.resolve(CONFIG)
    assert "layers/0/mlp/down_proj" not in resolved and "lm_head" not in resolved
    assert resolved["layers/3/attn/v_proj"].format == "int4"  # third: quantized at k=2
    assert len(resolved) == len(QUANTIZABLE) - 2
    assert plan.kv.bf16_layers == (3,)


def test_sensitivity_profile_from_another_model_is_refused(tmp_path) -> None:
    path = tmp_path / "p.parquet"
    pq.write_table(
        pa.table({"tensor": ["layers/40/mlp/up_proj"], "format": ["int4"], "kl_mean": [1.0]}), path
    )
    with pytest.raises(ValueError, match="not in the model"):
        SensitivityProfile.load(path, CONFIG)


def test_suggest_asks_every_parameter_once() -> None:
    space = SpaceSpec()
    study = optuna.create_study(directions=["maximize"], sampler=optuna.samplers.RandomSampler(0))
    trial = study.ask()
    params = suggest(trial, space, CONFIG)
    assert list(params) == list(parameter_choices(space, CONFIG))
    assert trial.params == params
    plan_from_params(space, params, CONFIG)  # every suggestion is a valid plan
