"""QuantPlan behaviour the round-trip tests cannot see (found by `make mutation TARGETS=plan`):
what `resolve` decides per tensor, how the KV part maps onto layers, the constructors, and
the exact one-line errors. Every expected value is read off DESIGN.md's plan contract or
the tiny model (2 layers, context 128; int4's default group is 128 elements).
"""

from __future__ import annotations

import os

import pytest

from tenantq.quant.plan import (
    DEFAULT_KV_AXES,
    KVPlan,
    LayerKV,
    QuantPlan,
    Rule,
    TensorQuant,
    check_w8a8,
)
from tenantq.testing import tiny_config


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
