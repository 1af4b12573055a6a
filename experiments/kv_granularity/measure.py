"""KV format x scale axis on the reference model with the quick suite (README "KV cache formats").

Regenerate: `JAX_PLATFORMS=cpu python experiments/kv_granularity/measure.py` (writes
results.json beside this file and prints the table). Static axes are calibrated on the
reference train split (64 x 512 tokens) by the evaluator; the clip rate is over the trial's
own writes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tenantq.evals import Evaluator, load_suite
from tenantq.quant.plan import KVPlan, QuantPlan
from tenantq.reference import reference_model_path

GRID = [
    ("fp8_e4m3", "tensor", "tensor"), ("fp8_e4m3", "head", "head"),
    ("fp8_e4m3", "channel", "token"), ("int8", "tensor", "tensor"), ("int8", "head", "head"),
    ("int8", "channel", "token"), ("int4", "channel", "token"), ("int4", "token", "token"),
    ("int4", "head", "head"), ("int4", "tensor", "tensor"), ("int2", "channel", "token"),
    ("int2", "token", "token"),
]  # fmt: skip


def main() -> None:
    out = Path(__file__).with_name("results.json")
    rows = json.loads(out.read_text()) if out.is_file() else []
    done = {(r["format"], r["key_axis"], r["value_axis"]) for r in rows}
    ev = Evaluator(reference_model_path(), load_suite("quick"))
    ev.baseline()
    for fmt, k_axis, v_axis in GRID:
        if (fmt, k_axis, v_axis) in done:
            continue
        plan = QuantPlan(kv=KVPlan(fmt, k_axis, fmt, v_axis))
        began = time.perf_counter()
        result = ev.evaluate(plan)
        s = result.summary
        engine = ev.build_engine(plan)  # same scales; the clip rate of one quick-suite pass
        engine.logits(ev.fidelity_rows[:4].tolist())
        row = {
            "format": fmt, "key_axis": k_axis, "value_axis": v_axis,
            "kl_mean": s["fidelity.kl_mean"], "kl_mean_ci": [s.get("fidelity.kl_mean.ci_low"),
                                                            s.get("fidelity.kl_mean.ci_high")],
            "needle_delta": s["needle.acc_delta.len1019"],
            "needle_ci": [s.get("needle.acc_delta.len1019.ci_low"), s.get("needle.acc_delta.len1019.ci_high")],
            "structured_delta": s.get("structured.acc_delta"),
            "verdicts": {k: v for k, v in s.items() if k.startswith("verdict.")},
            "clip_rate": engine.kv_clip_rate(),
            "seconds": time.perf_counter() - began,
        }  # fmt: skip
        rows.append(row)
        out.write_text(json.dumps(rows, indent=1))
        print(json.dumps(row), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
