"""Static KV scales: per-layer, per-head statistics of the cached keys and values, and the
scales a `tensor` or `head` KV axis quantizes with.

Calibration windows run through the bf16 model once; the keys are taken as the cache holds
them (after RoPE) through the same recording KV access `quant.input_stats` uses. Per layer,
tensor and KV head we keep max |x|, min, max and a high percentile of |x|, saved as Parquet
keyed by (model identity, dataset hash, percentile) and reused. A scale is then derived with
the one codec (`compute_scale_zero_point` given amax/amin): amax / max_finite for fp8/int,
KIVI-style [min, max] / 3 with a zero point for int2, as vLLM derives its static fp8 scales.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tenantq.model.config import ModelConfig
from tenantq.model.files import atomic_path, cache_key
from tenantq.quant.input_stats import (
    BATCH_SEQUENCES,
    _PrefillKV,
    _rank_of,
    check_windows,
    default_cache_dir,
)

DEFAULT_KV_PERCENTILE = 99.99  # kept beside max |x|; scales use max |x| unless told
# Calibration windows the evaluator draws for static KV scales (the reference train split):
# 64 x 512 = 32,768 tokens per layer and head, ~10x the tokens of one quick-suite trial.
DEFAULT_KV_SEQUENCES = 64
DEFAULT_KV_SEQ_TOKENS = 512
_KV_STATS_VERSION = 1
_TENSORS = ("keys", "values")
_STATS = ("absmax", "min", "max", "percentile")  # per head; "layer_percentile" per layer


@dataclass(frozen=True)
class KVScales:
    """Calibrated K/V statistics of one model on one dataset, and the static scales they give.

    `stats[tensor][name]` is float32 [layers, kv_heads] for name in absmax/min/max/percentile
    and [layers] for layer_percentile. `use_percentile`: scales from the percentile of |x|
    (clipping the rest, counted by the pool) instead of max |x|.
    """

    model_id: str
    data_hash: str
    percentile: float
    tokens: int
    stats: dict
    from_cache: bool = False
    use_percentile: bool = False
    seconds: float = 0.0

    def amax(self, layer: int, tensor: str, axis: str) -> np.ndarray:
        """The statistic a symmetric scale divides: (1,) for "tensor", [kv_heads] for "head"."""
        s = self.stats[tensor]
        if axis == "tensor":
            if self.use_percentile:
                value = s["layer_percentile"][layer]
            else:
                value = s["absmax"][layer].max()
            return np.asarray([value], np.float32)
        return np.asarray((s["percentile"] if self.use_percentile else s["absmax"])[layer])

    def for_tensor(self, layer: int, tensor: str, spec) -> tuple[np.ndarray, np.ndarray | None]:
        """(scale, zero point or None) of `tensor` ("keys"/"values") of `layer` under `spec`
        (a static `KVTensorSpec`): shape (1,) for axis "tensor", [kv_heads] for "head"."""
        from tenantq.numerics import compute_scale_zero_point, get_format

        n_layers, heads = self.stats[tensor]["absmax"].shape
        if not 0 <= layer < n_layers:
            raise ValueError(f"KV scales cover layers 0..{n_layers - 1}, not layer {layer}")
        if spec.axis not in ("tensor", "head"):
            raise ValueError(f"static KV scales apply to axes tensor/head, not {spec.axis!r}")
        fmt = get_format(spec.format)
        if fmt.asymmetric_only:  # int2: the calibrated [min, max] onto codes 0..3
            lo, hi = self.stats[tensor]["min"][layer], self.stats[tensor]["max"][layer]
            if spec.axis == "tensor":
                lo, hi = np.asarray([lo.min()]), np.asarray([hi.max()])
            dummy = np.zeros((len(lo), 1), np.float32)
            scale, zp = compute_scale_zero_point(
                dummy, fmt, axis=-1, amax=hi[:, None], amin=lo[:, None]
            )
            return np.asarray(scale)[:, 0], np.asarray(zp)[:, 0]
        amax = self.amax(layer, tensor, spec.axis)
        dummy = np.zeros((len(amax), 1), np.float32)
        scale, _ = compute_scale_zero_point(dummy, fmt, axis=-1, amax=amax[:, None])
        return np.asarray(scale)[:, 0], None

    def fingerprint(self) -> str:
        """Hash of the statistics and the choice of statistic (what changes the scales)."""
        h = hashlib.sha256(f"{self.use_percentile}:{self.percentile}".encode())
        for tensor in _TENSORS:
            for name in (*_STATS, "layer_percentile"):
                h.update(np.ascontiguousarray(self.stats[tensor][name], np.float32).tobytes())
        return h.hexdigest()[:16]


def _kv_step(graphdef, state, tokens, positions, rank: int, layer_rank: int):
    """One batch through the model; per layer and tensor: per-head absmax/min/max/top-rank
    |x| and the layer's top-rank |x| (order statistics, averaged over batches later)."""
    from flax import nnx

    model = nnx.merge(graphdef, state)
    kv = _PrefillKV(positions)
    model(tokens, positions, kv)
    out = []
    for layer in range(len(kv.kv)):
        per_tensor = []
        for x in kv.kv[layer]:  # [B, S, H, d], as the cache receives it
            x = x.astype(jnp.float32)
            heads = jnp.moveaxis(x, 2, 0).reshape(x.shape[2], -1)  # [H, B*S*d]
            mag = jnp.abs(heads)
            top = jax.lax.top_k(mag, rank)[0][:, -1]
            layer_top = jax.lax.top_k(mag.reshape(-1), layer_rank)[0][-1]
            per_tensor.append(
                (mag.max(axis=1), heads.min(axis=1), heads.max(axis=1), top, layer_top)
            )
        out.append(per_tensor)
    return out


