"""The plan built from Optuna parameters, written out by hand: every parameter a space
declares (`parameter_choices`, in its fixed order), every rule `plan_from_params` writes for
them (pattern, format, group size, algorithm, in order), and the canonical KV part
(`_canonical_kv`).

The expected values are read off the space's definition (search/space.py's module
docstring, `TENSOR_CLASSES`, `SpaceSpec`'s fields) and the model's tensor inventory
(tenantq-ref: 4 layers, untied lm_head), not computed by the code under test: a choice list,
a rule or a KV field that differs in any way fails.
"""

from __future__ import annotations

import dataclasses

import pytest

from tenantq.capacity import get_model_config
from tenantq.quant.plan import KVPlan, QuantPlan, Rule
from tenantq.search.space import (
    SensitivityProfile,
    _canonical_kv,
    parameter_choices,
    plan_from_params,
)
from tenantq.search.spec import SpaceSpec

CONFIG = get_model_config("tenantq-ref")  # 4 layers, untied lm_head
TIED = dataclasses.replace(CONFIG, tie_word_embeddings=True)  # no lm_head tensor
LINEAR = ["attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj", "mlp/gate_proj",
          "mlp/up_proj", "mlp/down_proj"]  # fmt: skip
# The structured classes' regexes, as TENSOR_CLASSES writes them.
QKV, O = r"layers/\d+/attn/(q|k|v)_proj", r"layers/\d+/attn/o_proj"
GATE_UP, DOWN = r"layers/\d+/mlp/(gate|up)_proj", r"layers/\d+/mlp/down_proj"
WEIGHTS = ["bf16", "fp8_e4m3", "int8", "int4"]  # SpaceSpec's default choices
KV_DEFAULTS = {
    "kv.key_format": WEIGHTS,
    "kv.key_axis": ["channel", "token"],
    "kv.value_format": WEIGHTS,
    "kv.sink_tokens": [0, 4],
    "kv.bf16_layers": ["none", "first_last"],
}


def _kv(key="bf16", value="bf16", **more) -> dict:
    out = {"kv.key_format": key, "kv.key_axis": "channel", "kv.value_format": value}
    out |= {"kv.sink_tokens": 0, "kv.bf16_layers": "none"}
    return out | {k.replace("__", "."): v for k, v in more.items()}


# ---------------------------------------------------------------- parameter_choices
def test_the_default_structured_space_declares_each_class_then_the_kv_in_order() -> None:
    got = parameter_choices(SpaceSpec(), CONFIG)
    assert list(got.items()) == [
        ("w.attn_qkv", WEIGHTS), ("w.attn_o", WEIGHTS), ("w.mlp_gate_up", WEIGHTS),
        ("w.mlp_down", WEIGHTS), ("w.embed", WEIGHTS), ("w.lm_head", WEIGHTS),
        ("bf16_first_layers", [0, 1]), ("bf16_last_layers", [0, 1]),
        *KV_DEFAULTS.items(),
    ]  # fmt: skip


def test_embed_formats_apply_to_embed_and_lm_head_only() -> None:
    space = SpaceSpec(weight_formats=["int8", "int4"], embed_formats=["bf16", "fp8_e4m3"])
    got = parameter_choices(space, CONFIG)
    assert {k: v for k, v in got.items() if k.startswith("w.")} == {
        "w.attn_qkv": ["int8", "int4"], "w.attn_o": ["int8", "int4"],
        "w.mlp_gate_up": ["int8", "int4"], "w.mlp_down": ["int8", "int4"],
        "w.embed": ["bf16", "fp8_e4m3"], "w.lm_head": ["bf16", "fp8_e4m3"],
    }  # fmt: skip


def test_uniform_weights_is_one_linear_parameter_beside_embed_and_lm_head() -> None:
    space = SpaceSpec(uniform_weights=True, weight_formats=["int8"], embed_formats=["int4"])
    got = parameter_choices(space, CONFIG)
    assert list(got)[:5] == ["w.linear", "w.embed", "w.lm_head", "bf16_first_layers",
                             "bf16_last_layers"]  # fmt: skip
    assert (got["w.linear"], got["w.embed"], got["w.lm_head"]) == (["int8"], ["int4"], ["int4"])


def test_tied_embeddings_have_no_lm_head_parameter() -> None:
    # a tied model holds one tensor, `embed`, for both ends (ModelConfig.tensors)
    assert "lm_head" not in TIED.tensors()
    got = parameter_choices(SpaceSpec(), TIED)
    assert [k for k in got if k.startswith("w.")] == [
        "w.attn_qkv",
        "w.attn_o",
        "w.mlp_gate_up",
        "w.mlp_down",
        "w.embed",
    ]
    uniform = parameter_choices(SpaceSpec(uniform_weights=True), TIED)
    assert [k for k in uniform if k.startswith("w.")] == ["w.linear", "w.embed"]


