"""`python -m tenantq.bench engine` runs end to end and reports ratios to bf16."""

from __future__ import annotations

import json

import pytest

from tenantq.bench import engine as bench


@pytest.mark.slow
def test_engine_benchmark_reports_every_format_against_bf16(capsys):
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
    assert all(r["decode_tok_s_b1"] > 0 and r["compile_s"] > 0 for r in rows.values())
    kv_rows = {r["kv_format"]: r for r in report["kv_rows"]}
    assert kv_rows["bf16"]["decode_tok_s_b1_c48_vs_bf16"] == 1.0
    assert kv_rows["int4"]["kv_page_bytes"] < kv_rows["bf16"]["kv_page_bytes"] / 2
    assert kv_rows["int4"]["decode_tok_s_b1_c48"] > 0
