"""The memory report's printed table states the same totals as its fields."""

from __future__ import annotations

from tenantq.engine import Engine
from tenantq.model.decoder import init_params
from tenantq.quant.plan import KVPlan, QuantPlan, Rule


def test_printed_report_matches_fields(config) -> None:
    plan = QuantPlan(
        rules=(Rule("layers/.*/mlp/.*", "int4", group_size=16),),
        kv=KVPlan(key_format="int8", value_format="int8", sink_tokens=2, bf16_layers=(0,)),
    )
    engine = Engine(config, init_params(config), plan, num_pages=8, max_seqs=2)
    report = engine.memory_report()
    text = str(report)
    assert f"weights {report.total_weight_bytes:,} B" in text
    assert f"KV cache {report.cache_bytes:,} B" in text
    assert f"total {report.total_bytes:,} B" in text
    # One line per KV layer with its formats; layer 0 is kept in bf16 by the plan.
    layer_lines = [line for line in text.splitlines() if line.strip().startswith("layer")]
    assert len(layer_lines) == config.num_layers
    assert "K bf16 V bf16" in layer_lines[0] and "K int8 V int8" in layer_lines[1]
    int4_line = next(line for line in text.splitlines() if line.strip().startswith("int4"))
    assert f"{2 * config.num_layers:>5} tensors" not in int4_line  # 3 MLP tensors per layer
    assert f"{3 * config.num_layers:>5} tensors" in int4_line
