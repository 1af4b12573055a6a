"""`tenantq export`: a model under a plan, written as a compressed-tensors checkpoint.

Round-to-nearest plans stream the checkpoint through the plan. Plans that need calibration
(GPTQ, AWQ, SmoothQuant, static activation or KV scales) are quantized by the same
evaluator that measured them (`--cache-dir` shares its calibration cache), so the export
holds exactly the weights and scales the study scored. A plan part the format cannot hold
is a one-line error unless an opt-in flag says what to do with it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from tenantq.cli._args import cache_folder
from tenantq.model.files import CACHE_DIR


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export",
        help="write a model under a plan as a compressed-tensors checkpoint (vLLM, SGLang)",
        description="Quantize a checkpoint folder under a QuantPlan and write it in the "
        "compressed-tensors layout (config.json quantization_config + packed safetensors), "
        "with its tokenizer, generation config and the plan (tenantq_export.json).",
    )
    p.add_argument(
        "--model", help="checkpoint folder, or 'reference' (default: the shipped reference model)"
    )
    p.add_argument(
        "--plan",
        required=True,
        help="QuantPlan .json/.toml file, or a trial's runs:/RUN_ID/plan.json in MLflow",
    )
    p.add_argument(
        "--tracking-uri",
        default="sqlite:///mlflow.db",
        help="MLflow store a runs:/ plan is read from (default sqlite:///mlflow.db)",
    )
    p.add_argument("--out", required=True, help="new folder to write (must not exist)")
    p.add_argument(
        "--dequantize-unsupported",
        action="store_true",
        help="write weights the format cannot express as their dequantized float32 values "
        "(logged) instead of refusing",
    )
    p.add_argument(
        "--kv-bf16",
        action="store_true",
        help="export the weights alone when the plan's KV part cannot be expressed (logged)",
    )
    p.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="write a quantized lm_head as the plan says (transformers reads it; vLLM cannot "
        "load a quantized lm_head, so it is refused without this flag)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace --out if it is an earlier tenantq export (holds tenantq_export.json)",
    )
    p.add_argument(
        "--log-mlflow",
        action="store_true",
        help="with a runs:/ plan: log the export (config.json, tenantq_export.json, where it "
        "went) to that trial's run",
    )
    p.add_argument(
        "--cache-dir",
        default=str(CACHE_DIR),
        help="calibration cache for plans that need statistics (shared with tenantq eval)",
    )
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    return p


def calibrated(model: Path, plan, cache_dir: str):
    """(params, kv_scales) of `plan` as the evaluator builds them for a trial."""
    from tenantq.evals import Evaluator, load_suite

    engine = Evaluator(model, load_suite("quick"), cache_dir=cache_dir, progress=False)
    engine = engine.build_engine(plan)
    return engine.params, getattr(engine.cache, "kv_scales", None)


def plan_file(plan: str, tracking_uri: str) -> Path:
    """`--plan` as a local file: a runs:/ URI (the report's export command) is downloaded
    from MLflow into a temporary folder."""
    if not plan.startswith("runs:/"):
        return Path(plan)
    import tempfile

    import mlflow

    from tenantq.tracking import check_tracking_uri

    check_tracking_uri(tracking_uri, "--tracking-uri")
    if tracking_uri.startswith("sqlite:///") and not Path(tracking_uri[10:]).is_file():
        raise ValueError(f"--tracking-uri {tracking_uri}: no such MLflow store")
    folder = tempfile.mkdtemp(prefix=".tenantq-plan-")
    try:
        return Path(
            mlflow.artifacts.download_artifacts(plan, dst_path=folder, tracking_uri=tracking_uri)
        )
    except Exception as err:  # MLflow raises its own and OSError types for a missing run
        raise ValueError(f"--plan {plan}: cannot read it from {tracking_uri} ({err})") from None


def log_to_run(run_id: str, tracking_uri: str, result) -> None:
    """The export's config.json and tenantq_export.json as artifacts of the trial's run
    (under export/), and where it was written as a tag."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    for name in ("config.json", "tenantq_export.json"):
        client.log_artifact(run_id, str(result.out / name), artifact_path="export")
    client.set_tag(run_id, "tenantq.export", str(Path(result.out).resolve()))


def needs_calibration(plan, config) -> bool:
    resolved = plan.resolve(config).values()
    static = any(t.activation_scale == "static" or t.algorithm != "rtn" for t in resolved)
    return static or plan.needs_kv_scales


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except OSError as err:  # a full disk, a read-only or vanished folder: one line, the path
        where = " -> ".join(str(f) for f in (err.filename, err.filename2) if f) or args.out
        raise ValueError(f"{where}: {err.strerror or err} (nothing was written to --out)") from None


def _run(args: argparse.Namespace) -> int:
    from tenantq.export import check_out, decide, export_checkpoint
    from tenantq.export.writer import PROVENANCE_FILE as PROVENANCE
    from tenantq.model.config import ModelConfig
    from tenantq.quant.plan import QuantPlan
    from tenantq.reference import reference_model_path

    reference = args.model in (None, "reference")  # the spec's name for the shipped model
    model = reference_model_path() if reference else Path(args.model)
    if not (model / "config.json").is_file():
        raise ValueError(f"--model {model} is not a checkpoint folder (no config.json)")
    plan = QuantPlan.load(plan_file(args.plan, args.tracking_uri))
    config = ModelConfig.from_file(model)
    logging.basicConfig(level=logging.WARNING, format="tenantq export: %(message)s")
    check_out(Path(args.out), args.overwrite, model)  # before any work: refusals cost nothing
    if args.log_mlflow and not args.plan.startswith("runs:/"):
        raise ValueError("--log-mlflow logs to the trial run of a --plan runs:/RUN_ID/plan.json")
    opt_ins = {
        "dequantize_unsupported": args.dequantize_unsupported,
        "kv_bf16": args.kv_bf16,
        "quantize_lm_head": args.quantize_lm_head,
    }
    logging.disable(logging.WARNING)  # the choices are logged once, by the export itself
    try:
        decide(plan, config, **opt_ins)
    finally:
        logging.disable(logging.NOTSET)
    params = kv_scales = None
    if needs_calibration(plan, config):
        cache_folder(args.cache_dir, "--cache-dir")
        print("calibrating (the plan needs statistics) ...", file=sys.stderr)
        params, kv_scales = calibrated(model, plan, args.cache_dir)
    result = export_checkpoint(
        model, plan, args.out, params=params, kv_scales=kv_scales,
        overwrite=args.overwrite, **opt_ins,
    )  # fmt: skip
    if args.log_mlflow:
        log_to_run(args.plan.split("/")[1], args.tracking_uri, result)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
        return 0
    formats: dict[str, int] = {}
    for fmt in result.quantized.values():
        formats[fmt] = formats.get(fmt, 0) + 1
    shown = ", ".join(f"{n} {f}" for f, n in sorted(formats.items())) or "none"
    print(f"wrote {result.out} ({result.nbytes / 2**20:.1f} MiB): quantized modules {shown}")
    kv = result.kv_cache_scheme
    print(f"  kv_cache_scheme: {'none (bf16)' if kv is None else kv['strategy'] + ' fp8'}")
    if result.choices:
        print(f"  {len(result.choices)} choice(s) made by opt-in, logged above and in {PROVENANCE}")
    return 0
