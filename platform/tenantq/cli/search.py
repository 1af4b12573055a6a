"""`tenantq search SPEC`: run (or resume) the Optuna study an experiment spec describes.

Ray starts in-process unless `--address` names a cluster (under `ray job submit` the job's
cluster is found by Ray itself). A bad spec is one line on stderr and exit 2, with nothing
written to Optuna or MLflow.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from tenantq.cli._args import output_folder


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "search",
        help="search quantization plans: Optuna study on Ray workers, tracked in MLflow",
        description="Run the study an experiment spec (experiments/*.toml) describes: tenants "
        "(exact) against quality (measured), Pareto front at the end, plans exported as JSON.",
    )
    p.add_argument("spec", help="experiment spec TOML, e.g. experiments/quickstart.toml")
    p.add_argument("--resume", action="store_true", help="continue the study of the same name")
    p.add_argument(
        "--resume-or-start",
        action="store_true",
        help="resume the study if its storage has it, else start it (make demo)",
    )
    p.add_argument(
        "--continue-as",
        metavar="NEW_NAME",
        help="copy the study (its model, suites or spec changed) to NEW_NAME and go on there",
    )
    p.add_argument("--workers", type=int, help="override workers.count")
    p.add_argument("--address", help="Ray cluster address (default: start Ray in-process)")
    p.add_argument("--trials", type=int, help="override study.trials")
    p.add_argument("--out", help="folder for the front's plans (default runs/STUDY)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--check", action="store_true", help="validate the spec and exit")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    # The driver never opens an accelerator; only workers do (DESIGN.md). Set, not defaulted:
    # on a TPU host a driver holding the TPU would lock its own worker out.
    os.environ["JAX_PLATFORMS"] = "cpu"
    from pathlib import Path

    from tenantq.search.checks import IgnoredOptionWarning
    from tenantq.search.spec import load_spec

    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be a positive integer, got {args.workers}")
    if args.trials is not None and args.trials < 1:
        raise ValueError(f"--trials must be a positive integer, got {args.trials}")
    if args.out is not None:  # the front's plans are written at the end: checked now
        output_folder(args.out, "--out")
    spec = load_spec(args.spec)
    if args.trials is not None:
        spec = spec.model_copy(
            update={"study": spec.study.model_copy(update={"trials": args.trials})}
        )
    text = Path(args.spec).read_text()
    shown: set[str] = set()
    default_show = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        # Values the study ignores: one line each on stderr, once (the checks run again when
        # the driver prepares the study), named by tenantq.search.checks.
        if not issubclass(category, IgnoredOptionWarning):
            return default_show(message, category, filename, lineno, file, line)
        if str(message) not in shown:
            shown.add(str(message))
            print(f"tenantq search: warning: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.simplefilter("always", IgnoredOptionWarning)
        warnings.showwarning = show
        return _run(args, spec, text)


def _run(args: argparse.Namespace, spec, text: str) -> int:
    from tenantq.search.checks import check_resumable, no_trial_completed
    from tenantq.search.driver import SearchDriver, study_context, study_exists

    if args.check:
        study_context(spec, text)
        print(f"{args.spec}: valid ({spec.space.kind} space, {spec.study.trials} trials)")
        return 0
    resume = args.resume
    if args.resume:
        check_resumable(spec)  # before either store is opened: a failed resume creates none
    continue_from = None
    if args.continue_as:
        continue_from = spec.study.name
        study = spec.study.model_copy(update={"name": args.continue_as})
        spec = spec.model_copy(update={"study": study})
        resume = True
    if args.resume_or_start:
        study_context(spec, text)  # a bad spec stops here, before a storage is opened
        resume = study_exists(spec.study.storage, spec.study.name)
    driver = SearchDriver(
        spec,
        text,
        resume=resume,
        workers=args.workers,
        address=args.address,
        progress=not args.no_progress,
        out_dir=args.out,
        continue_from=continue_from,
    )
    from tenantq.workers.pool import WorkerStartError

    try:
        outcome = driver.run()
    except WorkerStartError as err:
        # Every trial would fail the same way: one line, not a traceback; the study is kept.
        print(f"tenantq search: workers could not run: {err}", file=sys.stderr)
        return 1
    failed_all = no_trial_completed(outcome.counts)
    if args.json:
        print(
            json.dumps(
                {
                    "study": outcome.study_name,
                    "counts": outcome.counts,
                    "front": [
                        {
                            "trial": r.trial,
                            "tenants": r.tenants,
                            "capacity": r.capacity_label,
                            "tenants_by_memory": r.tenants_by_memory,
                            "quality": r.quality,
                            "confirmed": r.confirmed,
                            "shippable": r.feasible,
                            "fingerprint": r.fingerprint,
                        }
                        for r in outcome.front
                    ],
                    "exported": [str(p) for p in outcome.exported],
                    "mlflow_parent_run_id": outcome.mlflow_parent_run_id,
                },
                indent=2,
            )
        )
        if failed_all:
            print(f"tenantq search: {failed_all}", file=sys.stderr)
        return 1 if failed_all else 0
    c = outcome.counts
    print(
        f"\nstudy {outcome.study_name}: {c['done']} distinct plans; {c['complete']} trials "
        f"complete ({c['duplicates']} duplicates), {c['failed']} failed ({c['retries']} "
        f"retried) in {outcome.storage}\n"
    )
    print(outcome.table)
    if outcome.exported:
        print(f"\nfront plans: {outcome.exported[0].parent}/ ({len(outcome.exported)} files)")
    uri = spec.tracking.uri
    print(
        f"MLflow: experiment {spec.experiment_name!r}, parent run {outcome.mlflow_parent_run_id}"
        f"\n  open the UI with: mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000"
    )
    if failed_all:  # a study that measured nothing is not a success, whatever it recorded
        print(f"tenantq search: {failed_all}", file=sys.stderr)
        return 1
    return 0
