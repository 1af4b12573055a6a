"""`tenantq eval`: figures as JSON, and bad input as one line on stderr with exit status 2."""

from __future__ import annotations

import json

import pytest

from tenantq.cli import main

TINY = "[fidelity]\nrows = 2\nrow_tokens = 64\n{extra}"


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tenantq eval: error:") and "\n" not in err, err
    return err


def test_missing_plan_is_one_line(capsys, tmp_path) -> None:
    err = _one_line_error(capsys, ["eval", "--plan", str(tmp_path / "none.json")])
    assert "does not exist" in err


def test_unreadable_dataset_is_one_line(capsys, tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    suite = tmp_path / "s.toml"
    suite.write_text(TINY.format(extra=f'source = "{bad}"\n'))
    err = _one_line_error(
        capsys, ["eval", "--suite", str(suite), "--cache-dir", str(tmp_path), "--no-progress"]
    )
    assert "unreadable" in err and "bad.jsonl" in err


def test_plan_that_does_not_fit_is_one_line(capsys, tmp_path) -> None:
    suite = tmp_path / "s.toml"
    suite.write_text(TINY.format(extra=""))
    # 4 KiB cannot hold one 16-token page of all 4 layers' bf16 K and V plus the slots' buffers
    err = _one_line_error(capsys, [
        "eval", "--suite", str(suite), "--cache-dir", str(tmp_path), "--pool-bytes", "4096",
        "--no-progress",
    ])  # fmt: skip
    assert "pool" in err


@pytest.mark.slow
def test_json_summary_of_the_baseline_against_itself(capsys, tmp_path) -> None:
    suite = tmp_path / "s.toml"
    suite.write_text(TINY.format(extra=""))
    out = tmp_path / "out"
    argv = ["eval", "--suite", str(suite), "--cache-dir", str(tmp_path), "--json",
            "--no-progress", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["fidelity.kl_mean"] == 0.0 and summary["fidelity.tokens"] == 2 * 63
    assert (out / "examples.parquet").is_file() and (out / "summary.json").is_file()


def test_printed_gates_use_the_summarys_verdict_and_changed_words() -> None:
    # The CLI's words are the summary's (and so MLflow's): the non-inferiority verdict, the
    # two-sided changed flag, and the suite's warnings by name; no old "regression" wording.
    import pyarrow as pa

    from tenantq.cli.eval import result_lines
    from tenantq.evals.evaluator import EvalResult, Gate

    metric = "needle.acc_delta.len1019"
    gate = Gate(metric, -1 / 32, -0.157, 0.079, 0.05, True, "not shown non-inferior", 0.107)
    summary = {
        metric: -1 / 32, f"{metric}.ci_low": -0.157, f"{metric}.ci_high": 0.079,
        f"verdict.{metric}": "not shown non-inferior", f"changed.{metric}": "no",
        "warning.structured.close_brackets": "bf16 pass rate 57% (55 of 96) is below the "
        "suite's 60%",
    }  # fmt: skip
    result = EvalResult(summary, {metric: gate}, pa.table({"x": [1]}), {"total": 1.0}, {})
    lines = result_lines(result)
    assert lines[0].endswith("tolerance 0.05: not shown non-inferior; changed: no"), lines[0]
    assert "  warning.structured.close_brackets: bf16 pass rate 57%" in "\n".join(lines)
    assert not any(line.lstrip().startswith(("verdict.", "changed.")) for line in lines)
    assert not any("regression" in line for line in lines)
