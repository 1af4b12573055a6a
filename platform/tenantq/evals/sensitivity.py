"""Sensitivity profiles: what one tensor costs in KL when it alone leaves bf16.

Each unit (one weight tensor, one layer's attention or MLP block, or one layer's keys or
values in the KV cache) is quantized to the format with everything else in bf16, and the
engine's per-token KL against the bf16 baseline on a small fixed set of held-out windows
is averaged per window and given a paired bootstrap CI (`evals.fidelity`, `evals.stats`).
The result is an Arrow table (tensor, format, kl_mean, kl_ci_low, kl_ci_high, ...) cached
as Parquet by (model identity, format, dataset hash); the search's `sensitivity` space reads
it to keep the k most sensitive tensors in bf16. With several local devices the units run
in parallel, one per device at a time, each device holding its own copy of the model (the
table is the serial run's, row for row). Its windows come from `evals.windows`.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tenantq.evals import data, fidelity
from tenantq.evals.identity import cache_key, model_identity
from tenantq.evals.windows import text_windows
from tenantq.model.config import ModelConfig
from tenantq.model.files import CACHE_DIR, atomic_path
from tenantq.model.terminal import progress_bar, text_table
from tenantq.quant.plan import FORMAT_NAMES, KV_FORMAT_NAMES, KVPlan, QuantPlan, Rule

DEFAULT_ROWS = 16  # windows in the fixed set
DEFAULT_ROW_TOKENS = 128  # tokens per window, BOS included
DEFAULT_RESAMPLES = 2000
EXACT_VOCAB_LIMIT = 32768  # exact KL below this vocabulary (as the quality suite)
TOP_K = 64  # top-k + tail KL above it
UNIT_KINDS = ("tensor", "block")
CACHE_VERSION = 1
SCHEMA = pa.schema(
    [
        ("tensor", pa.string()),  # a tensor path, a block (layers/3/mlp), or kv/3 (a KV layer)
        ("format", pa.string()),
        ("kl_mean", pa.float64()),  # mean over windows of the per-token KL (nats)
        ("kl_ci_low", pa.float64()),
        ("kl_ci_high", pa.float64()),
        ("top1_agree", pa.float64()),
        ("layer", pa.int64()),  # null for embed / lm_head
        ("tensor_class", pa.string()),  # q_proj ... down_proj, attn, mlp, keys, values, embed
        ("kind", pa.string()),  # "weight" or "kv"
        ("rows", pa.int64()),
        ("tokens", pa.int64()),
    ]
)


# --- units ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One thing quantized on its own: its name in the table and the plan that does it."""

    tensor: str
    layer: int | None
    tensor_class: str
    kind: str
    plan: QuantPlan


def units(config: ModelConfig, fmt: str, *, by: str = "tensor", kv: bool = False) -> list[Unit]:
    """Every unit of `config`: weight tensors (or blocks), or each layer's keys and values."""
    if by not in UNIT_KINDS:
        raise ValueError(f"unit kind {by!r} unknown; use one of {', '.join(UNIT_KINDS)}")
    if kv:
        if fmt not in KV_FORMAT_NAMES:
            raise ValueError(f"KV format {fmt!r} unknown; valid: {', '.join(KV_FORMAT_NAMES)}")
        out = []
        for i in range(config.num_layers):
            for part, formats in (("keys", (i, fmt, "bf16")), ("values", (i, "bf16", fmt))):
                plan = QuantPlan(kv=KVPlan(layer_formats=(formats,)))
                # "kv/{i}" is how the search's sensitivity space names a KV layer; keys and
                # values are two rows of it (tensor_class), the search takes the larger.
                out.append(Unit(f"kv/{i}", i, part, "kv", plan))
        return out
    if fmt not in FORMAT_NAMES or fmt == "bf16":
        raise ValueError(f"format {fmt!r} is not a quantized weight format; valid: "
                         f"{', '.join(f for f in FORMAT_NAMES if f != 'bf16')}")  # fmt: skip
    out, blocks = [], {}
    for path, info in config.tensors().items():
        if not info.quantizable:
            continue
        parts = path.split("/")
        if parts[0] != "layers":
            out.append(Unit(path, None, path, "weight", _only(re.escape(path), fmt)))
        elif by == "tensor":
            out.append(Unit(path, int(parts[1]), parts[-1], "weight", _only(re.escape(path), fmt)))
        else:
            blocks.setdefault("/".join(parts[:3]), (int(parts[1]), parts[2]))
    for block, (layer, cls) in blocks.items():
        out.append(Unit(block, layer, cls, "weight", _only(re.escape(block) + "/.*", fmt)))
    return out


def _only(pattern: str, fmt: str) -> QuantPlan:
    return QuantPlan(rules=(Rule(pattern, fmt),))


# --- profiling -----------------------------------------------------------------------------