def test_per_tensor_declares_each_quantizable_tensor_in_the_models_order() -> None:
    space = SpaceSpec(kind="per_tensor", weight_formats=["int8"], embed_formats=["fp8_e4m3"])
    got = parameter_choices(space, CONFIG)
    names = ["embed", *(f"layers/{i}/{t}" for i in range(4) for t in LINEAR), "lm_head"]
    weights = {k: v for k, v in got.items() if k.startswith("w.")}
    assert list(weights) == [f"w.{n}" for n in names]  # no norms: they are not quantizable
    assert weights["w.embed"] == weights["w.lm_head"] == ["fp8_e4m3"]
    assert all(weights[f"w.{n}"] == ["int8"] for n in names[1:-1])
    assert list(got)[len(weights) :] == list(KV_DEFAULTS)
    # embed_formats absent: every tensor takes weight_formats
    plain = parameter_choices(SpaceSpec(kind="per_tensor", weight_formats=["int4"]), CONFIG)
    assert plain["w.embed"] == plain["w.lm_head"] == plain["w.layers/0/attn/q_proj"] == ["int4"]


def test_a_profile_given_to_another_space_kind_adds_no_sensitivity_parameter() -> None:
    # the capacity-aware sampler passes its per_tensor prior's profile (search/checks.py)
    profile = SensitivityProfile(("lm_head",), (1, 0))
    got = parameter_choices(SpaceSpec(kind="per_tensor"), CONFIG, profile)
    assert not any(k.startswith("sens.") for k in got)
    assert got["kv.bf16_layers"] == ["none", "first_last"]
    assert parameter_choices(SpaceSpec(), CONFIG, profile) == parameter_choices(SpaceSpec(), CONFIG)


def _sensitivity(**kw) -> SpaceSpec:
    return SpaceSpec(kind="sensitivity", profile="p.parquet", **kw)


PROFILE = SensitivityProfile(("layers/0/mlp/down_proj", "lm_head", "embed"), (3, 1))


def test_the_sensitivity_space_declares_format_k_kv_k_then_the_kv() -> None:
    got = parameter_choices(_sensitivity(), CONFIG, PROFILE)
    assert list(got.items()) == [
        ("sens.format", ["fp8_e4m3", "int8", "int4"]),  # bf16 is k = every tensor
        ("sens.keep_bf16", range(0, 4)),  # 0..3 of the profile's 3 tensors
        ("sens.kv_keep_bf16", range(0, 3)),  # 0..2 of its 2 KV layers
        *((k, v) for k, v in KV_DEFAULTS.items() if k != "kv.bf16_layers"),
    ]
    # a profile without KV rows: no KV k; the bf16 KV layers are asked as elsewhere
    no_kv = parameter_choices(_sensitivity(), CONFIG, SensitivityProfile(("lm_head",), ()))
    assert list(no_kv.items()) == [
        ("sens.format", ["fp8_e4m3", "int8", "int4"]),
        ("sens.keep_bf16", range(0, 2)),
        *KV_DEFAULTS.items(),
    ]
    only_bf16 = parameter_choices(_sensitivity(weight_formats=["bf16"]), CONFIG, PROFILE)
    assert only_bf16["sens.format"] == ["bf16"]


def test_the_sensitivity_space_without_its_profile_is_refused() -> None:
    with pytest.raises(ValueError) as err:
        parameter_choices(_sensitivity(), CONFIG)
    assert str(err.value) == "the sensitivity space needs its profile loaded"


def test_kv_axes_and_scale_dtypes_are_parameters_only_when_searched() -> None:
    plain = parameter_choices(SpaceSpec(), CONFIG)
    assert "kv.value_axis" not in plain and "kv.scale_dtype" not in plain
    space = SpaceSpec(value_axes=["token", "channel"], kv_scale_dtypes=["float32", "bf16"])
    got = list(parameter_choices(space, CONFIG).items())[8:]
    assert got == [
        ("kv.key_format", WEIGHTS), ("kv.key_axis", ["channel", "token"]),
        ("kv.value_format", WEIGHTS), ("kv.value_axis", ["token", "channel"]),
        ("kv.sink_tokens", [0, 4]), ("kv.scale_dtype", ["float32", "bf16"]),
        ("kv.bf16_layers", ["none", "first_last"]),
    ]  # fmt: skip
    # one choice other than the default is still a parameter (its value changes the plan)
    one = parameter_choices(SpaceSpec(value_axes=["channel"], kv_scale_dtypes=["bf16"]), CONFIG)
    assert one["kv.value_axis"] == ["channel"] and one["kv.scale_dtype"] == ["bf16"]


