"""Writes the study report: one self-contained HTML file and a static image of each figure.

plotly.js is embedded once in the HTML, so the file opens with no network. Static images go
through kaleido, which drives a local Chrome/Chromium (Debian `chromium` is found on PATH);
with `static="auto"` a machine without one gets the HTML and a one-line note instead.
The files are written under a temporary name and renamed, so a failure leaves no half report.
"""

from __future__ import annotations

import contextlib
import html
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from tenantq.model.files import atomic_path
from tenantq.report import figures
from tenantq.report.study import StudyRecord

STATIC_FORMATS = ("png", "svg")


@dataclass
class ReportOutcome:
    html_path: Path
    images: list[Path] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)  # names of the figures drawn
    skipped: dict[str, str] = field(default_factory=dict)  # figure -> why it is absent
    static_note: str = ""


def load_profile(study: StudyRecord, profile: str | Path | None):
    """The sensitivity table (Parquet or Arrow IPC) given, or named by the study's spec."""
    spec_text = study.spec_text  # downloaded from MLflow: read once
    if profile is None and spec_text:
        space = tomllib.loads(spec_text).get("space", {})
        profile = space.get("profile") if space.get("kind") == "sensitivity" else None
    if profile is None:
        return None
    from tenantq.evals.profile import read_profile_table

    return read_profile_table(profile, _study_num_layers(spec_text))


def _study_num_layers(spec_text: str) -> int | None:
    """The layers of the model the study ran on, when its checkpoint is readable here (a
    profile's KV rows are checked against them); None otherwise."""
    from tenantq.model.config import ModelConfig
    from tenantq.search.spec import REFERENCE_MODEL

    try:
        model = tomllib.loads(spec_text).get("model") if spec_text else None
    except tomllib.TOMLDecodeError:
        return None
    if not isinstance(model, str):
        return None
    if model == REFERENCE_MODEL:
        from tenantq.reference import reference_model_path

        folder = reference_model_path()
    else:
        folder = Path(model).expanduser()
    if not (folder / "config.json").is_file():
        return None
    try:
        return ModelConfig.from_file(folder / "config.json").num_layers
    except ValueError:
        return None


def _why_no_pareto(study: StudyRecord) -> str:
    """Why the Pareto figure is absent: no trial completed, or none measured quality."""
    if not [t for t in study.completed if t.duplicate_of is None]:
        return "no completed trial"
    return (
        "the study has no quality objective (a capacity-only study measures tenants only, "
        "so there is no tenants-against-quality plane to draw)"
    )


def _why_no_sensitivity(profile) -> str:
    if profile is None:
        return "no sensitivity profile (a `sensitivity` space's spec names one; or --profile)"
    return (
        "the profile has no per-layer rows to draw (layers/I/... or kv/I tensors), only "
        "whole-model tensors such as embed or lm_head"
    )


def build_figures(study: StudyRecord, trial: int | None = None, profile=None):
    """(name, title, figure or None, why absent) for every section of the report."""
    chosen = study.choose_trial(trial)
    bf16 = study.bf16
    out = []
    out.append(("pareto", "Pareto front", figures.pareto_figure(study), _why_no_pareto(study)))
    if chosen is None:
        out += [
            ("capacity", "Capacity waterfall", None, "no completed trial"),
            ("needles", "Needle grid", None, "no completed trial"),
        ]
    else:
        out.append(
            (
                "capacity",
                f"Capacity waterfall: trial {chosen.number} beside bf16",
                figures.waterfall_figure(chosen, bf16),
                "the chosen trial has no budget.json",
            )
        )
        out.append(
            (
                "needles",
                f"Needle grid: bf16 and trial {chosen.number}",
                figures.needle_figure(chosen),
                "the suite has no needle task (no needle rows in examples.parquet)",
            )
        )
    out.append(
        (
            "sensitivity",
            "Per-tensor sensitivity",
            figures.sensitivity_figure(profile),
            _why_no_sensitivity(profile),
        )
    )
    out.append(
        (
            "flips",
            "Flips per task",
            figures.flips_figure(study),
            "no pass/fail task in the suite (fidelity only)",
        )
    )
    out.append(("timeline", "Trial timeline", figures.timeline_figure(study), "no trial"))
    return chosen, out