def profile(
    model_path: str | Path,
    fmt: str,
    *,
    kv: bool = False,
    by: str = "tensor",
    source: str = data.REFERENCE_TEST,
    rows: int = DEFAULT_ROWS,
    row_tokens: int = DEFAULT_ROW_TOKENS,
    resamples: int = DEFAULT_RESAMPLES,
    cache_dir: str | Path = CACHE_DIR,
    progress: bool = True,
    on_unit: Callable[[Unit, Any], None] | None = None,
    devices: Sequence[Any] | None = None,
) -> pa.Table:
    """The sensitivity table of the checkpoint at `model_path` (cached; see module doc).

    `devices`: where units run, one unit per device at a time (default
    `jax.local_devices()`); `on_unit(unit, device)` is called as each unit starts.
    """
    import jax
    import jax.numpy as jnp

    from tenantq.engine import Engine
    from tenantq.model.loader import load_params
    from tenantq.model.tokenizer import require_tokenizer

    model_path = Path(model_path)
    config = ModelConfig.from_file(model_path)
    todo = units(config, fmt, by=by, kv=kv)
    tokenizer = require_tokenizer(model_path, config.vocab_size)
    windows = text_windows(tokenizer, config, source=source, rows=rows, row_tokens=row_tokens)
    key = cache_key(
        version=CACHE_VERSION, model=model_identity(model_path), format=fmt, by=by, kv=kv,
        dataset=data.array_hash(windows), resamples=resamples,
    )  # fmt: skip
    path = Path(cache_dir) / f"sensitivity-{key}.parquet"
    if path.is_file():
        return pq.read_table(path, schema=SCHEMA)
    params = load_params(model_path, config, dtype=jnp.bfloat16)
    options = {"max_seqs": min(rows, 16), "max_seq_tokens": row_tokens}
    base = fidelity.compute_baseline(
        Engine(config, params, QuantPlan(), **options), windows,
        exact=config.vocab_size <= EXACT_VOCAB_LIMIT, top_k=TOP_K,
    )  # fmt: skip
    devices = list(jax.local_devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices is empty; pass at least one jax device (or None for all)")
    bar = progress_bar(len(todo), enabled=progress, desc=f"sensitivity {fmt}", unit="unit")

    def measure(unit: Unit, device, params_there, base_there) -> dict:
        if on_unit is not None:
            on_unit(unit, device)
        with jax.default_device(device):
            engine = Engine(config, params_there, unit.plan, **options)
            kl = fidelity.kl_against_baseline(engine, windows, base_there, resamples=resamples)
        bar.update(1)
        return {
            "tensor": unit.tensor, "format": fmt, "kl_mean": kl.ci.delta,
            "kl_ci_low": kl.ci.ci_low, "kl_ci_high": kl.ci.ci_high,
            "top1_agree": float(kl.per_token["top1_agree"].mean()),
            "layer": unit.layer, "tensor_class": unit.tensor_class, "kind": unit.kind,
            "rows": int(kl.per_window.size), "tokens": int(kl.per_token["kl"].size),
        }  # fmt: skip

    try:
        if len(devices) == 1:
            records = [measure(u, devices[0], params, base) for u in todo]
        else:
            records = _over_devices(todo, devices, params, base, measure)
    finally:
        bar.close()
    table = pa.Table.from_pylist(records, schema=SCHEMA)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return table


def _over_devices(todo: list[Unit], devices: list, params: dict, base, measure) -> list[dict]:
    """`measure` every unit, one thread per device pulling the next unit when its last one
    is done; records in `todo`'s order. The first error stops the others and is raised."""
    import jax

    records: list[dict | None] = [None] * len(todo)
    queue = iter(range(len(todo)))
    lock, errors = threading.Lock(), []

    def worker(device) -> None:
        try:
            params_there = jax.device_put(params, device)
            base_there = _baseline_on(base, device)
            while not errors:
                with lock:
                    i = next(queue, None)
                if i is None:
                    return
                records[i] = measure(todo[i], device, params_there, base_there)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(d,), daemon=True) for d in devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return records  # type: ignore[return-value]


def _baseline_on(base: fidelity.FidelityBaseline, device) -> fidelity.FidelityBaseline:
    """The baseline with its device-side arrays (exact log-probs, top-k parts) on `device`."""
    import jax

    on_device = ("logp", "topk_ids", "topk_logp", "tail_logp", "tail_ids", "tail_sample_logp")
    moved = {f: jax.device_put(getattr(base, f), device) for f in on_device}
    return dataclasses.replace(base, **{f: v for f, v in moved.items() if v is not None})


def matrix_text(table: pa.Table) -> str:
    """Layer x tensor-class matrix of kl_mean (rows: layers; non-layer units listed below)."""
    recs = table.to_pylist()
    classes = list(dict.fromkeys(r["tensor_class"] for r in recs if r["layer"] is not None))
    layers = sorted({r["layer"] for r in recs if r["layer"] is not None})
    cell = {(r["layer"], r["tensor_class"]): r["kl_mean"] for r in recs}
    width = max([9, *(len(c) for c in classes)])
    body = [
        [str(layer)] + ["-" if (v := cell.get((layer, c))) is None else f"{v:.3g}" for c in classes]
        for layer in layers
    ]
    lines = text_table(["layer", *classes], body, widths=[5] + [width] * len(classes),
                       right=True, sep=" ")  # fmt: skip
    for r in recs:
        if r["layer"] is None:
            lines.append(f"{r['tensor']}: {r['kl_mean']:.3g}")
    return "\n".join(lines)