def test_edge_layer_choices_past_the_model_are_named() -> None:
    with pytest.raises(ValueError) as err:
        parameter_choices(SpaceSpec(bf16_first_layers=[0, 5, 4, 6]), CONFIG)
    assert str(err.value) == "space: bf16 edge-layer choices [5, 6] exceed the model's 4 layers"
    last = parameter_choices(SpaceSpec(bf16_last_layers=[4, 0]), CONFIG)["bf16_last_layers"]
    assert last == [4, 0]  # the model's depth itself is a choice: every layer


# ---------------------------------------------------------------- plan_from_params
def _structured(**weights) -> dict:
    names = ["w.attn_qkv", "w.attn_o", "w.mlp_gate_up", "w.mlp_down", "w.embed", "w.lm_head"]
    params = {n: "int4" for n in names} | {"bf16_first_layers": 0, "bf16_last_layers": 0}
    return params | {k.replace("__", "."): v for k, v in weights.items()} | _kv()


def test_structured_rules_are_one_per_class_in_order_with_group_and_algorithm() -> None:
    space = SpaceSpec(group_size=64)
    params = _structured(w__attn_qkv="fp8_e4m3", w__attn_o="int8", w__embed="int8")
    plan = plan_from_params(space, params, CONFIG, algorithm="gptq")
    assert plan.rules == (
        Rule(QKV, "fp8_e4m3", group_size=None, algorithm="gptq"),  # fp8: no group
        Rule(O, "int8", group_size=64, algorithm="gptq"),
        Rule(GATE_UP, "int4", group_size=64, algorithm="gptq"),
        Rule(DOWN, "int4", group_size=64, algorithm="gptq"),
        Rule("embed", "int8", group_size=64, algorithm="rtn"),  # a gather: always RTN
        Rule("lm_head", "int4", group_size=64, algorithm="gptq"),  # a matmul: the algorithm
    )
    assert plan.kv == KVPlan()
    rtn = plan_from_params(space, params, CONFIG)  # the default algorithm
    assert {r.algorithm for r in rtn.rules} == {"rtn"}


def test_edge_layers_become_one_bf16_rule_before_the_classes() -> None:
    params = _structured(bf16_first_layers=1, bf16_last_layers=1, w__attn_o="bf16")
    plan = plan_from_params(SpaceSpec(), params, CONFIG)
    assert plan.rules[:2] == (Rule("layers/(0|3)/.*", "bf16"), Rule(QKV, "int4", group_size=128))
    # the bf16 o_proj rule shadows the quantizing rules after it only for o_proj: kept
    assert plan.rules[2] == Rule(O, "bf16")
    resolved = plan.resolve(CONFIG)
    assert not any(p.startswith(("layers/0/", "layers/3/")) for p in resolved)
    assert resolved["layers/1/attn/q_proj"].format == "int4" and "layers/1/attn/o_proj" not in (
        resolved
    )
    one = plan_from_params(SpaceSpec(), _structured(bf16_first_layers=2), CONFIG)
    assert one.rules[0] == Rule("layers/(0|1)/.*", "bf16")


def test_uniform_weights_give_every_linear_class_the_linear_format() -> None:
    space = SpaceSpec(uniform_weights=True)
    params = {"w.linear": "int8", "w.embed": "fp8_e4m3", "w.lm_head": "int4"}
    params |= {"bf16_first_layers": 0, "bf16_last_layers": 0} | _kv()
    plan = plan_from_params(space, params, CONFIG)
    assert plan.rules == (
        Rule(QKV, "int8", group_size=128), Rule(O, "int8", group_size=128),
        Rule(GATE_UP, "int8", group_size=128), Rule(DOWN, "int8", group_size=128),
        Rule("embed", "fp8_e4m3"), Rule("lm_head", "int4", group_size=128),
    )  # fmt: skip
    tied = dict(params)
    del tied["w.lm_head"]
    assert plan_from_params(space, tied, TIED).rules == plan.rules[:5]


