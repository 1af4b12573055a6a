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
           "int4-weights+int8-kv,w4a8", "--batches", "1,2", "--json"]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    rows = result["rows"]
    plans = ("int4-weights+int8-kv", "w4a8")
    assert {(r["plan"], r["batch"]) for r in rows} == {(p, b) for p in plans for b in (1, 2)}
    # one profile, every pass rate measured for each weight shape class of the model
    from tenantq.bench.roofline import SMOKE_MODEL, weight_shapes
    from tenantq.model.config import ModelConfig

    shapes = weight_shapes(ModelConfig(model_type="llama", **SMOKE_MODEL))
    assert len(result["profiles"]) == 1
    by_shape = result["profile"]["by_shape"]
    assert list(by_shape) == [f"{r}x{c}" for r, c in shapes]
    for rates in by_shape.values():
        assert rates["pack"] > 0 and rates["unpack"] > 0 and rates["unpack_b1"] > 0
    assert result["wall_s"] > 0
    for r in rows:
        assert r["measured_ms"] > 0 and r["predicted_ms"] > 0
        assert r["error"] == pytest.approx(r["predicted_ms"] / r["measured_ms"] - 1, rel=1e-6)
        assert r["weights_stored_bytes"] == r["weights_counted_bytes"]


@pytest.mark.parametrize(
    ("bandwidth", "pack", "peak"),
    [
        (22e9, 2.16e9, 865e9),  # the CPU of docs/results/roofline.md: 2 rows memory-bound
        (22e9, 2.16e9, 20e9),  # a slow peak: 2 rows compute-bound as well
        (22e9, 5e8, 300e9),
    ],
)
def test_bf16_dot_rates_invert_the_step_models_own_equation(bandwidth, pack, peak) -> None:
    # The step model (capacity.roofline) charges a batched bf16 dot of n weight elements
    # n / pack + max(2 n / bandwidth, 2 M n / peak) at M rows. Times made by that equation
    # must give back the rates they were made from; else the profile double-counts a term
    # (the weight read inside the packing time, then again as bytes) and the model's own
    # prediction of the micro-benchmark it was measured from is off.
    from tenantq.bench.roofline import bf16_dot_rates

    n, batch = 8 * 1024 * 2816, 64

    def t(m):
        return n / pack + max(2 * n / bandwidth, 2 * m * n / peak)

    got_pack, got_peak = bf16_dot_rates(t(2), t(batch), n, batch, bandwidth)
    assert got_pack == pytest.approx(pack, rel=1e-9)
    assert got_peak == pytest.approx(peak, rel=1e-9)


def test_shape_classes_are_the_models_matmul_shapes_largest_first() -> None:
    # The validation model's weights one chip stores ([in, out]), by elements over 8 layers:
    # gate/up 2 x 1024 x 2816, down 2816 x 1024, lm_head 1024 x 8192, q/o 2 x 1024 x 1024,
    # k/v 2 x 1024 x 256 (the untied embedding is a row gather, not a matmul weight).
    from tenantq.bench.roofline import MODEL, weight_shapes
    from tenantq.model.config import ModelConfig

    got = weight_shapes(ModelConfig(model_type="llama", **MODEL))
    assert got == [(1024, 2816), (2816, 1024), (1024, 1024), (1024, 8192), (1024, 256)]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--plans", ","], "--plans"),
        (["--plans", "bf16,garbage"], "--plans"),
        (["--batches", "abc"], "--batches"),
        (["--batches", "4,0"], "--batches"),
        (["--batches", "-1"], "--batches"),
        (["--repeats", "0"], "--repeats"),
        (["--steps", "0"], "--steps"),
        (["--profile", "twice"], "--profile"),
    ],
)
def test_bad_bench_flags_stop_before_any_measurement_with_one_line_naming_the_flag(
    argv, flag, capsys, monkeypatch
):
    # Each of these once ran the profile and then crashed mid-way (IndexError on no plans,
    # ZeroDivisionError on 0 steps or repeats, a JAX shape error on a negative batch, a
    # traceback on a non-integer batch). `--clock wall`: the test process is never pinned.
    from tenantq.bench.roofline import main

    monkeypatch.setenv("TENANTQ_BENCH_SMOKE", "1")
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--clock", "wall"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert flag in err[-1] and "error" in err[-1]


