"""The report's figures, each a plotly Figure built from a `StudyRecord` and nothing else.

One function per question: the Pareto front (tenants vs each quality metric), the capacity
waterfall (memory -> weights -> reserve -> KV pool -> tenants), the needle grid, per-tensor
sensitivity, flips against the baseline's margin, and the trial timeline per worker. A figure
whose data the study does not hold returns None, and the report says why instead.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from tenantq.report.study import StudyRecord, TrialRecord

MIB = 1024 * 1024
SHIPPABLE_COLOR = "#1a9850"
NOT_SHIPPABLE_COLOR = "#d73027"
FAILED_COLOR = "#7f0000"
DUPLICATE_COLOR = "#969696"
COMPLETE_COLOR = "#4575b4"


def pareto_figure(study: StudyRecord) -> go.Figure | None:
    """Tenants (x) against each quality metric (y, with CI bars); front trials as stars,
    baselines as diamonds, shippable in green; hover shows the plan."""
    metrics = study.quality_metrics
    trials = [t for t in study.completed if t.duplicate_of is None]
    if not metrics or not trials:
        return None
    fig = make_subplots(rows=1, cols=len(metrics), subplot_titles=metrics, horizontal_spacing=0.08)
    for col, metric in enumerate(metrics, start=1):
        for shippable in (True, False):
            group = [t for t in trials if t.shippable == shippable and metric in t.metrics]
            if not group:
                continue
            ys = [t.metrics[metric] for t in group]
            hi = [_ci_width(t, metric, "ci_high") for t in group]
            lo = [_ci_width(t, metric, "ci_low") for t in group]
            fig.add_trace(
                go.Scatter(
                    x=[t.tenants for t in group],
                    y=ys,
                    mode="markers+text",
                    text=[str(t.number) for t in group],
                    textposition="top right",
                    name="shippable" if shippable else "not shippable",
                    legendgroup=str(shippable),
                    showlegend=col == 1,
                    marker={
                        "color": SHIPPABLE_COLOR if shippable else NOT_SHIPPABLE_COLOR,
                        "size": [16 if t.on_front else 10 for t in group],
                        "symbol": ["diamond" if t.is_baseline else "circle" for t in group],
                        "line": {
                            "width": [3 if t.on_front else 1 for t in group],
                            "color": "black",
                        },
                    },
                    error_y={"type": "data", "symmetric": False, "array": hi, "arrayminus": lo},
                    hovertext=[_hover(t, metric, study.capacity_label) for t in group],
                    hoverinfo="text",
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text=study.capacity_label, row=1, col=col)
        fig.update_yaxes(title_text=metric, row=1, col=col)
    fig.update_layout(
        title="Pareto front (thick outline: on the front; diamond: baseline; bars: 95% CI)",
        height=450,
        width=max(600, 480 * len(metrics)),
    )
    return fig


def _ci_width(t: TrialRecord, metric: str, bound: str) -> float:
    v = t.metrics.get(f"{metric}.{bound}")
    return 0.0 if v is None else abs(v - t.metrics[metric])


def _hover(t: TrialRecord, metric: str, capacity: str = "tenants") -> str:
    lo, hi = t.metrics.get(f"{metric}.ci_low"), t.metrics.get(f"{metric}.ci_high")
    ci = f" [{lo:.4g}, {hi:.4g}]" if lo is not None and hi is not None else ""
    roles = [r for r, on in (("front", t.on_front), ("baseline", t.is_baseline)) if on]
    head = f"trial {t.number}" + (f" ({', '.join(roles)})" if roles else "")
    return (
        f"{head}<br>{capacity} {t.tenants:.0f}<br>{metric} {t.metrics[metric]:.4g}{ci}<br>"
        + t.plan_summary().replace("\n", "<br>")
    )


def front_table_rows(study: StudyRecord) -> list[dict[str, str]]:
    """The front's plans, most tenants first: trial, tenants (the capacity the study used;
    at an SLO, memory's count beside it), each metric with CI, plan."""
    rows = []
    front = sorted(
        (t for t in study.completed if t.on_front), key=lambda t: (-(t.tenants or 0), t.number)
    )
    for t in front:
        row = {"trial": str(t.number), study.capacity_label: f"{t.tenants:.0f}"}
        if study.capacity_metric != "tenants" and t.tenants_by_memory is not None:
            row["tenants by memory"] = f"{t.tenants_by_memory:.0f}"
        for m in study.quality_metrics:
            q = t.metric_ci(m)
            row[m] = "-" if q is None else _fmt_ci(q)
            c = t.metric_ci(f"confirmed.{m}")
            if c is not None:
                row[f"confirmed {m}"] = _fmt_ci(c)
        row["shippable"] = "yes" if t.shippable else "no"
        row["verdicts"] = t.gate_words() or "-"
        row["plan"] = t.plan_summary()
        row["fingerprint"] = t.fingerprint
        row["export"] = export_command(study, t)
        rows.append(row)
    return rows


