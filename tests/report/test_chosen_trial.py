"""Which trial the report puts forward, and what a trial record says about itself.

Records are built by hand (no store): the report reads only runs' params, metrics and tags.
The chosen trial is the one a reader would ship: the shippable front trial with the most
tenants; only when no front trial is shippable does an unshippable one stand in.
"""

from __future__ import annotations

import pytest

from tenantq.report.study import StudyRecord, TrialRecord

BF16 = {"weights.mlp": "bf16", "weights.attn": "bf16", "kv.key_format": "bf16"}
BF16 |= {"kv.value_format": "bf16", "kv.bf16_layers": "none"}
INT4 = {"weights.mlp": "int4", "weights.attn": "fp8_e4m3", "kv.key_format": "fp8_e4m3"}
INT4 |= {"kv.value_format": "int4", "kv.bf16_layers": "0,-1"}


def _trial(number, tenants, *, front=True, shippable=True, params=INT4, status="FINISHED",
           tags=None, metrics=None):  # fmt: skip
    t = {"tenantq.pareto": "true" if front else "false"}
    t["tenantq.shippable"] = "true" if shippable else "false"
    m = {} if tenants is None else {"capacity.tenants": float(tenants)}
    return TrialRecord(
        number=number, run_id=f"run{number}", status=status, params=dict(params),
        metrics=m | (metrics or {}), tags=t | (tags or {}), logged_ms=0,
    )  # fmt: skip


def _study(*trials, params=None) -> StudyRecord:
    return StudyRecord("sqlite:///m.db", "exp", "s", "parent", params or {}, {}, list(trials))


def test_the_chosen_trial_is_the_shippable_front_trial_with_most_tenants() -> None:
    study = _study(
        _trial(0, 16, params=BF16),  # the baseline: most quality, never the chosen plan
        _trial(1, 60, shippable=False),  # more tenants but fails a gate
        _trial(2, 40),
        _trial(3, 30),
        _trial(4, 50, front=False),  # shippable, off the front
    )
    assert study.choose_trial().number == 2


def test_an_unshippable_front_trial_stands_in_only_when_none_is_shippable() -> None:
    study = _study(_trial(1, 60, shippable=False), _trial(2, 70, front=False))
    assert study.choose_trial().number == 1
    off_front = _study(_trial(1, 30, front=False), _trial(2, 40, front=False, shippable=False))
    assert off_front.choose_trial().number == 2  # then any completed non-bf16 trial
    only_bf16 = _study(_trial(0, 16, params=BF16), _trial(1, 90, status="FAILED"))
    assert only_bf16.choose_trial().number == 0
    assert _study(_trial(1, 90, status="FAILED")).choose_trial() is None


def test_ties_in_tenants_choose_the_earlier_trial() -> None:
    assert _study(_trial(5, 40), _trial(3, 40), _trial(4, 40)).choose_trial().number == 3


def test_a_named_trial_is_chosen_as_asked_and_a_failed_or_missing_one_refused() -> None:
    study = _study(_trial(1, 30), _trial(2, 60, status="FAILED"), _trial(3, None))
    assert study.choose_trial(1).number == 1
    with pytest.raises(ValueError, match=r"^--trial 2 failed; choose a completed trial$"):
        study.choose_trial(2)
    with pytest.raises(ValueError, match=r"^--trial 9 is not in study 's'; completed: 1$"):
        study.choose_trial(9)
    two = _study(_trial(4, 30), _trial(6, 20))
    with pytest.raises(ValueError, match=r"completed: 4, 6$"):
        two.choose_trial(9)
    empty = _study(_trial(2, 60, status="FAILED"))
    with pytest.raises(ValueError, match=r"completed: none$"):
        empty.choose_trial(7)


def test_completed_trials_have_tenants_and_did_not_fail() -> None:
    study = _study(_trial(0, 16, params=BF16), _trial(1, 30, status="FAILED"), _trial(2, None))
    assert [t.number for t in study.completed] == [0]
    assert study.bf16.number == 0
    assert _study(_trial(1, 30)).bf16 is None


def test_a_trial_is_bf16_only_when_every_weight_and_both_kv_formats_are() -> None:
    assert _trial(0, 1, params=BF16).is_bf16
    assert _trial(0, 1, params=BF16 | {"weights.lm_head": "absent"}).is_bf16
    assert not _trial(0, 1, params=BF16 | {"weights.mlp": "int8"}).is_bf16
    assert not _trial(0, 1, params=BF16 | {"kv.key_format": "fp8_e4m3"}).is_bf16
    assert not _trial(0, 1, params=BF16 | {"kv.value_format": "fp8_e4m3"}).is_bf16
    no_weights = {k: v for k, v in BF16.items() if not k.startswith("weights.")}
    assert not _trial(0, 1, params=no_weights).is_bf16