def write_report(
    study: StudyRecord,
    out_dir: str | Path,
    *,
    trial: int | None = None,
    profile: str | Path | None = None,
    static: str = "auto",
) -> ReportOutcome:
    """Write `report.html` and `figures/NAME.{png,svg}` under `out_dir`."""
    if static not in (*STATIC_FORMATS, "auto", "none"):
        raise ValueError(f"--static must be one of png, svg, auto, none; got {static!r}")
    from plotly.offline import get_plotlyjs

    out = Path(out_dir)
    if out.exists() and not out.is_dir():  # checked before any figure is built
        raise ValueError(f"out: {out} is a file; give a folder for report.html and figures/")
    table = load_profile(study, profile)
    chosen, sections = build_figures(study, trial, table)
    outcome = ReportOutcome(html_path=out / "report.html")
    body = [_header(study, chosen)]
    drawn = []
    for name, title, fig, why in sections:
        body.append(f'<h2 id="{name}">{html.escape(title)}</h2>')
        if fig is None:
            body.append(f'<p class="absent">Not drawn: {html.escape(why)}.</p>')
            outcome.skipped[name] = why
            continue
        body.append(
            f'<div class="figure" data-figure="{name}">'
            + fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"fig-{name}")
            + "</div>"
        )
        if name == "pareto":
            body.append(_front_table(study))
        drawn.append((name, fig))
        outcome.figures.append(name)
    page = (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>tenantq report: {html.escape(study.name)}</title>"
        f"<style>{_CSS}</style>"
        f'<script type="text/javascript">{get_plotlyjs()}</script>'
        "</head><body>" + "\n".join(body) + "</body></html>"
    )
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(outcome.html_path) as tmp:
        tmp.write_text(page, encoding="utf-8")
    outcome.images, outcome.static_note = _write_static(drawn, out / "figures", static)
    return outcome


def _write_static(drawn, folder: Path, static: str) -> tuple[list[Path], str]:
    if static == "none" or not drawn:
        return [], ""
    fmt = "png" if static == "auto" else static
    import plotly.io as pio

    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{name}.{fmt}" for name, _ in drawn]
    try:
        # All drawn to temporaries first: a failure while drawing replaces none; after it
        # each is renamed in turn (not one atomic step: a reader may see old and new mixed).
        with contextlib.ExitStack() as stack:
            tmps = [stack.enter_context(atomic_path(p)) for p in paths]
            # One browser session for all figures (kaleido >= 1): seconds, not per figure.
            pio.write_images(
                [fig for _, fig in drawn], tmps, format=fmt, width=[_width(f) for _, f in drawn]
            )
    except Exception as err:  # kaleido found no Chrome/Chromium, or it would not start
        note = f"static images not written: {type(err).__name__}: {str(err).splitlines()[0]}"
        if static == "auto":
            return [], note + " (install chromium, or pass --static none)"
        raise ValueError(note) from err
    return paths, ""


def _width(fig) -> int:
    return int(fig.layout.width or 1100)


def _header(study: StudyRecord, chosen) -> str:
    done = len(study.completed)
    failed = sum(t.failed for t in study.trials)
    front = sum(t.on_front for t in study.completed)
    p = study.params
    rows = [
        ("study", study.name),
        ("experiment", f"{study.experiment} ({study.tracking_uri})"),
        ("parent run", study.parent_run_id),
        ("trials", f"{len(study.trials)} logged: {done} complete, {failed} failed"),
        ("front", f"{front} trial(s) tagged tenantq.pareto"),
        ("objectives", p.get("objectives", "-")),
        (
            "deployment",
            f"{p.get('deployment.hardware', '?')} x{p.get('deployment.chips', '?')}, "
            f"memory {p.get('deployment.memory') or 'profile'}, "
            f"{p.get('deployment.context_tokens', '?')} tokens per tenant",
        ),
        ("model", f"{p.get('model.path', '?')} (identity {p.get('model.identity', '?')})"),
        ("suite", p.get("eval.suite", "-")),
        ("chosen trial", "-" if chosen is None else f"{chosen.number}: {chosen.plan_summary()}"),
    ]
    warned = {k: v for t in study.completed for k, v in t.warnings().items()}
    if warned:  # the suite's bf16 pass-rate bar (evals.suite.baseline_pass_warnings)
        rows.append(("warnings", "\n".join(f"{k}: {v}" for k, v in sorted(warned.items()))))
    cells = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows
    )
    return f"<h1>tenantq study {html.escape(study.name)}</h1><table class='meta'>{cells}</table>"


def _front_table(study: StudyRecord) -> str:
    rows = figures.front_table_rows(study)
    if not rows:
        return "<p class='absent'>No trial is tagged tenantq.pareto (the study did not finish).</p>"
    head = list(dict.fromkeys(k for r in rows for k in r))
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    trs = "".join(
        "<tr>" + "".join(f"<td>{html.escape(r.get(h, '-'))}</td>" for h in head) + "</tr>"
        for r in rows
    )
    return f"<h3>The front's plans</h3><table class='front'><tr>{th}</tr>{trs}</table>"


_CSS = """
body { font-family: sans-serif; margin: 2em; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top;
         white-space: pre-wrap; font-size: 13px; }
.absent { color: #777; font-style: italic; }
"""
