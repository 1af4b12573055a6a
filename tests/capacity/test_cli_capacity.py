"""`tenantq capacity`: table, JSON, compare, and one clear line for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

from tenantq.capacity import Deployment, budget, get_model_config
from tenantq.quant.plan import QuantPlan

ISSUE_ARGS = [
    "--model",
    "llama-3.1-70b",
    "--hardware",
    "tpu-v6e",
    "--chips",
    "8",
    "--weights",
    "fp8_e4m3",
    "--kv",
    "fp8_e4m3",
    "--context",
    "32768",
]


def test_json_equals_the_python_api(cli):
    rc, out, _ = cli([*ISSUE_ARGS, "--json"])
    assert rc == 0
    d = json.loads(out)
    b = budget(
        get_model_config("llama-3.1-70b"),
        QuantPlan.uniform("fp8_e4m3", "fp8_e4m3"),
        Deployment.of("tpu-v6e", 8),
        32768,
    )
    for key in ("weights_bytes", "kv_bytes_per_token", "pool_bytes", "pool_tokens", "tenants"):
        assert d[key] == getattr(b, key)
    # fp8's default axes are static per tensor: 80 x 8 x 128 x 2 x 1 B, no per-token scales
    assert d["kv_bytes_per_token"] == 163_840
    # K and V per layer: one float32 scale and two int32 clip counters
    assert d["kv_static_bytes_per_chip"] == 80 * 2 * (4 + 8)


def test_table_shows_every_line(cli):
    rc, out, _ = cli(ISSUE_ARGS)
    assert rc == 0
    for line in ("HBM", "- weights", "embed", "lm_head", "runtime reserve", "= KV pool"):
        assert line in out
    assert "KV per token" in out and "tenants at 32,768 tokens" in out
    assert "163,840 B" in out  # the all-chips KV bytes per token
    assert "K scales: 1 per layer, 4 B, static" in out and "of which static KV scales" in out
    assert "K clip counters: 2 x 4 B (int32) = 8 B per layer, static" in out


def test_compare_default_pairs_with_ratio_to_bf16(cli):
    rc, out, _ = cli(
        ["--compare", "--model", "llama-3.1-8b", "--hardware", "tpu-v6e", "--context", "8192"]
    )
    assert rc == 0
    rows = [line.split() for line in out.splitlines() if line.startswith(("bf16", "fp8", "int4"))]
    assert [r[:2] for r in rows][:4] == [
        ["bf16", "bf16"],
        ["fp8_e4m3", "bf16"],
        ["bf16", "fp8_e4m3"],
        ["fp8_e4m3", "fp8_e4m3"],
    ]
    assert "1.00x" in rows[0]


def test_issue_figure_llama_8b_fp8_kv_is_65536_bytes_per_token_plus_static_scales(cli):
    # Issue 11: vLLM's fp8 cache on Llama-3.1-8B costs 32 layers x 8 KV heads x 128 x 2 (K, V)
    # x 1 B = 65,536 B/token; tenantq's default fp8 granularity (one static scale per layer for
    # K and for V, and the engine's two int32 clip counters beside each) adds 32 x 2 x (4 + 8)
    # = 768 B once, nothing per token, and no residual slot.
    argv = ["--model", "llama-3.1-8b", "--kv", "fp8_e4m3", "--hardware", "tpu-v6e"]
    rc, out, _ = cli([*argv, "--context", "8192", "--json"])
    assert rc == 0
    d = json.loads(out)
    assert d["kv_bytes_per_token"] == 65_536
    assert d["kv_static_bytes_per_chip"] == 768
    assert d["tenant_slot_bytes_per_chip"] == 0
    assert d["kv_lines"][0]["parts"] == [
        "K elements: 16,384 x 1 B (float8_e4m3fn) = 16,384 B per page",
        "K scales: 1 per layer, 4 B, static",
        "K clip counters: 2 x 4 B (int32) = 8 B per layer, static",
        "V elements: 16,384 x 1 B (float8_e4m3fn) = 16,384 B per page",
        "V scales: 1 per layer, 4 B, static",
        "V clip counters: 2 x 4 B (int32) = 8 B per layer, static",
    ]


def test_compare_pairs_json(cli):
    rc, out, _ = cli(
        [
            "--compare",
            "--pairs",
            "int4:int4,fp8_e4m3:fp8_e4m3",
            "--model",
            "qwen3-8b",
            "--hardware",
            "h100",
            "--context",
            "4096",
            "--json",
        ]
    )
    assert rc == 0
    d = json.loads(out)
    assert [(r["weights"], r["kv"]) for r in d["rows"]] == [
        ("int4", "int4"),
        ("fp8_e4m3", "fp8_e4m3"),
    ]
    # The bf16/bf16 baseline is computed even when not listed; int4/int4 holds more tokens.
    assert d["rows"][0]["pool_tokens_ratio"] > d["rows"][1]["pool_tokens_ratio"] > 1


def test_plan_file(cli, tmp_path):
    plan = QuantPlan.uniform("int8", "fp8_e4m3")
    path = tmp_path / "plan.json"
    plan.save(path)
    args = ["--model", "mistral-7b", "--hardware", "h100", "--context", "4096", "--json"]
    rc, out, _ = cli([*args, "--plan", str(path)])
    assert rc == 0
    assert json.loads(out)["plan_fingerprint"] == plan.fingerprint()


def test_capacity_imports_no_jax_ray_or_mlflow():
    # The search driver imports capacity and computes budgets; neither may pull in JAX, Ray or
    # MLflow (storage byte counts are pure arithmetic in tenantq.numerics.layout).
    code = (
        "import sys, tenantq.capacity, tenantq.cli.capacity\n"
        "from tenantq.capacity import Deployment, budget, get_model_config\n"
        "from tenantq.quant.plan import QuantPlan\n"
        "plan = QuantPlan.uniform('int4', 'nvfp4')\n"
        "model = get_model_config('llama-3.1-8b')\n"
        "assert budget(model, plan, Deployment.of('h200'), 4096).tenants > 0\n"
        "print(sorted(m for m in ('jax', 'ray', 'mlflow', 'optuna') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_registered_in_the_tenantq_command(capsys):
    # Through the tenantq dispatcher, which discovers the subcommand modules.
    from tenantq.cli import main

    assert main(["capacity", *ISSUE_ARGS, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tenants"] > 0
    assert main(["capacity", "--model", "x", "--hardware", "h200", "--context", "1"]) == 2
    assert "unknown" in capsys.readouterr().err