def test_profile_states_its_timing_noise_and_each_rate_its_noise_floored(monkeypatch) -> None:
    # The profile's rates come from differences of timings (the grouped product: t(64) -
    # t(2); the unpack: t less its read and products), so noise moves them most; a difference
    # at or under 10% of its timing is floored there (a rate, not a division by ~0). Both
    # must be stated: the spread of each timing's repeats (best of them is used) and which
    # rates hit the floor. Fake clock: repeats of 1.0 s and 1.5 s -> spread 50%.
    from tenantq.bench import roofline as rb

    ticks = iter([0.0, 1.0, 1.0, 2.5])
    monkeypatch.setattr(rb, "_clock", lambda: next(ticks))
    monkeypatch.setattr(rb, "_TIMINGS", [])
    assert rb._best_s(lambda: None, 2) == 1.0
    assert rb._timing_spread() == pytest.approx(0.5)
    floored: list[str] = []
    assert rb._net_rate(10.0, 5.0, 20.0, "grouped", floored) == 2.0  # 5 s > 10% of 20 s
    assert floored == []
    assert rb._net_rate(10.0, -1.0, 20.0, "grouped", floored) == 5.0  # floored at 2 s
    assert floored == ["grouped"]
    rates = {"copies": 1, "convert": {"int8": 1e9}, "convert_b1": {"bf16": 1e9}, "pack": 1e9,
             "unpack": 1e9, "unpack_b1": 1e9, "grouped": 5e10, "floored": ["grouped"]}  # fmt: skip
    profile = {"plan": "all", "bandwidth_bytes_per_s": 2e10, "peak_per_s": {"bf16": 1e11},
               "step_overhead_s": 1e-3, "by_shape": {"64x128": rates},
               "repeats": 2, "timing_spread": 0.5}  # fmt: skip
    text = rb._profile_line(profile)
    assert "best of 2 repeats, spread up to 50%" in text
    assert "at the 10% floor: grouped" in text
    one = rb._profile_line(dict(profile, repeats=1, timing_spread=None))
    assert "one repeat each: noise not measured" in one


def test_each_class_gives_its_own_rates_and_only_the_largest_the_any_shape_ones() -> None:
    # The profile charges a weight at its shape's rates and an unmeasured shape at the
    # largest class's (shape ()): every pass of CPU_PASSES for the class's own shape, and
    # the () entries from the largest class only (a second class must not add them).
    from tenantq.bench.roofline import shape_rates
    from tenantq.capacity.hardware import CPU_PASSES, HardwareProfile

    def figures(k: float) -> dict:
        return {"convert": {"int8": k, "int4": 2 * k}, "convert_b1": {"bf16": 3 * k},
                "pack": 4 * k, "unpack": 5 * k, "unpack_b1": 6 * k, "grouped": 7 * k}  # fmt: skip

    big = shape_rates((1024, 2816), figures(1e9), largest=True)
    small = shape_rates((1024, 256), figures(1e8), largest=False)
    assert {k for k, _, s, _ in big if s == (1024, 2816)} == set(CPU_PASSES)
    assert all(s != () for _, _, s, _ in small)
    hw = HardwareProfile("cpu", 2**30, 10**10, "CPU", shape_rates=tuple(big + small))
    assert hw.pass_rate("grouped", "int4", (1024, 256)) == 7e8
    assert hw.pass_rate("grouped", "int4", (2816, 1024)) == 7e9  # unmeasured: the largest's
    assert hw.pass_rate("convert", "int4", (999, 1)) == 2e9
    assert hw.pass_rate("convert_b1", "bf16", (1024, 256)) == 3e8