_kv_step_jit = jax.jit(_kv_step, static_argnums=(0, 4, 5))


def compute_kv_statistics(
    config: ModelConfig, params: dict, windows: np.ndarray, *, percentile: float
) -> tuple[dict, int]:
    """({tensor: {stat: array}}, tokens) of `windows` [sequences, tokens] through the bf16
    model (params cast to bf16, as a server computes what it caches)."""
    from flax import nnx

    from tenantq.model.decoder import Decoder

    windows = check_windows(windows, config)
    cast = {
        p: jnp.asarray(v, jnp.bfloat16) if hasattr(v, "astype") else v for p, v in params.items()
    }
    graphdef, state = nnx.split(Decoder(config, cast, dtype=jnp.bfloat16))
    n, t = windows.shape
    layers, heads = config.num_layers, config.num_kv_heads
    acc = {
        tensor: {
            "absmax": np.zeros((layers, heads), np.float32),
            "min": np.full((layers, heads), np.inf, np.float32),
            "max": np.full((layers, heads), -np.inf, np.float32),
            "percentile": np.zeros((layers, heads), np.float64),
            "layer_percentile": np.zeros(layers, np.float64),
        }
        for tensor in _TENSORS
    }
    batches = 0
    for i in range(0, n, BATCH_SEQUENCES):
        batch = windows[i : i + BATCH_SEQUENCES]
        per_head = batch.shape[0] * t * config.head_dim
        rank = _rank_of(percentile, per_head)
        layer_rank = _rank_of(percentile, per_head * heads)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), batch.shape)
        parts = _kv_step_jit(graphdef, state, jnp.asarray(batch), positions, rank, layer_rank)
        for layer, per_tensor in enumerate(parts):
            for tensor, (amax, lo, hi, top, layer_top) in zip(_TENSORS, per_tensor, strict=True):
                a = acc[tensor]
                a["absmax"][layer] = np.maximum(a["absmax"][layer], np.asarray(amax))
                a["min"][layer] = np.minimum(a["min"][layer], np.asarray(lo))
                a["max"][layer] = np.maximum(a["max"][layer], np.asarray(hi))
                a["percentile"][layer] += np.asarray(top, np.float64)
                a["layer_percentile"][layer] += float(layer_top)
        batches += 1
    for a in acc.values():
        for name in ("percentile", "layer_percentile"):
            a[name] = (a[name] / batches).astype(np.float32)
    return acc, n * t


def _write(path: Path, stats: dict, meta: dict) -> None:
    columns = {}
    for tensor in _TENSORS:
        for name, value in stats[tensor].items():
            columns[f"{tensor}.{name}"] = [np.asarray(value, np.float32).ravel().tolist()]
    table = pa.table(columns).replace_schema_metadata({b"tenantq.kv": json.dumps(meta).encode()})
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def _read(path: Path, layers: int, heads: int) -> tuple[dict, dict]:
    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[b"tenantq.kv"])
    row = table.to_pylist()[0]
    stats = {}
    for tensor in _TENSORS:
        stats[tensor] = {
            name: np.asarray(row[f"{tensor}.{name}"], np.float32).reshape(
                (layers,) if name == "layer_percentile" else (layers, heads)
            )
            for name in (*_STATS, "layer_percentile")
        }
    return stats, meta


def kv_static_scales(
    model_path: str | Path,
    windows: np.ndarray,
    *,
    model_id: str,
    data_hash: str,
    cache_dir: str | Path | None = None,
    percentile: float = DEFAULT_KV_PERCENTILE,
    use_percentile: bool = False,
    params: dict | None = None,
    agree: Callable[[bool], bool] = bool,
) -> KVScales:
    """K/V statistics of the checkpoint at `model_path` on `windows`, from the cache when
    present (`from_cache`), as `KVScales` for `Engine(..., kv_scales=...)`.

    `model_id`/`data_hash` name what is measured (`tenantq.evals.identity.model_identity`,
    `tenantq.evals.data.array_hash`; computed by the caller since quant sits above evals),
    as for `quant.input_stats.collect_statistics`, whose cache folder this shares; `agree`
    as there (the hosts of a slice read the cache only if every host found it).
    """
    from tenantq.model.loader import load_params

    model_path = Path(model_path)
    config = ModelConfig.from_file(model_path)
    key = cache_key(
        version=_KV_STATS_VERSION, model=model_id, data=data_hash, percentile=percentile
    )
    folder = Path(cache_dir or default_cache_dir())
    path = folder / f"kv-v{_KV_STATS_VERSION}-{key}.parquet"
    shape = (config.num_layers, config.num_kv_heads)
    if agree(path.is_file()):
        stats, meta = _read(path, *shape)
        return KVScales(
            model_id, data_hash, percentile, meta["tokens"], stats, True, use_percentile,
            meta["seconds"],
        )  # fmt: skip
    began = time.perf_counter()
    if params is None:
        params = load_params(model_path, config, dtype=jnp.bfloat16)
    stats, tokens = compute_kv_statistics(config, params, windows, percentile=percentile)
    seconds = time.perf_counter() - began
    folder.mkdir(parents=True, exist_ok=True)
    meta = {
        "model_id": model_id, "dataset_hash": data_hash, "percentile": percentile,
        "tokens": tokens, "seconds": seconds, "windows": list(np.shape(windows)),
    }  # fmt: skip
    _write(path, stats, meta)
    return KVScales(model_id, data_hash, percentile, tokens, stats, False, use_percentile, seconds)