def export_command(study: StudyRecord, trial: TrialRecord) -> str:
    """`tenantq export` of the trial's logged plan.json (docs/guide/export.md), as one line."""
    import shlex

    model = study.params.get("model.path", "reference")
    return (
        f"tenantq export --model {shlex.quote(model)} --plan runs:/{trial.run_id}/plan.json "
        f"--tracking-uri {shlex.quote(study.tracking_uri)} --out export-{trial.fingerprint}"
    )


def _fmt_ci(q: tuple[float, float | None, float | None]) -> str:
    v, lo, hi = q
    return f"{v:.4g}" if lo is None or hi is None else f"{v:.4g} [{lo:.4g}, {hi:.4g}]"


def waterfall_figure(chosen: TrialRecord, bf16: TrialRecord | None) -> go.Figure | None:
    """Memory per chip -> weights -> reserve -> KV pool -> tenants' pages -> left over, for the
    chosen trial beside the bf16 baseline (from each run's budget.json artifact)."""
    columns = [(f"trial {chosen.number} (chosen)", chosen)]
    if bf16 is not None and bf16.number != chosen.number:
        columns.insert(0, (f"trial {bf16.number} (bf16 baseline)", bf16))
    budgets = [(title, t.artifact_json("budget.json")) for title, t in columns]
    budgets = [(title, b) for title, b in budgets if b]
    if not budgets:
        return None
    fig = make_subplots(
        rows=1, cols=len(budgets), subplot_titles=[t for t, _ in budgets], shared_yaxes=True
    )
    for col, (_, b) in enumerate(budgets, start=1):
        used = b["tenants"] * b["tenant_bytes_per_chip"]
        labels = ["memory", "weights", "reserve", "KV pool", f"{b['tenants']} tenants", "unused"]
        values = [
            b["hbm_bytes_per_chip"],
            -b["weights_bytes_per_chip"],
            -b["reserve_bytes_per_chip"],
            0,
            -used,
            0,
        ]
        measure = ["absolute", "relative", "relative", "total", "relative", "total"]
        hover = [
            f"{b['hbm_bytes_per_chip']:,} B per chip ({b['hardware']}, {b['chips']} chip)",
            f"{b['weights_bytes_per_chip']:,} B: {b['weights_summary']}",
            f"{b['reserve_bytes_per_chip']:,} B ({b['reserve']})",
            f"{b['pool_bytes_per_chip']:,} B = {b['pool_tokens']:,} tokens",
            f"{b['tenants']} x {b['tenant_bytes_per_chip']:,} B at "
            f"{b['context_tokens']} tokens; KV {b['kv_summary']}",
            "",
        ]
        level = b.get("service_level")
        if level is not None:  # the memory's tenants split: served at the SLO, and beyond it
            served = level["tenants_at_slo"]
            slo = f"{level['slo_tokens_per_s']:g} tok/s"
            each = b["tenant_bytes_per_chip"]
            labels[4:5] = [f"{served} tenants at {slo}", f"{b['tenants'] - served} beyond the SLO"]
            values[4:5] = [-served * each, -(used - served * each)]
            measure[4:5] = ["relative", "relative"]
            hover[4:5] = [
                f"{served} tenants get >= {slo} (decode step {level['step']['step_s'] * 1e3:.3g} "
                f"ms; {level['binding']} binds)",
                f"memory holds {b['tenants'] - served} more, each served slower than {slo}",
            ]
        fig.add_trace(
            go.Waterfall(
                x=labels,
                y=[v / MIB for v in values],
                measure=measure,
                text=[
                    f"{abs(v) / MIB:.2f} MiB" if m != "total" else ""
                    for v, m in zip(values, measure, strict=True)
                ],
                textposition="auto",
                hovertext=hover,
                showlegend=False,
            ),
            row=1,
            col=col,
        )
    fig.update_yaxes(title_text="MiB per chip", row=1, col=1)
    fig.update_layout(title="Capacity waterfall: where each chip's memory goes", height=450)
    return fig


