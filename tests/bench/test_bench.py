"""Every `python -m tenantq.bench NAME` runs with its defaults, and the engine bench's figures
are ratios to bf16 measured in the same run."""

from __future__ import annotations

import json

import pytest

from tenantq.bench import __main__ as dispatch
from tenantq.bench import engine as bench


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",  # `bench search` runs a real study: Ray started in-process, so the serial group
    [pytest.param(n, marks=pytest.mark.e2e) if n == "search" else n for n in dispatch.BENCHMARKS],
)
def test_every_benchmark_runs_with_its_defaults(name, monkeypatch, capsys, tmp_path):
    # Defaults only (the engine bench shrinks them to a tiny model under the smoke variable);
    # a benchmark whose defaults crash (e.g. contexts beyond the model's) fails here. The
    # default cache folders are relative (.tenantq-cache): a fresh folder, not the checkout.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(bench.SMOKE_ENV, "1")
    assert dispatch.main([name, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report, name


@pytest.mark.slow
def test_engine_benchmark_reports_every_format_against_bf16(monkeypatch, capsys):
    monkeypatch.setenv(bench.SMOKE_ENV, "1")  # the tiny model: context 128
    argv = (
        "--formats bf16,int4 --batch-sizes 1 --prompt-tokens 8 --decode-tokens 2 --repeats 1 "
        "--kv-formats bf16,int4 --contexts 48 --kv-decode-tokens 2"
    )
    assert bench.main([*argv.split(), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["format"]: r for r in report["rows"]}
    assert set(rows) == {"bf16", "int4"}
    assert rows["bf16"]["prefill_tok_s_b1_vs_bf16"] == 1.0
    assert rows["int4"]["weight_bytes"] < rows["bf16"]["weight_bytes"] / 3
    # Compile time is counted apart; 0 when an earlier test in this process compiled the same
    # tiny-model shapes (executables are cached by layout).
    assert all(r["decode_tok_s_b1"] > 0 and r["compile_s"] >= 0 for r in rows.values())
    kv_rows = {r["kv_format"]: r for r in report["kv_rows"]}
    assert kv_rows["bf16"]["decode_tok_s_b1_c48_vs_bf16"] == 1.0
    # int4 KV: 4 bits + one float32 scale per 8-element token/head group on tiny's head_dim 8
    # (keys per channel: one scale per 16-token page) against bf16's 16 bits: under half.
    assert kv_rows["int4"]["kv_page_bytes"] < kv_rows["bf16"]["kv_page_bytes"] / 2
    assert kv_rows["int4"]["decode_tok_s_b1_c48"] > 0


def test_contexts_beyond_the_model_are_a_clear_error(monkeypatch):
    monkeypatch.setenv(bench.SMOKE_ENV, "1")
    with pytest.raises(ValueError, match="exceed the model's context of 128 tokens"):
        bench.main(["--contexts", "512"])