def test_trailing_bf16_rules_and_rules_matching_nothing_are_dropped() -> None:
    # lm_head bf16 is the last rule: nothing after it to shadow, so it is no rule at all
    params = _structured(w__lm_head="bf16", w__embed="bf16", w__mlp_down="fp8_e4m3")
    assert plan_from_params(SpaceSpec(), params, CONFIG).rules == (
        Rule(QKV, "int4", group_size=128),
        Rule(O, "int4", group_size=128),
        Rule(GATE_UP, "int4", group_size=128),
        Rule(DOWN, "fp8_e4m3"),
    )
    # every layer bf16 by the edge rule: the class rules after it match nothing and go;
    # the edge rule stays, a quantizing rule (embed) follows it
    every = _structured(bf16_first_layers=2, bf16_last_layers=2, w__lm_head="bf16")
    assert plan_from_params(SpaceSpec(), every, CONFIG).rules == (
        Rule("layers/(0|1|2|3)/.*", "bf16"),
        Rule("embed", "int4", group_size=128),
    )
    # every weight bf16 too: no rule at all
    none = _structured(bf16_first_layers=2, bf16_last_layers=2, w__lm_head="bf16", w__embed="bf16")
    assert plan_from_params(SpaceSpec(), none, CONFIG).rules == ()


def test_per_tensor_rules_are_the_escaped_paths_in_the_models_order() -> None:
    space = SpaceSpec(kind="per_tensor", group_size=32)
    names = ["embed", *(f"layers/{i}/{t}" for i in range(4) for t in LINEAR), "lm_head"]
    formats = dict.fromkeys(names, "bf16") | {"embed": "int8", "layers/2/mlp/up_proj": "fp8_e4m3",
                                              "layers/3/attn/q_proj": "int4"}  # fmt: skip
    params = {f"w.{n}": f for n, f in formats.items()} | _kv()
    plan = plan_from_params(space, params, CONFIG, algorithm="awq")
    # each tensor's own rule, in the model's order, up to the last quantizing one (the bf16
    # rules after it change nothing: dropped); embed rounds to nearest whatever the algorithm
    last = names.index("layers/3/attn/q_proj")
    assert plan.rules == (
        Rule("embed", "int8", group_size=32, algorithm="rtn"),
        *(Rule(n, formats[n], group_size=32 if formats[n] == "int4" else None, algorithm="awq")
          for n in names[1 : last + 1]),
    )  # fmt: skip
    assert plan.rules[names.index("layers/2/mlp/up_proj")] == Rule(
        "layers/2/mlp/up_proj", "fp8_e4m3", algorithm="awq"
    )
    resolved = plan.resolve(CONFIG)
    assert set(resolved) == {"embed", "layers/2/mlp/up_proj", "layers/3/attn/q_proj"}


def test_sensitivity_rules_keep_the_first_k_in_bf16_then_quantize_the_rest() -> None:
    space = _sensitivity(group_size=64)
    params = {"sens.format": "int4", "sens.keep_bf16": 2, "sens.kv_keep_bf16": 0}
    params |= {k: v for k, v in _kv().items() if k != "kv.bf16_layers"}
    plan = plan_from_params(space, params, CONFIG, profile=PROFILE)
    assert plan.rules == (
        Rule("layers/0/mlp/down_proj", "bf16"),
        Rule("lm_head", "bf16"),
        Rule(".*", "int4", group_size=64),
    )
    # another algorithm: the embedding keeps RTN in a rule of its own before the catch-all
    gptq = plan_from_params(space, params | {"sens.keep_bf16": 1}, CONFIG, algorithm="gptq",
                            profile=PROFILE)  # fmt: skip
    assert gptq.rules == (
        Rule("layers/0/mlp/down_proj", "bf16"),
        Rule("embed", "int4", group_size=64, algorithm="rtn"),
        Rule(".*", "int4", group_size=64, algorithm="gptq"),
    )
    assert plan.kv == KVPlan()


def test_sensitivity_kv_k_keeps_the_most_sensitive_kv_layers_in_bf16() -> None:
    params = {"sens.format": "fp8_e4m3", "sens.keep_bf16": 0, "sens.kv_keep_bf16": 2}
    params |= {k: v for k, v in _kv("int8", "int8").items() if k != "kv.bf16_layers"}
    plan = plan_from_params(_sensitivity(), params, CONFIG, profile=PROFILE)
    assert plan.rules == (Rule(".*", "fp8_e4m3"),)
    assert plan.kv == KVPlan("int8", "channel", "int8", "token", bf16_layers=(1, 3))
    one = plan_from_params(_sensitivity(), params | {"sens.kv_keep_bf16": 1}, CONFIG,
                           profile=PROFILE)  # fmt: skip
    assert one.kv.bf16_layers == (3,)
    # a profile without KV rows: the bf16 KV layers come from the kv.bf16_layers parameter
    no_kv = SensitivityProfile(PROFILE.tensor_order, ())
    params = (
        {"sens.format": "int8", "sens.keep_bf16": 0}
        | _kv("int8", "int8")
        | {"kv.bf16_layers": "first_last"}
    )
    assert plan_from_params(_sensitivity(), params, CONFIG, profile=no_kv).kv.bf16_layers == (0, 3)