def _needle_cells(table, column: str) -> dict[tuple[int, float], float]:
    cells: dict[tuple[int, float], list[float]] = defaultdict(list)
    for task, length, depth, score in zip(
        table.column("task").to_pylist(),
        table.column("length").to_pylist(),
        table.column("depth").to_pylist(),
        table.column(column).to_pylist(),
        strict=True,
    ):
        if task.startswith("needle") and depth is not None and not math.isnan(depth):
            cells[(int(length), round(float(depth), 3))].append(float(score))
    return {k: sum(v) / len(v) for k, v in cells.items()}


def needle_figure(chosen: TrialRecord) -> go.Figure | None:
    """Needle accuracy by context length (y) and depth (x): bf16, the chosen plan, and the
    difference (candidate - bf16), from the chosen run's examples.parquet."""
    table = chosen.artifact_table("examples.parquet")
    if table is None:
        return None
    base = _needle_cells(table, "baseline_score")
    cand = _needle_cells(table, "candidate_score")
    if not base:
        return None
    lengths = sorted({k[0] for k in base})
    depths = sorted({k[1] for k in base})

    def grid(cells):
        return [[cells.get((n, d)) for d in depths] for n in lengths]

    diff = {k: cand[k] - base[k] for k in base if k in cand}
    fig = make_subplots(
        rows=1,
        cols=3,
        subplot_titles=["bf16 baseline", f"trial {chosen.number}", "difference (trial - bf16)"],
        horizontal_spacing=0.1,
    )
    y = [str(n) for n in lengths]
    x = [f"{d:.0%}" for d in depths]
    for col, (cells, scale, zmin, zmax, bar_x) in enumerate(
        [
            (base, "Viridis", 0, 1, 0.26),
            (cand, "Viridis", 0, 1, 0.63),
            (diff, "RdBu", -1, 1, 1.0),
        ],
        start=1,
    ):
        fig.add_trace(
            go.Heatmap(
                z=grid(cells),
                x=x,
                y=y,
                colorscale=scale,
                zmin=zmin,
                zmax=zmax,
                colorbar={"x": bar_x, "len": 0.9, "thickness": 10},
                hovertemplate="length %{y}, depth %{x}: %{z:.2f}<extra></extra>",
            ),
            row=1,
            col=col,
        )
        fig.update_xaxes(title_text="needle depth", row=1, col=col)
    fig.update_yaxes(title_text="context tokens", row=1, col=1)
    fig.update_layout(title="Needle retrieval accuracy (length x depth)", height=400, width=1200)
    return fig


_TENSOR_PATH = re.compile(r"layers/(\d+)/(attn|mlp)/(\w+)")


