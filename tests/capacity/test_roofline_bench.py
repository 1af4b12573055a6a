"""`python -m tenantq.bench roofline` runs end to end in its smoke size (a bench that crashes
with its own arguments has happened here before): it measures a CPU profile, times the
engine's decode steps and puts the step model's prediction beside each, with the engine's
stored weight bytes equal to the budget's count (planner = engine, DESIGN.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_roofline_bench_predicts_each_measured_step_and_counts_the_same_bytes() -> None:
    env = dict(os.environ, TENANTQ_BENCH_SMOKE="1", JAX_PLATFORMS="cpu")
    # A subprocess: the bench pins its own process to one core (--clock cpu).
    cmd = [sys.executable, "-m", "tenantq.bench", "roofline", "--plans",
           "int4-weights+int8-kv", "--batches", "1,2", "--json"]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    rows = result["rows"]
    assert {(r["plan"], r["batch"]) for r in rows} == {("int4-weights+int8-kv", b) for b in (1, 2)}
    for r in rows:
        assert r["measured_ms"] > 0 and r["predicted_ms"] > 0
        assert r["error"] == pytest.approx(r["predicted_ms"] / r["measured_ms"] - 1, rel=1e-6)
        assert r["weights_stored_bytes"] == r["weights_counted_bytes"]
