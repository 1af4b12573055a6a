"""The report's verdict words are the evaluator's: each front trial's gates with their
non-inferiority verdict and changed flag, and the suite's warnings in the header, read from
the MLflow tags the search driver writes (`tenantq.verdict.*`, `tenantq.changed.*`,
`tenantq.warning.*`). Records are built by hand: no store is needed to read tags."""

from __future__ import annotations

from tenantq.report import figures, html
from tenantq.report.study import StudyRecord, TrialRecord


def _trial(number: int, tags: dict[str, str]) -> TrialRecord:
    return TrialRecord(
        number=number, run_id=f"r{number}", status="FINISHED",
        params={"weights.mlp": "int4", "kv.key_format": "int4", "kv.value_format": "int4"},
        metrics={"capacity.tenants": 10.0 + number, "fidelity.kl_mean": 0.02},
        tags={"tenantq.pareto": "true", "tenantq.shippable": "false", **tags}, logged_ms=0,
    )  # fmt: skip


TAGS = {
    "tenantq.verdict.fidelity.kl_mean": "not shown non-inferior",
    "tenantq.changed.fidelity.kl_mean": "yes",
    "tenantq.verdict.needle.acc_delta.len1019": "non-inferior",
    "tenantq.changed.needle.acc_delta.len1019": "no",
    "tenantq.warning.structured.close_brackets": "bf16 pass rate 57% (55 of 96) is below "
    "the suite's 60%",
}


def test_front_table_shows_each_gates_verdict_and_changed_flag() -> None:
    study = StudyRecord("sqlite:///m.db", "e", "s", "p", {}, {}, [_trial(1, TAGS)])
    (row,) = figures.front_table_rows(study)
    assert row["verdicts"].splitlines() == [
        "fidelity.kl_mean: not shown non-inferior; changed: yes",
        "needle.acc_delta.len1019: non-inferior; changed: no",
    ]


def test_header_names_the_suites_warnings() -> None:
    study = StudyRecord("sqlite:///m.db", "e", "s", "p", {}, {}, [_trial(1, TAGS)])
    header = html._header(study, None)
    assert "warnings" in header
    assert "structured.close_brackets: bf16 pass rate 57% (55 of 96)" in header
    quiet = StudyRecord("sqlite:///m.db", "e", "s", "p", {}, {}, [_trial(2, {})])
    assert "warnings" not in html._header(quiet, None)
    assert figures.front_table_rows(quiet)[0]["verdicts"] == "-"