def sensitivity_figure(profile_table) -> go.Figure | None:
    """Per-tensor sensitivity (mean KL of quantizing that tensor alone), layer x tensor class,
    one panel per format, from the table `tenantq sensitivity` writes."""
    if profile_table is None:
        return None
    by_format: dict[str, dict[tuple[int, str], float]] = defaultdict(dict)
    names = profile_table.schema.names
    # A KV layer has two rows, keys and values, told apart by `tensor_class` (one cell each).
    kv_parts = (
        profile_table.column("tensor_class").to_pylist()
        if "tensor_class" in names
        else [None] * profile_table.num_rows
    )
    for tensor, fmt, kl, part in zip(
        profile_table.column("tensor").to_pylist(),
        profile_table.column("format").to_pylist(),
        profile_table.column("kl_mean").to_pylist(),
        kv_parts,
        strict=True,
    ):
        m = _TENSOR_PATH.fullmatch(tensor)
        if m:
            by_format[fmt][(int(m.group(1)), f"{m.group(2)}/{m.group(3)}")] = float(kl)
        elif tensor.startswith("kv/"):
            label = f"kv/{part}" if part in ("keys", "values") else "kv cache"
            by_format[fmt][(int(tensor.split("/")[1]), label)] = float(kl)
    if not by_format:
        return None
    formats = sorted(by_format)
    fig = make_subplots(rows=1, cols=len(formats), subplot_titles=formats, shared_yaxes=True)
    for col, fmt in enumerate(formats, start=1):
        cells = by_format[fmt]
        layers = sorted({k[0] for k in cells})
        classes = sorted({k[1] for k in cells})
        fig.add_trace(
            go.Heatmap(
                z=[[cells.get((i, c)) for c in classes] for i in layers],
                x=classes,
                y=[str(i) for i in layers],
                colorscale="Magma",
                coloraxis="coloraxis",
                hovertemplate=f"{fmt} layer %{{y}} %{{x}}: KL %{{z:.3g}}<extra></extra>",
            ),
            row=1,
            col=col,
        )
    fig.update_yaxes(title_text="layer", row=1, col=1)
    fig.update_layout(
        title="Per-tensor sensitivity: mean KL when only that tensor is quantized",
        coloraxis={"colorscale": "Magma", "colorbar": {"title": "KL"}},
        height=450,
    )
    return fig


def flips_figure(study: StudyRecord, limit_trials: int = 8) -> go.Figure | None:
    """Left: correct->wrong and wrong->correct answers per task for each measured trial. Right:
    the baseline's margin (top-1 minus top-2 log-prob) of every pass/fail answer, flipped or
    not; low-margin answers flip first."""
    trials = [t for t in study.completed if t.duplicate_of is None and not t.is_bf16]
    trials = sorted(trials, key=lambda t: (not t.on_front, t.number))[:limit_trials]
    counts: list[tuple[TrialRecord, dict[str, list[int]]]] = []
    margins: dict[str, list[float]] = {"flipped": [], "unchanged": []}
    for t in trials:
        table = t.artifact_table("examples.parquet")
        if table is None:
            continue
        per_task: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for task, flip, margin in zip(
            table.column("task").to_pylist(),
            table.column("flip").to_pylist(),
            table.column("margin").to_pylist(),
            strict=True,
        ):
            if task == "fidelity":
                continue
            per_task[task]  # noqa: B018 - every task shows, even with no flip
            if flip == "correct_to_wrong":
                per_task[task][0] += 1
            elif flip == "wrong_to_correct":
                per_task[task][1] += 1
            if margin is not None and not math.isnan(margin):
                margins["flipped" if flip else "unchanged"].append(float(margin))
        if per_task:
            counts.append((t, dict(per_task)))
    if not counts:
        return None
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=["answers that flipped, per task", "baseline margin of each answer"],
        column_widths=[0.6, 0.4],
    )
    for t, per_task in counts:
        tasks = sorted(per_task)
        label = f"trial {t.number}" + (" (front)" if t.on_front else "")
        fig.add_trace(
            go.Bar(
                x=tasks,
                y=[per_task[k][0] for k in tasks],
                name=f"{label}: correct->wrong",
                hovertemplate="%{x}: %{y} correct->wrong<extra>" + label + "</extra>",
            ),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Bar(
                x=tasks,
                y=[-per_task[k][1] for k in tasks],
                name=f"{label}: wrong->correct (below 0)",
                hovertemplate="%{x}: %{y} (wrong->correct)<extra>" + label + "</extra>",
            ),
            row=1,
            col=1,
        )
    for kind, color in (("unchanged", COMPLETE_COLOR), ("flipped", NOT_SHIPPABLE_COLOR)):
        if margins[kind]:
            fig.add_trace(
                go.Box(
                    y=margins[kind],
                    name=f"{kind} ({len(margins[kind])})",
                    boxpoints="all",
                    jitter=0.4,
                    marker_color=color,
                ),
                row=1,
                col=2,
            )
    fig.update_yaxes(title_text="answers", row=1, col=1)
    fig.update_yaxes(title_text="bf16 margin (log-prob top-1 - top-2)", row=1, col=2)
    fig.update_layout(title="Flips against bf16", barmode="relative", height=450, width=1200)
    return fig


