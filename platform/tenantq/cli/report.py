"""`tenantq report --experiment NAME`: the study's report, read back from MLflow.

Writes `OUT/report.html` (plotly.js embedded: opens with no network) and `OUT/figures/*.png`.
A missing experiment or study is one line naming those that exist (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys

from tenantq.cli._args import output_folder


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report",
        help="the study report (HTML + images) read back from MLflow",
        description="Read a study from MLflow and write a self-contained HTML report: Pareto "
        "front, capacity waterfall, needle grid, sensitivity, flips, trial timeline.",
    )
    p.add_argument("--experiment", required=True, help="MLflow experiment (the spec's)")
    p.add_argument(
        "--tracking-uri",
        default="sqlite:///mlflow.db",
        help="MLflow tracking URI (default sqlite:///mlflow.db, MLflow 3's default)",
    )
    p.add_argument("--study", help="study name when the experiment holds several (default: latest)")
    p.add_argument("--out", help="output folder (default reports/EXPERIMENT)")
    p.add_argument("--trial", type=int, help="trial for the waterfall and needle grid")
    p.add_argument("--profile", help="sensitivity profile table (Parquet/Arrow) to draw")
    p.add_argument(
        "--static",
        default="auto",
        choices=["auto", "png", "svg", "none"],
        help="static images: png/svg (needs Chrome/Chromium), auto = png when one is found",
    )
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    # MLflow draws a progress bar per artifact download; the report reads dozens.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

    from tenantq.report import load_study, write_report

    out = output_folder(args.out or Path("reports") / args.experiment, "--out")
    study = load_study(args.tracking_uri, args.experiment, args.study)
    outcome = write_report(study, out, trial=args.trial, profile=args.profile, static=args.static)
    if args.json:
        print(
            json.dumps(
                {
                    "study": study.name,
                    "html": str(outcome.html_path),
                    "images": [str(p) for p in outcome.images],
                    "figures": outcome.figures,
                    "skipped": outcome.skipped,
                    "static_note": outcome.static_note,
                },
                indent=2,
            )
        )
        return 0
    print(f"report: {outcome.html_path} ({len(outcome.figures)} figures)")
    for name, why in outcome.skipped.items():
        print(f"  not drawn: {name}: {why}")
    if outcome.images:
        print(f"images: {outcome.images[0].parent}/ ({len(outcome.images)} files)")
    if outcome.static_note:
        print(f"note: {outcome.static_note}", file=sys.stderr)
    return 0
