"""`render_budget`'s layout, line by line (found unpinned by `make mutation TARGETS=capacity`).

The table's promise (capacity/table.py): every byte figure exact with a binary reading beside
it, one column per chip and, on more than one chip, one for all chips, so a reader can add
HBM - weights - reserve = pool by hand. Figures are checked against hand arithmetic where it
is short (v6e: 32 GiB per chip; Llama-3.1-8B's embed split over 2 chips: 64,128 x 4,096 int8
codes + one float32 scale per row) and against the Budget's own fields elsewhere.
"""

from __future__ import annotations

import pytest

from tenantq.capacity import Deployment, budget, get_model_config
from tenantq.capacity.table import render_budget
from tenantq.capacity.units import exact_bytes, human_bytes
from tenantq.quant.plan import KVPlan, QuantPlan, Rule
from tenantq.testing import tiny_config

LABEL = 46  # label column width; each figure column is 30 characters wide


def row(label: str, per_chip: int | float, total: int | float | None = None) -> str:
    """The documented row: label, exact bytes and binary reading, then the all-chips column."""
    line = f"{label:<{LABEL}}{exact_bytes(per_chip):>18} B {human_bytes(per_chip):>10}"
    if total is not None:
        line += f"   {exact_bytes(total):>18} B {human_bytes(total):>10}"
    return line


# Function scope on purpose: each test computes its own budget, so mutation testing sees
# every test reach the code it checks (a shared fixture is recorded for the first test only).
@pytest.fixture
def two_chips():
    plan = QuantPlan(rules=(Rule("embed", "int8"), Rule(".*", "fp8_e4m3")), kv=KVPlan("int8"))
    b = budget(get_model_config("llama-3.1-8b"), plan, Deployment.of("tpu-v6e", chips=2), 8192)
    return b, render_budget(b, per_tensor=True, description="two chips").splitlines()


def test_two_chip_header_and_columns(two_chips):
    b, lines = two_chips
    assert lines[0] == "meta-llama/Llama-3.1-8B on 2 x tpu-v6e, tensor parallel 2  [two chips]"
    assert lines[2] == ""
    assert lines[3] == f"{'':<{LABEL}}{'per chip':>30}   {'all 2 chips':>30}"
    gib32 = 32 * 1024**3  # one v6e chip
    assert lines[4] == row("HBM", gib32, 2 * gib32)
    assert lines[4].endswith("68,719,476,736 B  64.00 GiB")
    assert lines[5] == row("- weights", b.weights_bytes_per_chip, b.weights_bytes)


def test_weight_lines_and_their_tensors(two_chips):
    b, lines = two_chips
    embed = 64_128 * 4_096 + 64_128 * 4  # int8 codes + a float32 scale per vocab row
    assert embed == 262_924_800
    i = lines.index(
        row(f"    {'embed':<10}{'int8':<16}{'1 tensor':>12}", embed, 2 * embed)
        + "   sharded over vocab"
    )
    assert lines[i + 1] == row("      embed  64128x4096  int8", embed)  # no all-chips column
    assert lines[i + 2].startswith("    lm_head   fp8_e4m3            1 tensor")
    attention = next(w for w in b.weight_lines if w.name == "attention")
    assert attention.tensors == 4 * 32  # q, k, v, o in 32 layers
    j = lines.index(
        row(
            f"    {'attention':<10}{'fp8_e4m3':<16}{'128 tensors':>12}",
            attention.bytes_per_chip,
            attention.bytes_total,
        )
        + f"   {attention.sharding}"
    )
    # q_proj 4096 x 4096 split over 2 chips by heads: 4096 x 2048 per chip.
    assert lines[j + 1].startswith("      layers/0/attn/q_proj  4096x2048  fp8_e4m3")
    under = lines[j + 1 : j + 1 + 128]
    assert all(ln.startswith("      layers/") and "/attn/" in ln for ln in under)


def test_reserve_pool_and_kv_rows(two_chips):
    b, lines = two_chips
    reserve = lines.index(row(f"- runtime reserve ({b.reserve})", b.reserve_bytes_per_chip))
    assert lines[reserve + 1] == row("= KV pool", b.pool_bytes_per_chip, b.pool_bytes)
    assert lines[reserve + 2] == ""
    assert lines[reserve + 3] == row(
        "KV per token (scales amortised over a page)",
        b.kv_bytes_per_token_per_chip,
        b.kv_bytes_per_token,
    )
    # HBM - weights - reserve = pool, per chip, as the table promises.
    assert (
        b.hbm_bytes_per_chip - b.weights_bytes_per_chip - b.reserve_bytes_per_chip
        == b.pool_bytes_per_chip
    )


def test_one_cpu_chip_has_one_column_and_says_memory():
    b = budget(tiny_config(), QuantPlan(), Deployment.of("cpu", memory_bytes="1GiB"), 64)
    lines = render_budget(b).splitlines()
    assert lines[0] == f"{b.model} on cpu"  # no chip count, no tensor parallel, no description
    assert lines[2] == ""
    assert lines[3] == f"{'':<{LABEL}}{'per chip':>30}"
    assert lines[4] == row("memory", 1024**3)  # a CPU host's memory, not HBM
    assert lines[5] == row("- weights", b.weights_bytes_per_chip)
    assert lines[6].startswith(f"    {'embed':<10}{'bf16':<16}{'1 tensor':>12}")
    assert not any(line.startswith("      embed") for line in lines)  # per_tensor off