def timeline_figure(study: StudyRecord) -> go.Figure | None:
    """Each trial as a bar on its worker's lane, ending when its result was logged and as long
    as the worker took (`time.worker_elapsed_s`); failures in dark red, retries named,
    duplicates answered from the study on their own lane. A trial whose run has no time
    (`logged_ms` None) is left off."""
    timed = [t for t in study.trials if t.logged_ms is not None]
    if not timed:
        return None
    t0 = min(t.logged_ms / 1000.0 - t.metrics.get("time.worker_elapsed_s", 0.0) for t in timed)
    failed_fps: dict[str, int] = {}
    bars: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for t in timed:
        end_s = t.logged_ms / 1000.0 - t0
        elapsed = t.metrics.get("time.worker_elapsed_s", 0.0)
        if t.failed:
            lane, kind = t.tags.get("tenantq.worker") or "failed (worker not recorded)", "failed"
        elif t.duplicate_of is not None:
            lane, kind = "answered from the study", "duplicate"
        else:
            lane, kind = t.tags.get("tenantq.worker") or "driver (capacity only)", "complete"
        retry_of = failed_fps.get(t.fingerprint) if t.fingerprint else None
        if t.failed and t.fingerprint:
            failed_fps.setdefault(t.fingerprint, t.number)
        label = f"{t.number}" + (f" (retry of {retry_of})" if retry_of is not None else "")
        error = t.tags.get("tenantq.error", "")
        bars[kind].append(
            {
                "lane": lane,
                "start": end_s - elapsed,
                "width": max(elapsed, 0.5),  # a failure or a duplicate takes no worker time
                "label": label,
                "hover": f"trial {label}, {kind}, {elapsed:.1f} s on {lane}"
                + (f"<br>{error[:200]}" if error else ""),
            }
        )
    fig = go.Figure()
    colors = {"complete": COMPLETE_COLOR, "failed": FAILED_COLOR, "duplicate": DUPLICATE_COLOR}
    for kind, items in bars.items():
        fig.add_trace(
            go.Bar(
                orientation="h",
                y=[b["lane"] for b in items],
                x=[b["width"] for b in items],
                base=[b["start"] for b in items],
                text=[b["label"] for b in items],
                textposition="inside",
                name=f"{kind} ({len(items)})",
                marker_color=colors[kind],
                hovertext=[b["hover"] for b in items],
                hoverinfo="text",
            )
        )
    busy = _utilization(bars.get("complete", []))
    subtitle = ", ".join(f"{lane}: {share:.0%} busy" for lane, share in sorted(busy.items()))
    fig.update_layout(
        title=f"Trial timeline per worker ({subtitle})" if subtitle else "Trial timeline",
        xaxis_title="seconds since the first trial started",
        barmode="overlay",
        height=250 + 40 * len({b["lane"] for items in bars.values() for b in items}),
    )
    return fig


def _utilization(items: list[dict[str, Any]]) -> dict[str, float]:
    """Busy seconds over the span from the first trial start to the last end, per lane."""
    if not items:
        return {}
    span = max(b["start"] + b["width"] for b in items) - min(b["start"] for b in items)
    busy: dict[str, float] = defaultdict(float)
    for b in items:
        busy[b["lane"]] += b["width"]
    return {lane: min(s / span, 1.0) for lane, s in busy.items()} if span > 0 else {}