def test_the_kv_bf16_layers_parameter_names_the_edge_layers() -> None:
    got = {
        choice: plan_from_params(
            SpaceSpec(), _structured() | _kv("int8", "int8", kv__bf16_layers=choice), CONFIG
        ).kv.bf16_layers
        for choice in ("none", "first", "last", "first_last")
    }
    assert got == {"none": (), "first": (0,), "last": (3,), "first_last": (0, 3)}


def test_missing_parameters_are_named_sorted() -> None:
    params = _structured()
    del params["w.mlp_down"], params["kv.key_axis"]
    with pytest.raises(ValueError) as err:
        plan_from_params(SpaceSpec(), params, CONFIG)
    assert str(err.value) == (
        "parameters missing for space 'structured': ['kv.key_axis', 'w.mlp_down']"
    )


# ---------------------------------------------------------------- _canonical_kv
def test_the_kv_plan_carries_every_parameter_of_a_quantized_kv() -> None:
    params = _kv("int4", "int8", kv__key_axis="token", kv__value_axis="channel",
                 kv__sink_tokens=4, kv__scale_dtype="bf16")  # fmt: skip
    assert _canonical_kv(params, (-1, 0, 4), CONFIG) == KVPlan(
        key_format="int4", key_axis="token", value_format="int8", value_axis="channel",
        sink_tokens=4, bf16_layers=(0, 3), scale_dtype="bf16",
    )  # fmt: skip  # -1 is the last layer, 4 wraps to the first; sorted, once each
    # the value axis and scale dtype, when not parameters, are the defaults
    plain = _kv("int4", "int4")
    assert _canonical_kv(plain, (), CONFIG) == KVPlan("int4", "channel", "int4", "token")


@pytest.mark.parametrize(("key", "value"), [("bf16", "int8"), ("int8", "bf16")])
def test_one_quantized_kv_side_is_a_quantized_kv(key, value) -> None:
    params = _kv(key, value, kv__key_axis="token", kv__sink_tokens=4)
    kv = _canonical_kv(params, (0,), CONFIG)
    assert (kv.key_format, kv.value_format, kv.sink_tokens, kv.bf16_layers) == (key, value, 4, (0,))
    # bf16 has no axis: it takes the plain plan's ("channel" for keys, "token" for values)
    assert kv.key_axis == ("channel" if key == "bf16" else "token")


def test_a_kv_that_stays_bf16_everywhere_is_the_plain_kv() -> None:
    params = _kv(kv__key_axis="token", kv__sink_tokens=4, kv__scale_dtype="bf16")
    assert _canonical_kv(params, (0, -1), CONFIG) == KVPlan()
    quantized = _kv("int8", "int4", kv__sink_tokens=4)
    assert _canonical_kv(quantized, (0, 1, 2, 3), CONFIG) == KVPlan()  # every layer bf16
    assert _canonical_kv(quantized, (0, -1, 1, -2), CONFIG) == KVPlan()  # the same four
    three = _canonical_kv(quantized, (0, 1, 2), CONFIG)
    assert three.bf16_layers == (0, 1, 2) and three.key_format == "int8"


def test_a_scale_dtype_the_formats_cannot_use_stays_float32() -> None:
    # e8m0 cannot store int2's zero points, MX formats carry their own block scales
    # (quant.plan._check_scale_dtype): the plan is the float32 one, the same fingerprint
    e8m0 = _canonical_kv(_kv("int2", "int2", kv__scale_dtype="e8m0"), (), CONFIG)
    assert e8m0 == KVPlan("int2", "channel", "int2", "token")
    mx = _canonical_kv(_kv("mxfp4", "int4", kv__scale_dtype="bf16"), (), CONFIG)
    assert mx.scale_dtype == "float32"
    ok = _canonical_kv(_kv("int4", "int4", kv__scale_dtype="e8m0"), (), CONFIG)
    assert ok.scale_dtype == "e8m0"


def test_the_kv_plan_is_what_plan_from_params_returns() -> None:
    params = _structured() | _kv("fp8_e4m3", "int4", kv__sink_tokens=4, kv__bf16_layers="last")
    plan = plan_from_params(SpaceSpec(), params, CONFIG)
    assert plan.kv == KVPlan("fp8_e4m3", "channel", "int4", "token", 4, (3,))
    assert plan == QuantPlan(plan.rules, plan.kv)
