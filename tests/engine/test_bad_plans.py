"""Bad plans: wrong keys, types and values are one ValueError line naming the field, the value
and what is allowed; nothing is read silently wrong ("false" as true, "13" as layers 1 and 3).
"""

from __future__ import annotations

import json

import pytest

from tenantq.capacity import Deployment, budget
from tenantq.quant.plan import FORMAT_NAMES, KVPlan, QuantPlan, Rule
from tenantq.testing import tiny_config

RULE = {"pattern": ".*", "format": "int8"}

# (case, plan dict, fragments the message must hold)
PLAN_DICTS = [
    ("symmetric as a string", {"rules": [{**RULE, "symmetric": "false"}]},
     ["rules[0].symmetric", "'false'", "valid boolean"]),
    ("bf16_layers as a string", {"kv": {"bf16_layers": "13"}},
     ["kv.bf16_layers", "'13'", "valid list"]),
    ("bf16_layers as an int", {"kv": {"bf16_layers": 0}}, ["kv.bf16_layers", "0", "valid list"]),
    ("bf16_layers of strings", {"kv": {"bf16_layers": ["1"]}},
     ["kv.bf16_layers.0", "'1'", "valid integer"]),
    ("rules as an object", {"rules": {"pattern": ".*", "format": "int8"}},
     ["plan.rules", "valid list"]),
    ("kv as a string", {"kv": "fp8_e4m3"}, ["plan.kv", "'fp8_e4m3'", "valid dictionary"]),
    ("pattern as a number", {"rules": [{"pattern": 5, "format": "int8"}]},
     ["rules[0].pattern", "5", "valid string"]),
    ("rule as a number", {"rules": [7]}, ["plan.rules.0", "7", "valid dictionary"]),
    ("unknown format", {"rules": [{**RULE, "format": "int3"}]},
     ["rules[0].format", "unknown format 'int3'", *FORMAT_NAMES]),
    ("unknown kv format", {"kv": {"key_format": "fp4"}}, ["kv.key_format", "'fp4'", "nvfp4"]),
    ("unknown axis", {"kv": {"value_axis": "block"}},
     ["kv.value_axis", "'block'", "channel, token, tensor, head"]),
    ("static axis on a block format", {"kv": {"key_format": "mxfp4", "key_axis": "tensor"}},
     ["kv.key_axis", "'tensor'", "mxfp4", "fp8_e4m3, fp8_e5m2, int8, int4, int2", "'channel'"]),
    ("int2 weights", {"rules": [{**RULE, "format": "int2"}]},
     ["rules[0].format", "int2 is a KV-cache format only", "nvfp4"]),
    ("group_size zero", {"rules": [{**RULE, "group_size": 0}]},
     ["rules[0].group_size", "0", "greater than 0"]),
    ("group_size float", {"rules": [{**RULE, "group_size": 32.0}]},
     ["rules[0].group_size", "32.0", "valid integer"]),
    ("group_size string", {"rules": [{**RULE, "group_size": "32"}]},
     ["rules[0].group_size", "'32'", "valid integer"]),
    ("sink_tokens negative", {"kv": {"sink_tokens": -1}},
     ["kv.sink_tokens", "-1", "greater than or equal to 0"]),
    ("sink_tokens float", {"kv": {"sink_tokens": 4.5}}, ["kv.sink_tokens", "4.5", "integer"]),
    ("sink_tokens bool", {"kv": {"sink_tokens": True}}, ["kv.sink_tokens", "True", "integer"]),
    ("unknown rule key", {"rules": [{**RULE, "bits": 8}]},
     ["rules[0]", "unknown key 'bits'", "pattern, format, group_size"]),
    ("unknown kv key", {"kv": {"sinks": 4}}, ["kv", "unknown key 'sinks'", "sink_tokens"]),
    ("unknown plan key", {"rule": []}, ["plan", "unknown key 'rule'", "rules, kv"]),
    ("rule without format", {"rules": [{"pattern": ".*"}]},
     ["rules[0]", "required key 'format' is missing"]),
    ("layer format without layer", {"kv": {"layer_formats": [{"key_format": "int8"}]}},
     ["kv.layer_formats.0", "required key 'layer' is missing"]),
    ("unknown algorithm", {"rules": [{**RULE, "algorithm": "hqq"}]},
     ["rules[0].algorithm", "'hqq'", "rtn, gptq, awq, smoothquant"]),
    ("W8A8 with groups", {"rules": [{**RULE, "activations": "int8", "group_size": 64}]},
     ["W8A8", "per-channel", "group_size=64"]),
    ("W8A8 across families", {"rules": [{**RULE, "activations": "fp8_e4m3"}]},
     ["W8A8 with fp8_e4m3 activations", "fp8_e4m3 or fp8_e5m2", "got int8"]),
    ("bad regex", {"rules": [{**RULE, "pattern": "layers/(.*"}]}, ["invalid regex"]),
    ("plan as a list", [RULE], ["a plan must be an object", "'rules'", "got list"]),
]  # fmt: skip