def test_a_baseline_is_tagged_so_or_a_uniform_plan() -> None:
    uniform = {"weights.mlp": "int8", "weights.attn": "int8", "weights.embed": "absent"}
    uniform |= {"kv.key_format": "fp8_e4m3", "kv.value_format": "fp8_e4m3"}
    uniform |= {"kv.bf16_layers": "none"}
    assert _trial(0, 1, params=uniform).is_baseline
    assert not _trial(0, 1, params=uniform | {"kv.bf16_layers": "0"}).is_baseline
    assert not _trial(0, 1, params=uniform | {"kv.value_format": "int4"}).is_baseline
    assert not _trial(0, 1, params=uniform | {"weights.mlp": "int4"}).is_baseline
    assert not _trial(0, 1, params=INT4).is_baseline
    assert _trial(0, 1, params=INT4, tags={"tenantq.baseline": "true"}).is_baseline


def test_a_trial_record_reads_its_tags_and_metrics() -> None:
    t = _trial(
        3, 40, shippable=False, params=INT4 | {"plan.fingerprint": "abc"},
        tags={"tenantq.duplicate_of": "1", "tenantq.warning.needles": "few examples"},
        metrics={"kl": 0.5, "kl.ci_low": 0.4, "kl.ci_high": 0.7, "top1": 0.9},
    )  # fmt: skip
    assert t.on_front and not t.shippable and not t.failed and t.tenants == 40.0
    assert t.duplicate_of == 1 and _trial(1, 1).duplicate_of is None
    assert t.fingerprint == "abc" and _trial(1, 1).fingerprint == ""
    assert t.warnings() == {"needles": "few examples"}
    assert t.metric_ci("kl") == (0.5, 0.4, 0.7)
    assert t.metric_ci("top1") == (0.9, None, None)
    assert t.metric_ci("missing") is None
    assert t.plan_summary() == (
        "weights: attn=fp8_e4m3, mlp=int4\nKV: K fp8_e4m3/?, V int4/?, sinks ?, bf16 layers 0,-1"
    )


def test_the_quality_metrics_are_the_spec_objectives_or_every_metric_with_a_ci() -> None:
    named = _study(params={"objectives": "maximize tenants, minimize kl,minimize top1_flip"})
    assert named.objectives == [
        ("maximize", "tenants"),
        ("minimize", "kl"),
        ("minimize", "top1_flip"),
    ]
    assert named.quality_metrics == ["kl", "top1_flip"]
    bare = _study(
        _trial(1, 1, metrics={"b.ci_high": 1.0, "a.ci_high": 1.0, "confirmed.a.ci_high": 1.0}),
        _trial(2, 1, metrics={"c.ci_low": 1.0, "a.ci_high": 2.0}),
        params={"objectives": "bad"},
    )
    assert bare.objectives == []
    assert bare.quality_metrics == ["a", "b"]


def test_off_the_front_a_quantized_plan_is_chosen_over_the_bf16_baseline() -> None:
    study = _study(_trial(0, 50, front=False, params=BF16), _trial(1, 30, front=False))
    assert study.choose_trial().number == 1


def test_a_plan_that_fits_no_tenant_is_not_chosen_over_one_that_fits_one() -> None:
    assert _study(_trial(1, 0), _trial(2, 1)).choose_trial().number == 2


def test_the_plan_summary_names_every_kv_setting_or_a_question_mark() -> None:
    params = {"weights.mlp": "int4", "kv.key_format": "int4", "kv.key_axis": "channel"}
    params |= {"kv.value_format": "fp8_e4m3", "kv.value_axis": "token"}
    params |= {"kv.sink_tokens": "4", "kv.bf16_layers": "0,-1"}
    assert _trial(0, 1, params=params).plan_summary() == (
        "weights: mlp=int4\nKV: K int4/channel, V fp8_e4m3/token, sinks 4, bf16 layers 0,-1"
    )
    assert _trial(0, 1, params={}).plan_summary() == (
        "weights: \nKV: K ?/?, V ?/?, sinks ?, bf16 layers ?"
    )


def test_a_gate_without_its_changed_flag_shows_a_question_mark() -> None:
    t = _trial(0, 1, tags={"tenantq.verdict.kl": "non-inferior"})
    assert t.gate_words() == "kl: non-inferior; changed: ?"


@pytest.mark.parametrize("status", ["RUNNING", "KILLED"])
def test_a_named_trial_that_never_finished_is_refused_naming_the_completed_ones(status) -> None:
    # No capacity figure: the report's tenants, waterfall and front row have nothing to show.
    study = _study(_trial(1, 30), _trial(2, None, status=status))
    with pytest.raises(
        ValueError, match=rf"^--trial 2 has not completed \({status}\); choose a completed "
        r"trial: 1$",
    ):  # fmt: skip
        study.choose_trial(2)
