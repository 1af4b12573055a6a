"""The findings grid's statistics recomputed from a saved summary (`bench evals --grid
--restat`): pass/fail intervals become Tango's from the stored flip counts, noise floors go,
verdicts and warnings come from today's code, and both commits are recorded."""

from __future__ import annotations

import pytest

from tenantq.bench.evals import GRID_SUITE, _render_grid, restat
from tenantq.evals import load_suite, stats


def _group(task: str, group: str, base: float, c2w: int, w2c: int, n: int) -> dict:
    cand = base + (w2c - c2w) / n
    return {
        f"{task}.acc_base{group}": base, f"{task}.acc_cand{group}": cand,
        f"{task}.acc_delta{group}": cand - base, f"{task}.acc_delta{group}.ci_low": 0.0,
        f"{task}.acc_delta{group}.ci_high": 0.0, f"{task}.acc_delta{group}.noise_floor": 0.1,
        f"{task}.flips{group}.correct_to_wrong": c2w, f"{task}.flips{group}.wrong_to_correct": w2c,
        f"{task}.mcnemar_p{group}": 1.0, f"{task}.n{group}": n,
    }  # fmt: skip


def _record() -> dict:
    summary = {
        "fidelity.kl_mean": 0.02, "fidelity.ppl_ratio": 1.02, "fidelity.ppl_ratio.ci_low": 1.005,
        "fidelity.ppl_ratio.ci_high": 1.009, "fidelity.ppl_ratio.noise_floor": 1.04,
        "fidelity.ppl_base": 58.0, "verdict.fidelity.ppl_ratio": "no detectable change",
        **_group("needle", ".len1019", 46 / 48, 4, 0, 48),  # the finding's mxfp4 needles
        **_group("needle_vartrack", ".len1019", 20 / 32, 0, 0, 32),
        **_group("structured", "", 18 / 32, 7, 0, 32),
        **_group("structured", ".close_brackets", 18 / 32, 7, 0, 32),
    }  # fmt: skip
    return {"plan": "p", "plan_json": {}, "summary": summary, "timings_s": {}}


def test_restat_recomputes_pass_fail_statistics_from_the_flip_counts() -> None:
    (r,) = restat([_record()], load_suite(GRID_SUITE), measured_at="abc123")
    s = r["summary"]
    assert not any(k.endswith("noise_floor") for k in s)
    low, high = stats.tango_interval(4, 0, 48)
    assert (s["needle.acc_delta.len1019.ci_low"], s["needle.acc_delta.len1019.ci_high"]) == (
        pytest.approx(float(low)), pytest.approx(float(high)))  # fmt: skip
    assert s["needle.mcnemar_p.len1019"] == pytest.approx(0.125)  # 2 / 2^4
    # ppl ratio CI [1.005, 1.009] within 1%: non-inferior, and changed (excludes 1)
    assert s["verdict.fidelity.ppl_ratio"] == "non-inferior"
    assert s["changed.fidelity.ppl_ratio"] == "yes"
    # 4 losses of 48: p = 0.125, not changed; 7 of 32: p = 2/128 = 0.0156, changed
    assert s["changed.needle.acc_delta.len1019"] == "no"
    assert s["changed.structured.acc_delta.close_brackets"] == "yes"
    # close_brackets at 18 of 32 (56%) is under the suite's 60% bar; needles are not
    assert "warning.structured.close_brackets" in s and "warning.needle.len1019" not in s
    assert r["commit"]["measurement"] == "abc123" and r["commit"]["statistics"]
    table = _render_grid([r], "t")
    assert "**yes** (close_brackets)" in table  # ppl non-inferior while structure breaks
    assert "structured.close_brackets" in table and '"measurement": "abc123"' in table