@pytest.mark.parametrize(("case", "raw", "fragments"), PLAN_DICTS, ids=[c[0] for c in PLAN_DICTS])
def test_bad_plan_is_one_named_line(case, raw, fragments) -> None:
    with pytest.raises(ValueError) as err:
        QuantPlan.from_dict(raw)
    message = str(err.value)
    assert "\n" not in message, case
    for fragment in fragments:
        assert fragment in message, (case, fragment, message)


def test_python_construction_is_checked_as_strictly() -> None:
    for make, fragment in [
        (lambda: KVPlan(bf16_layers="13"), "kv.bf16_layers: .* \\(got '13'\\)"),
        (lambda: KVPlan(sink_tokens=2.0), "kv.sink_tokens: .* \\(got 2.0\\)"),
        (lambda: Rule(".*", "int8", symmetric="false"), "symmetric: .* \\(got 'false'\\)"),
        (lambda: Rule(".*", "int4", group_size=True), "group_size: .* \\(got True\\)"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            make()


# (case, plan meeting a 2-layer, 128-token model, fragments)
AGAINST_THE_MODEL = [
    ("bf16 layer past the end", KVPlan("int8", bf16_layers=(2,)),
     ["kv.bf16_layers", "layer 2", "2 layers", "-2..1"]),
    ("bf16 layer before the start", KVPlan("int8", bf16_layers=(-3,)), ["layer -3", "-2..1"]),
    ("layer format past the end", KVPlan(layer_formats=((5, "int8", "int8"),)),
     ["kv.layer_formats", "layer 5", "-2..1"]),
    ("sinks beyond the context", KVPlan("int8", sink_tokens=129),
     ["kv.sink_tokens", "129", "context of 128 tokens", "0..128"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "kv", "fragments"), AGAINST_THE_MODEL, ids=[c[0] for c in AGAINST_THE_MODEL]
)
def test_kv_plan_is_checked_against_the_model_it_meets(case, kv, fragments) -> None:
    # Both the planner and the engine's pool read a layer's KV storage through kv_storage.
    plan = QuantPlan(kv=kv)
    for meet in (
        lambda: plan.kv_layers(tiny_config()),
        lambda: budget(tiny_config(), plan, Deployment.of("cpu", memory_bytes="1GiB"), 64),
    ):
        with pytest.raises(ValueError) as err:
            meet()
        for fragment in fragments:
            assert fragment in str(err.value), (case, fragment, str(err.value))


def test_plan_files(tmp_path) -> None:
    plan = QuantPlan.uniform("int8", "fp8_e4m3")
    upper = tmp_path / "PLAN.JSON"
    upper.write_text(plan.to_json())
    assert QuantPlan.load(upper) == plan  # a capitalised suffix is still JSON
    with pytest.raises(ValueError, match="is a directory; pass a .json or .toml plan file"):
        QuantPlan.load(tmp_path)
    with pytest.raises(ValueError, match="expected a .json or .toml file"):
        (tmp_path / "plan.yaml").write_text("rules: []")
        QuantPlan.load(tmp_path / "plan.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kv": {"bf16_layers": "13"}}))
    with pytest.raises(ValueError, match=r"plan file .*bad.json: kv.bf16_layers: .* \(got '13'\)"):
        QuantPlan.load(bad)
    toml = tmp_path / "bad.toml"
    toml.write_text('[kv]\nsink_tokens = "4"\n')
    with pytest.raises(
        ValueError, match=r"bad.toml: kv.sink_tokens: Input should be a valid integer \(got '4'\)"
    ):
        QuantPlan.load(toml)


def test_the_fingerprint_of_an_existing_plan_is_unchanged() -> None:
    # DESIGN.md's example plan, fingerprinted before typed validation was added (main at
    # 0635206): the same plan must keep its MLflow and cache keys.
    raw = {
        "rules": [
            {"pattern": "layers/.*/mlp/.*", "format": "int4", "group_size": 128,
             "algorithm": "rtn"},
            {"pattern": ".*", "format": "fp8_e4m3"},
        ],
        "kv": {"key_format": "fp8_e4m3", "key_axis": "channel", "value_format": "fp8_e4m3",
               "value_axis": "token", "sink_tokens": 4, "bf16_layers": [0, -1]},
    }  # fmt: skip
    assert QuantPlan.from_dict(raw).fingerprint() == "6dce9b7da8e60fa2"
