"""The rendered budget and comparison of tiny deployments, whole (`make mutation
TARGETS=capacity-rest`): every line, width and word, against the reviewed text in
test_rendered_tables.golden. Its figures are test_budget.py's hand arithmetic (pool
854,624 B, 59 tenants at 100 tokens, 96 tokens for 60 tenants; 0 tenants in a 16,383 B pool
that one 128-token tenant (16,384 B) overflows; per chip on 2 chips: one KV head, an int8
page 256 B per layer, 48 B of static scales); the layout is table.py's (46-character
labels, 30-character figure columns, an all-chips column past one chip).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tenantq.capacity.budget import budget
from tenantq.capacity.hardware import Deployment
from tenantq.capacity.table import render_budget, render_compare
from tenantq.quant.plan import KVPlan, QuantPlan
from tenantq.testing import tiny_config


def _golden() -> dict[str, str]:
    text = (Path(__file__).parent / "test_rendered_tables.golden").read_text()
    parts = text.split("=== ")[1:]
    return {p.split(" ===\n", 1)[0]: p.split(" ===\n", 1)[1].rstrip("\n") for p in parts}


def _cpu(memory: int, chips: int = 1, **kw) -> Deployment:
    return Deployment.of("cpu", chips, memory_bytes=memory, reserve=100_000, **kw)


def _texts(name: str) -> str:
    plan, config = QuantPlan(), tiny_config()
    if name == "one chip":
        return render_budget(budget(config, plan, _cpu(1_000_000), 100, target_tenants=60))
    if name == "no tenant":
        return render_budget(budget(config, plan, _cpu(161_759), 128), description="too small")
    if name == "two chips static":
        sliding = tiny_config(
            layer_types=("sliding", "full"), sliding_window=32, name="t", vocab_size=65
        )
        return render_budget(
            budget(sliding, QuantPlan.uniform("bf16", "int8"), _cpu(1_000_000, 2), 100)
        )
    base = budget(config, plan, _cpu(1_000_000), 100)
    full = budget(config, plan, _cpu(145_000), 100)  # weights + reserve leave no pool
    if name == "compare no base":  # a base of 0 pool tokens has no ratio
        return render_compare([("bf16", "bf16", full)], full)
    kv = QuantPlan(kv=KVPlan("int8", "channel", "int8", "token"))  # 368 B / 3 tokens = 122.7
    toy = budget(config, kv, _cpu(1_000_000, page_tokens=3), 100)
    return render_compare(
        [("bf16", "bf16", base), ("bf16", "int8", toy), ("bf16", "bf16", full)], base
    )


@pytest.mark.parametrize(
    "name", ["one chip", "no tenant", "two chips static", "compare", "compare no base"]
)
def test_rendered_text(name):
    want = _golden()[name].splitlines()
    got = _texts(name).splitlines()
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        assert g == w, f"line {i + 1} differs"
    assert len(got) == len(want)


def test_long_layer_lists_are_counted_and_plurals():
    # A KV line lists its layers while the ranges take at most 12 characters, and counts them
    # past that. 12 layers, int8 KV, half pinned to bf16: "0,2,4,6,8,10" (12) is listed;
    # "0,2,4,6,10-11" (13) is counted as "6 full layers".
    config = tiny_config(num_layers=12)
    dep = _cpu(10_000_000)

    def kv_rows(bf16_layers):
        plan = QuantPlan(kv=KVPlan("int8", "channel", "int8", "token", bf16_layers=bf16_layers))
        text = render_budget(budget(config, plan, dep, 16))
        return [
            line.split(":")[0].strip()
            for line in text.splitlines()
            if line.startswith("    ") and ": K " in line
        ]

    assert kv_rows((1, 3, 5, 7, 9, 11)) == [
        "layers 0,2,4,6,8,10 (6 full)",
        "layers 1,3,5,7,9,11 (6 full)",
    ]
    assert kv_rows((1, 3, 5, 7, 8, 9)) == ["6 full layers", "layers 1,3,5,7-9 (6 full)"]
    # Two tenants: "tenants each"; a comparison on 2 chips names them in its header.
    two = budget(tiny_config(), QuantPlan(), _cpu(1_000_000, 2), 100, target_tenants=2)
    assert "longest context for 2 tenants each" in render_budget(two)
    assert (
        render_compare([("bf16", "bf16", two)], two)
        .splitlines()[0]
        .startswith("llama on 2 x cpu |")
    )
