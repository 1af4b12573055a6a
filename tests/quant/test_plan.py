"""QuantPlan contract: serialisation round trips, stable fingerprint, first-match rules.

QuantPlan behaviour the round-trip tests cannot see (found by `make mutation TARGETS=plan`):
what `resolve` decides per tensor, how the KV part maps onto layers, the constructors, and
the exact one-line errors. Every expected value is read off DESIGN.md's plan contract or
the tiny model (2 layers, context 128; int4's default group is 128 elements).

The KV-axis checks of QuantPlan that the round-trip tests cannot see (found by `make
mutation TARGETS=plan` after the static `tensor`/`head` axes landed): which formats a static
axis accepts, per-layer key vs value formats, the exact one-line error, and `uniform` on a
name that is not a format. Expected values come from plan.py's documented contract:
STATIC_KV_FORMATS = formats with one float32 scale and no block (fp8, int8, int4, int2).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tenantq.quant.plan import (
    DEFAULT_KV_AXES,
    DEFAULT_KV_SCALE_DTYPES,
    FORMAT_NAMES,
    KVPlan,
    LayerKV,
    QuantPlan,
    Rule,
    TensorQuant,
    check_w8a8,
)
from tenantq.testing import tiny_config

PLAN = QuantPlan(
    rules=(
        Rule("layers/.*/mlp/.*", "int4", group_size=128, algorithm="gptq"),
        Rule("layers/0/attn/.*", "int8", activations="int8"),
        Rule(".*", "fp8_e4m3", symmetric=True),
    ),
    kv=KVPlan(
        key_format="fp8_e4m3",
        value_format="int8",
        value_axis="token",
        sink_tokens=4,
        bf16_layers=(0, -1),
        layer_formats=((1, "int4", "int8"),),
    ),
)


def test_json_round_trip_is_exact():
    assert QuantPlan.from_json(PLAN.to_json()) == PLAN


def test_toml_round_trip_is_exact():
    assert QuantPlan.from_toml(PLAN.to_toml()) == PLAN


def test_save_and_load_both_suffixes(tmp_path):
    for name in ("plan.json", "plan.toml"):
        PLAN.save(tmp_path / name)
        assert QuantPlan.load(tmp_path / name) == PLAN


def test_fingerprint_is_stable_across_processes_and_sensitive_to_content():
    code = (
        "from tenantq.quant.plan import QuantPlan; import sys; "
        "print(QuantPlan.from_json(sys.stdin.read()).fingerprint())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], input=PLAN.to_json(), capture_output=True, text=True
    )
    assert other.stdout.strip() == PLAN.fingerprint()
    assert QuantPlan.from_toml(PLAN.to_toml()).fingerprint() == PLAN.fingerprint()
    changed = QuantPlan(rules=PLAN.rules[:2] + (Rule(".*", "fp8_e5m2"),), kv=PLAN.kv)
    assert changed.fingerprint() != PLAN.fingerprint()


def test_first_matching_rule_wins(config):
    resolved = PLAN.resolve(config)
    assert resolved["layers/0/mlp/up_proj"].format == "int4"  # rule 0 before rule 2
    assert resolved["layers/0/attn/q_proj"].format == "int8"
    assert resolved["layers/0/attn/q_proj"].activations == "int8"
    assert resolved["layers/1/attn/q_proj"].format == "fp8_e4m3"
    assert resolved["embed"].axis == 1 and resolved["lm_head"].axis == 0
    assert "layers/0/input_norm" not in resolved  # norms never quantize
    reordered = QuantPlan(rules=(PLAN.rules[2], *PLAN.rules[:2]))
    assert {t.format for t in reordered.resolve(config).values()} == {"fp8_e4m3"}


def test_unused_rules_are_reported_in_order(config):
    plan = QuantPlan(
        rules=(
            Rule(".*", "int8"),
            Rule("layers/.*/mlp/.*", "int4"),  # shadowed by the catch-all
            Rule("layers/9/.*", "fp8_e4m3"),  # no such layer
        )
    )
    assert [r.pattern for r in plan.unused_rules(config)] == ["layers/.*/mlp/.*", "layers/9/.*"]


@pytest.mark.parametrize(
    "raw",
    [
        {"rules": [{"pattern": ".*", "format": "int3"}]},
        {"rules": [], "kv": {"key_format": "int3"}},
    ],
)
def test_unknown_format_error_lists_the_valid_ones(raw):
    with pytest.raises(ValueError, match="int3") as err:
        QuantPlan.from_dict(raw)
    for name in FORMAT_NAMES:
        assert name in str(err.value)


def test_unknown_keys_are_rejected():
    with pytest.raises(ValueError, match="unknown key 'bits'; valid keys here: pattern, format"):
        QuantPlan.from_dict({"rules": [{"pattern": ".*", "format": "int8", "bits": 8}]})


def test_resolve_records_each_rules_decision():
    # Rule order: embed pinned to bf16 first (bf16 = absent from resolve, and later tensors
    # still resolve), then int4 without a group (int4's default group: 128), then int8 with
    # an explicit group of 16, asymmetric, GPTQ; attention matches nothing and stays bf16.
    config = tiny_config()
    plan = QuantPlan(
        rules=(
            Rule("embed", "bf16"),
            Rule("layers/0/mlp/.*", "int4"),
            Rule("layers/1/mlp/.*", "int8", group_size=16, symmetric=False, algorithm="gptq"),
        )
    )
    resolved = plan.resolve(config)
    mlp = {f"layers/{i}/mlp/{m}_proj" for i in (0, 1) for m in ("gate", "up", "down")}
    assert set(resolved) == mlp
    assert resolved["layers/0/mlp/up_proj"] == TensorQuant(
        path="layers/0/mlp/up_proj", format="int4", axis=0, group_size=128, symmetric=True,
        algorithm="rtn", activations=None,
    )  # fmt: skip
    assert resolved["layers/1/mlp/down_proj"] == TensorQuant(
        path="layers/1/mlp/down_proj", format="int8", axis=0, group_size=16, symmetric=False,
        algorithm="gptq", activations=None,
    )  # fmt: skip


def test_resolve_accepts_the_inventory_itself():
    # resolve(config) and resolve(config.tensors()) are documented to be the same.
    config = tiny_config()
    plan = QuantPlan.uniform("fp8_e4m3")
    assert plan.resolve(config.tensors()) == plan.resolve(config)
    assert plan.unused_rules(config.tensors()) == []


def test_uniform_plans():
    # bf16 weights: no rule at all (the baseline is QuantPlan()); otherwise one catch-all.
    # The KV part takes its format's default axes (DEFAULT_KV_AXES: static per-tensor scales
    # for 8-bit formats, KIVI channel/token for 4-bit ones).
    assert QuantPlan.uniform() == QuantPlan()
    key_axis, value_axis = DEFAULT_KV_AXES["int8"]
    assert QuantPlan.uniform("bf16", "int8") == QuantPlan(
        kv=KVPlan("int8", key_axis, "int8", value_axis)
    )
    plan = QuantPlan.uniform("int4", "int4", group_size=32)
    assert plan.rules == (Rule(".*", "int4", group_size=32),)
    assert (plan.kv.key_format, plan.kv.value_format) == ("int4", "int4")
    assert (plan.kv.key_axis, plan.kv.value_axis) == DEFAULT_KV_AXES["int4"]
    assert QuantPlan.uniform("int8").rules == (Rule(".*", "int8"),)


def test_kv_layers_applies_bf16_layers_then_layer_formats_then_the_default():
    # 2 layers: layer -1 is layer 1, kept bf16; layer 0 takes its layer_formats entry.
    config = tiny_config()
    kv = KVPlan("int8", "channel", "fp8_e4m3", "token", bf16_layers=(-1,),
                layer_formats=((0, "int4", "int8"),))  # fmt: skip
    assert QuantPlan(kv=kv).kv_layers(config) == [
        LayerKV("int4", "channel", "int8", "token"),
        LayerKV("bf16", "channel", "bf16", "token"),
    ]
    # One layer in both lists (here by its negative alias) contradicts itself: refused, not
    # resolved by a precedence the user cannot see.
    both = KVPlan("int8", bf16_layers=(-1,), layer_formats=((1, "nvfp4", "nvfp4"),))
    with pytest.raises(ValueError, match=r"kv.bf16_layers: layer -1 is already given in "):
        QuantPlan(kv=both).kv_layers(config)
    by_negative = KVPlan("int8", layer_formats=((-2, "fp8_e5m2", "int4"),))
    assert QuantPlan(kv=by_negative).kv_layers(config) == [
        LayerKV("fp8_e5m2", "channel", "int4", "token"),
        LayerKV("int8", "channel", "bf16", "token"),
    ]
    # The edges of the valid range -n..n-1 and sinks equal to the context are accepted.
    edges = KVPlan("int8", bf16_layers=(-2, 1), sink_tokens=128)
    assert [layer.is_bf16 for layer in QuantPlan(kv=edges).kv_layers(config)] == [True, True]


def test_for_layer_rejects_an_index_outside_the_model():
    kv = KVPlan("int8", bf16_layers=(2,))
    with pytest.raises(ValueError, match=r"kv layer index 2 is out of range .* 2 layers; "):
        kv.for_layer(0, 2)
    with pytest.raises(ValueError, match=r"valid indices are -2\.\.1$"):
        KVPlan("int8", layer_formats=((-3, "int8", "int8"),)).for_layer(0, 2)


def test_check_model_names_the_field_and_the_range():
    config = tiny_config()
    with pytest.raises(ValueError) as err:
        KVPlan(layer_formats=((2, "int8", "int8"),)).check_model(config)
    assert str(err.value) == (
        "kv.layer_formats: layer 2 is out of range for a model of 2 layers; "
        "valid indices are -2..1 (negative counts from the end)"
    )
    with pytest.raises(ValueError) as err:
        KVPlan("int8", sink_tokens=129).check_model(config)
    assert str(err.value) == (
        "kv.sink_tokens: 129 is more than the model's context of 128 tokens; valid: 0..128"
    )
    KVPlan(bf16_layers=(-2,), layer_formats=((-1, "int8", "int8"),)).check_model(config)
    with pytest.raises(ValueError, match=r"^kv.bf16_layers: layer 1 is already given in kv."):
        KVPlan(bf16_layers=(-2, 1), layer_formats=((-1, "int8", "int8"),)).check_model(config)


def test_python_lists_become_tuples_so_plans_compare_and_hash():
    plan = QuantPlan(
        rules=[Rule(".*", "int8")],
        kv=KVPlan(bf16_layers=[0], layer_formats=[[1, "int8", "int4"]]),
    )
    assert plan.rules == (Rule(".*", "int8"),)
    assert plan.kv.bf16_layers == (0,)
    assert plan.kv.layer_formats == ((1, "int8", "int4"),)
    hash(plan)  # frozen dataclass of tuples: usable as a cache key


def test_kv_layer_formats_of_the_wrong_shape_is_one_named_line():
    with pytest.raises(ValueError) as err:
        KVPlan(layer_formats="13")
    assert str(err.value).startswith("kv.layer_formats: Input should be a valid list (got '13')")
    with pytest.raises(ValueError) as err:
        KVPlan(layer_formats=((1, "int8"),))
    assert str(err.value).startswith("kv.layer_formats.0: Input should be a valid dictionary")


def test_error_messages_name_where():
    cases = [
        (lambda: Rule(".*", "int3"), "rule '.*'.format: unknown format 'int3'; valid formats: "),
        (lambda: Rule("layers/(.*", "int8"), "rule 'layers/(.*': invalid regex ("),
        (lambda: Rule.from_dict({"pattern": ".*", "format": "int3"}), "rule.format: unknown"),
        (lambda: Rule.from_dict(7), "rule: expected an object (a table) of fields, got 7"),
        (
            lambda: KVPlan(sink_tokens=-1),
            "kv.sink_tokens: Input should be greater than or equal to 0 (got -1)",
        ),
        (lambda: KVPlan.from_dict({"sink_tokens": -1}), "kv.sink_tokens: Input should be greater"),
        (lambda: KVPlan.from_dict([]), "kv: expected an object (a table) of fields, got []"),
        (lambda: QuantPlan.from_dict({"rule": []}), "plan: unknown key 'rule'; valid keys here: "),
        (lambda: QuantPlan.from_dict(None), "a plan must be an object with 'rules' (a list) "),
        (
            lambda: QuantPlan.from_dict({"kv": {"key_format": "fp4"}}),
            "kv.key_format: unknown format 'fp4'; valid formats: bf16, fp16,",
        ),
        (
            lambda: QuantPlan.from_dict(
                {"rules": [{"pattern": ".*", "format": "int8", "symmetric": "false"}]}
            ),
            "plan rules[0].symmetric: Input should be a valid boolean (got 'false')",
        ),  # fmt: skip
        (
            lambda: QuantPlan.from_dict({"kv": {"layer_formats": [{"layer": 0, "bits": 4}]}}),
            "kv.layer_formats.0: unknown key 'bits'; valid keys here: layer, key_format, "
            "value_format",
        ),
        (
            lambda: QuantPlan.from_dict({"kv": {"layer_formats": [{"key_format": "int8"}]}}),
            "kv.layer_formats.0: required key 'layer' is missing",
        ),
        (
            lambda: QuantPlan.from_dict(
                {"rules": [{"pattern": ".*", "format": "int8", "algorithm": "hqq"}]}
            ),
            "plan rules[0].algorithm: unknown algorithm 'hqq'; valid algorithms: rtn, gptq, awq,",
        ),  # fmt: skip
    ]
    for make, start in cases:
        with pytest.raises(ValueError) as err:
            make()
        assert str(err.value).startswith(start), (start, str(err.value))
    with pytest.raises(ValueError) as err:
        QuantPlan.from_dict(None)
    assert str(err.value).endswith("got NoneType")


def test_w8a8_checks_name_the_tensor_or_rule():
    # DESIGN: W8A8 needs weights in the activations' family, one symmetric scale per channel.
    def tensor(fmt, group_size=None, symmetric=True):
        return TensorQuant("layers/0/mlp/up_proj", fmt, 0, group_size, symmetric, "rtn", "int8")

    with pytest.raises(ValueError) as err:
        check_w8a8(tensor("mxfp4"))
    assert str(err.value) == (
        "layers/0/mlp/up_proj: W8A8 with int8 activations needs weights in int8 or int4, got mxfp4"
    )
    with pytest.raises(ValueError) as err:
        check_w8a8(tensor("int8", symmetric=False))  # no group, but asymmetric
    assert str(err.value) == (
        "layers/0/mlp/up_proj: W8A8 (int8 activations) needs symmetric per-channel weight "
        "scales (no group_size; W4A8 int4 weights may have groups), got group_size=None, "
        "symmetric=False"
    )
    with pytest.raises(ValueError, match=r"^rule '\.\*': W8A8 with fp8_e4m3 activations needs "
                       r"weights in fp8_e4m3 or fp8_e5m2 or int4, got int8$"):  # fmt: skip
        Rule(".*", "int8", activations="fp8_e4m3")
    check_w8a8(tensor("int8"))  # the one valid int8 W8A8 weight passes


def test_asymmetric_rules_round_trip_through_both_files(tmp_path):
    # to_dict writes symmetric only when false; TOML must spell it as the boolean false.
    plan = QuantPlan(rules=(Rule(".*", "int4", group_size=32, symmetric=False),))
    assert plan.to_dict()["rules"] == [
        {"pattern": ".*", "format": "int4", "group_size": 32, "symmetric": False}
    ]
    assert "symmetric = false" in plan.to_toml().splitlines()
    for name in ("p.toml", "p.json"):
        plan.save(tmp_path / name)
        assert QuantPlan.load(tmp_path / name) == plan
    assert sorted(os.listdir(tmp_path)) == ["p.json", "p.toml"]  # no temporary file left


def test_saved_json_is_indented_for_review():
    # Plan files are read and diffed by people: two-space indentation, one key per line.
    lines = QuantPlan.uniform("int8").to_json().splitlines()
    assert lines[:2] == ["{", '  "rules": [']


def test_load_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ValueError) as err:
        QuantPlan.load(missing)
    assert str(err.value) == f"plan file {missing} does not exist"
    with pytest.raises(ValueError) as err:
        QuantPlan.load(tmp_path)
    assert str(err.value) == f"plan file {tmp_path} is a directory; pass a .json or .toml plan file"
    yaml = tmp_path / "p.yaml"
    yaml.write_text("rules: []")
    with pytest.raises(ValueError) as err:
        QuantPlan.load(yaml)
    assert str(err.value) == f"plan file {yaml}: expected a .json or .toml file"
    broken = tmp_path / "p.json"
    broken.write_text("{")
    with pytest.raises(ValueError) as err:
        QuantPlan.load(broken)
    assert str(err.value).startswith(f"plan file {broken}: cannot parse (")
    wrong = tmp_path / "w.json"
    wrong.write_text('{"kv": {"sink_tokens": -1}}')
    with pytest.raises(ValueError) as err:
        QuantPlan.load(wrong)
    assert str(err.value).startswith(
        f"plan file {wrong}: kv.sink_tokens: Input should be greater than or equal to 0 (got -1)"
    )


def test_static_activation_scales_resolve_and_round_trip(tmp_path):
    # Static W8A8 (one calibrated activation scale per linear input): the rule says so, the
    # resolved tensor carries it, and both plan files keep it; dynamic stays implicit.
    rule = Rule("layers/.*/mlp/.*", "int8", activations="int8", activation_scale="static")
    plan = QuantPlan(rules=(rule,))
    assert rule.to_dict() == {
        "pattern": "layers/.*/mlp/.*", "format": "int8", "activations": "int8",
        "activation_scale": "static",
    }  # fmt: skip
    assert plan.resolve(tiny_config())["layers/0/mlp/up_proj"].activation_scale == "static"
    for name in ("s.toml", "s.json"):
        plan.save(tmp_path / name)
        assert QuantPlan.load(tmp_path / name) == plan
    with pytest.raises(ValueError) as err:
        Rule(".*", "int8", activation_scale="static")  # weight-only: no activations to scale
    assert str(err.value) == (
        "rule '.*': activation_scale='static' applies to W8A8 only; "
        "set activations (int8 or fp8_e4m3) or drop activation_scale"
    )


STATIC_LIST = "fp8_e4m3, fp8_e5m2, int8, int4, int2"


def test_static_axis_accepts_bf16_layers():
    # bf16 is the baseline (no scale at all): a static axis is allowed beside it, whether bf16
    # is the plan-wide format or one layer's override.
    plan = KVPlan(key_format="bf16", key_axis="tensor", value_format="int8", value_axis="head")
    assert (plan.key_format, plan.key_axis) == ("bf16", "tensor")
    plan = KVPlan(
        key_format="int8",
        key_axis="tensor",
        value_format="int8",
        value_axis="tensor",
        layer_formats=((1, "bf16", "bf16"),),
    )
    assert plan.layer_formats == ((1, "bf16", "bf16"),)


def test_static_axis_error_names_every_block_format_in_order():
    # Two block formats in the layer overrides of the keys: the message lists both, sorted,
    # joined by ", ", and ends with the two axes that work.
    message = (
        f"kv.key_axis: 'tensor' (a static scale) needs a format with a float32 scale "
        f"({STATIC_LIST}); mxfp4, nvfp4 fixes its own block scales: use 'channel' or 'token'"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        KVPlan(
            key_format="int8",
            key_axis="tensor",
            value_format="int8",
            value_axis="token",
            layer_formats=((1, "nvfp4", "int8"), (0, "mxfp4", "int4")),
        )


def test_key_and_value_axes_see_their_own_layer_formats():
    # A layer override's key format is checked against key_axis, its value format against
    # value_axis, never the other way round.
    # Keys static, a layer's key in mxfp4 (values fine): refused on key_axis.
    with pytest.raises(ValueError, match=r"^kv\.key_axis: 'tensor' .*; mxfp4 fixes"):
        KVPlan(
            key_format="int8",
            key_axis="tensor",
            value_format="int8",
            value_axis="token",
            layer_formats=((1, "mxfp4", "int8"),),
        )
    # Values static, a layer's value in mxfp8 (keys per channel): refused on value_axis.
    with pytest.raises(ValueError, match=r"^kv\.value_axis: 'head' .*; mxfp8 fixes"):
        KVPlan(
            key_format="int8",
            key_axis="channel",
            value_format="int8",
            value_axis="head",
            layer_formats=((0, "int8", "mxfp8"),),
        )
    # Keys static with block-format values on a per-token axis: accepted (keys are int8).
    plan = KVPlan(
        key_format="int8",
        key_axis="tensor",
        value_format="int8",
        value_axis="token",
        layer_formats=((0, "int8", "nvfp4"),),
    )
    assert plan.layer_formats == ((0, "int8", "nvfp4"),)


def test_uniform_on_an_unknown_kv_format_is_a_one_line_value_error():
    # Not a TypeError from unpacking a missing default: the plan's own message.
    with pytest.raises(ValueError, match=r"^kv\.key_format: unknown format 'int3'; valid"):
        QuantPlan.uniform(kv="int3")


def test_every_layer_carries_the_plans_scale_dtype():
    # for_layer has three paths (a bf16 layer, a per-layer override, the plan-wide formats);
    # each LayerKV names the plan's scale_dtype, and so do its key and value specs.
    plan = KVPlan(
        key_format="int8",
        value_format="int4",
        bf16_layers=(0,),
        layer_formats=((1, "int2", "fp8_e4m3"),),
        scale_dtype="bf16",
    )
    assert plan.for_layer(0, 3) == LayerKV("bf16", "channel", "bf16", "token", "bf16")
    assert plan.for_layer(1, 3) == LayerKV("int2", "channel", "fp8_e4m3", "token", "bf16")
    assert plan.for_layer(2, 3) == LayerKV("int8", "channel", "int4", "token", "bf16")
    assert plan.for_layer(1, 3).keys.stored_scale_dtype == "bf16"
    assert plan.for_layer(2, 3).values.stored_scale_dtype == "bf16"


def test_uniform_scale_dtype_defaults_and_override():
    # DEFAULT_KV_SCALE_DTYPES (plan.py, chosen on the quick suite): int4 and int2 store bf16
    # scales by default, every other format float32; an explicit kv_scale_dtype wins (int8's
    # default axes are static, with no page/token scales to store otherwise).
    assert DEFAULT_KV_SCALE_DTYPES == {"int4": "bf16", "int2": "bf16"}
    assert QuantPlan.uniform(kv="int4").kv.scale_dtype == "bf16"
    assert QuantPlan.uniform(kv="int2").kv.scale_dtype == "bf16"
    assert QuantPlan.uniform(kv="int8").kv.scale_dtype == "float32"
    assert QuantPlan.uniform(kv="int4", kv_scale_dtype="e8m0").kv.scale_dtype == "e8m0"
    assert QuantPlan.uniform(kv="int4", kv_scale_dtype="float32").kv.scale_dtype == "float32"


def test_scale_dtype_refusals_are_one_line_and_exact():
    # _check_scale_dtype's three refusals, each with the whole message (plan.py): block
    # formats (sorted, joined by ", ") fix their own scales; E8M0 is for symmetric formats
    # (int2 has a zero point); a setting with no page/token scale to apply to is refused.
    own = (
        "kv.scale_dtype: 'bf16' replaces float32 page/token scales; mxfp4, nvfp4 fixes its own "
        "block scales: use scale_dtype 'float32' or fp8_e4m3, fp8_e5m2, int8, int4, int2"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(own)}$"):
        KVPlan(key_format="nvfp4", value_format="int8", scale_dtype="bf16",
               layer_formats=((0, "mxfp4", "int8"),))  # fmt: skip
    asym = (
        "kv.scale_dtype: 'e8m0' is a power-of-two scale for symmetric formats; int2 "
        "(asymmetric, with a zero point) takes scale_dtype 'float32' or 'bf16'"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(asym)}$"):
        KVPlan(key_format="int4", value_format="int2", scale_dtype="e8m0")
    none = (
        "kv.scale_dtype: 'e8m0' applies to page/token scales, and no quantized KV tensor has "
        "them (bf16 or static tensor/head axes only); use 'float32' or a channel/token axis"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(none)}$"):
        KVPlan(key_format="int8", key_axis="tensor", value_format="bf16", scale_dtype="e8m0")


def test_scale_dtype_accepted_where_it_applies():
    # bf16 scales take int2 (its zero point is stored bf16 too); E8M0 takes symmetric int/fp8
    # with a per-channel/token axis; float32 is accepted with block formats (nothing replaced).
    assert KVPlan(key_format="int2", value_format="int2", scale_dtype="bf16").scale_dtype == "bf16"
    plan = KVPlan(key_format="int4", value_format="fp8_e4m3", scale_dtype="e8m0")
    assert plan.for_layer(0, 1).values.stored_scale_dtype == "e8m0"
    assert KVPlan(key_format="nvfp4", value_format="mxfp4").scale_dtype == "float32"
