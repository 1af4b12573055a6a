"""QuantPlan contract: serialisation round trips, stable fingerprint, first-match rules."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tenantq.quant.plan import FORMAT_NAMES, KVPlan, QuantPlan, Rule

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
