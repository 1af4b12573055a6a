"""Calibration statistics: what each linear layer's input looks like on real text.

Token windows (the caller's; by default the reference model's train split, drawn by
`tenantq.evals.windows.calibration_windows`) run through the bf16 model one decoder
layer at a time, so peak memory is the model plus one layer's activations. For every
linear input (an *input site*: q/k/v share one, gate/up share one) we keep the per-channel
absmax, a high percentile, the mean |x| and the Gram matrix XᵀX that GPTQ's Hessian and
every output-error figure are built from; saved as Parquet keyed by (model identity,
dataset hash) and read back on the next run."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tenantq.model.config import ModelConfig
from tenantq.model.files import CACHE_DIR, atomic_path, atomic_write_text, cache_key

DEFAULT_PERCENTILE = 99.9
BATCH_SEQUENCES = 8  # windows per forward call while collecting
_STATS_VERSION = 1  # bump when the statistics' definition changes (invalidates caches)


# --- statistics ---------------------------------------------------------------------------


@dataclass(frozen=True)
class InputStats:
    """Statistics of one linear input X [tokens, in], shared by the linears that read it.

    absmax, percentile, mean_abs: float32 [in], per input channel. The percentile p is the
    k-th largest |x| of a batch's n tokens, k = ceil(n (1 - p/100)) (an order statistic:
    top-k is ~100x faster than a sort on XLA:CPU), averaged over batches. gram: float64
    [in, in], XᵀX summed over `tokens` tokens.
    """

    site: str
    paths: tuple[str, ...]
    tokens: int
    absmax: np.ndarray
    percentile: np.ndarray
    mean_abs: np.ndarray
    gram: np.ndarray

    @property
    def hessian(self) -> np.ndarray:
        """GPTQ's H = 2 XᵀX / tokens (Frantar et al. 2022, eq. 1), float64."""
        return 2.0 * self.gram / self.tokens


@dataclass
class CalibrationStats:
    """Every input site of a model under one dataset; `for_path(linear_path)`."""

    model_id: str
    dataset_hash: str
    sites: dict[str, InputStats]
    from_cache: bool = False
    seconds_per_layer: list[float] = field(default_factory=list)

    def for_path(self, path: str) -> InputStats:
        for stats in self.sites.values():
            if path in stats.paths:
                return stats
        raise KeyError(f"no calibration statistics for {path}; sites: {sorted(self.sites)}")


def input_sites(config: ModelConfig, layer: int) -> dict[str, tuple[str, ...]]:
    """Site name -> the linears of `layer` that read that input."""
    p = f"layers/{layer}"
    return {
        f"{p}/attn/in": (f"{p}/attn/q_proj", f"{p}/attn/k_proj", f"{p}/attn/v_proj"),
        f"{p}/attn/o_in": (f"{p}/attn/o_proj",),
        f"{p}/mlp/in": (f"{p}/mlp/gate_proj", f"{p}/mlp/up_proj"),
        f"{p}/mlp/down_in": (f"{p}/mlp/down_proj",),
    }


def head_site(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    return {"head/in": ("embed",) if config.tie_word_embeddings else ("lm_head",)}


class _PrefillKV:
    """KVAccess for a full-window prefill: attention reads back exactly what was written."""

    def __init__(self, positions: jax.Array):
        self.positions = positions
        self.kv: dict[int, tuple[jax.Array, jax.Array]] = {}

    def write(self, layer: int, keys: jax.Array, values: jax.Array) -> None:
        self.kv[layer] = (keys, values)

    def read(self, layer: int):
        keys, values = self.kv[layer]
        return keys, values, self.positions


def _rank_of(percentile: float, tokens: int) -> int:
    """k such that the k-th largest of `tokens` values is the `percentile`-th percentile."""
    return max(1, math.ceil(round(tokens * (100.0 - percentile) / 100.0, 6)))


def _partials(x: jax.Array, percentile: float) -> tuple[jax.Array, ...]:
    """One batch's contribution: absmax, percentile, sum |x|, XᵀX."""
    flat = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    mag = jnp.abs(flat)
    top = jax.lax.top_k(mag.T, _rank_of(percentile, flat.shape[0]))[0]
    gram = jax.lax.dot_general(
        flat, flat, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32,
        precision=jax.lax.Precision.HIGHEST,
    )  # fmt: skip
    return (
        top[:, 0],
        top[:, -1],
        jnp.sum(mag, axis=0),
        gram,
    )


class _Tap:
    """Stands in for a Linear inside a traced layer call and records its input."""

    def __init__(self, inner, sink: dict, name: str):
        self.inner, self.sink, self.name = inner, sink, name

    def __call__(self, x):
        self.sink[self.name] = x
        return self.inner(x)


def _layer_step(graphdef, state, x, positions, percentile):
    """One decoder layer on a batch: its output and the partial statistics of its 4 sites."""
    from flax import nnx

    block = nnx.merge(graphdef, state)
    seen: dict[str, jax.Array] = {}
    object.__setattr__(block.attn, "o_proj", _Tap(block.attn.o_proj, seen, "o_in"))
    object.__setattr__(block.mlp, "down_proj", _Tap(block.mlp.down_proj, seen, "down_in"))
    h = block.input_norm(x)
    x = x + block.attn(h, positions, _PrefillKV(positions))
    h2 = block.post_attn_norm(x)
    x = x + block.mlp(h2)
    sites = (h, seen["o_in"], h2, seen["down_in"])
    return x, tuple(_partials(s, percentile) for s in sites)


def _layer_forward(graphdef, state, x, positions):
    """One decoder layer on a batch, output only (sequential calibration's propagation)."""
    from flax import nnx

    return nnx.merge(graphdef, state)(x, positions, _PrefillKV(positions))


_layer_step_jit = jax.jit(_layer_step, static_argnums=(0, 4))
_layer_forward_jit = jax.jit(_layer_forward, static_argnums=0)
_partials_jit = jax.jit(_partials, static_argnums=1)


class _Accumulator:
    def __init__(self):
        self.absmax = self.sum_abs = self.gram = None
        self.pct: list[np.ndarray] = []
        self.tokens = 0

    def add(self, parts, tokens: int) -> None:
        absmax, pct, sum_abs, gram = (np.asarray(p) for p in parts)
        if self.absmax is None:
            self.absmax, self.sum_abs = absmax, sum_abs.astype(np.float64)
            self.gram = gram.astype(np.float64)
        else:
            self.absmax = np.maximum(self.absmax, absmax)
            self.sum_abs += sum_abs
            self.gram += gram
        self.pct.append(pct)
        self.tokens += tokens

    def result(self, site: str, paths: tuple[str, ...]) -> InputStats:
        return InputStats(
            site, paths, self.tokens, self.absmax.astype(np.float32),
            np.mean(self.pct, axis=0).astype(np.float32),
            (self.sum_abs / self.tokens).astype(np.float32), self.gram,
        )  # fmt: skip


def check_windows(windows, config: ModelConfig) -> np.ndarray:
    """Calibration windows as int32 [sequences, tokens], every id in the vocabulary."""
    windows = np.asarray(windows, np.int32)
    if windows.ndim != 2 or windows.size == 0:
        raise ValueError(
            f"windows must be a non-empty int [sequences, tokens], got {windows.shape}"
        )
    if windows.max() >= config.vocab_size or windows.min() < 0:
        raise ValueError(
            f"token ids must lie in [0, {config.vocab_size}), got {windows.min()}..{windows.max()}"
        )
    return windows


def compute_statistics(
    config: ModelConfig,
    params: dict,
    windows: np.ndarray,
    *,
    percentile: float = DEFAULT_PERCENTILE,
    dtype=jnp.bfloat16,
    on_layer: Callable[[int, dict[str, InputStats], float], None] | None = None,
    replace_layer: Callable[[int, dict[str, InputStats]], Mapping[str, Any]] | None = None,
) -> tuple[dict[str, InputStats], list[float]]:
    """Run `windows` through the model layer by layer; statistics of every input site.

    `on_layer(layer, sites, seconds)` is called after each layer (the head is layer -1),
    so a caller can persist as it goes. Returns (sites, seconds per decoder layer).

    `replace_layer(layer, sites)` (sequential calibration): called once layer `layer`'s
    statistics are taken, it returns float params (path -> array) that replace that layer's
    tensors, e.g. its quantized weights dequantized; the next layer's inputs are then this
    layer's outputs *with those params*, so layer l's statistics come from the inputs the
    replaced layers < l produce (GPTQ, Frantar et al. 2022, section 4). Without it every
    layer sees the full-precision model's activations (one pass, cacheable).
    """
    from flax import nnx

    from tenantq.model.decoder import Block, Decoder

    windows = check_windows(windows, config)
    cast = {p: v if not hasattr(v, "astype") else jnp.asarray(v, dtype) for p, v in params.items()}
    model = Decoder(config, cast, dtype=dtype)
    n, t = windows.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (min(n, BATCH_SEQUENCES), t))
    hidden = [
        model.embed(jnp.asarray(windows[i : i + BATCH_SEQUENCES]))
        for i in range(0, n, BATCH_SEQUENCES)
    ]
    out: dict[str, InputStats] = {}
    seconds: list[float] = []
    # One compiled step per layer type: blocks differ in structure only by their index
    # (which _PrefillKV ignores) and their attention window (part of the layer type).
    graphdefs: dict[str, object] = {}
    for layer, block in enumerate(model.layers):
        start = time.perf_counter()
        graphdef, state = nnx.split(block)
        graphdef = graphdefs.setdefault(config.layer_types[layer], graphdef)
        accs = [_Accumulator() for _ in range(4)]
        for b, x in enumerate(hidden):
            pos = positions[: x.shape[0]]
            out_b, parts = _layer_step_jit(graphdef, state, x, pos, percentile)
            if replace_layer is None:
                hidden[b] = out_b
            for acc, part in zip(accs, parts, strict=True):
                acc.add(part, x.shape[0] * t)
        sites = {
            site: acc.result(site, paths)
            for (site, paths), acc in zip(input_sites(config, layer).items(), accs, strict=True)
        }
        if replace_layer is not None:
            new = {p: jnp.asarray(v, dtype) for p, v in replace_layer(layer, sites).items()}
            block = Block(config, layer, {**cast, **new}, dtype=model.dtype, activations={})
            _, new_state = nnx.split(block)
            for b, x in enumerate(hidden):
                hidden[b] = _layer_forward_jit(graphdef, new_state, x, positions[: x.shape[0]])
        jax.block_until_ready(hidden[-1])
        seconds.append(time.perf_counter() - start)
        out.update(sites)
        if on_layer is not None:
            on_layer(layer, sites, seconds[-1])
    start = time.perf_counter()
    acc = _Accumulator()
    for x in hidden:
        acc.add(_partials_jit(model.final_norm(x), percentile), x.shape[0] * t)
    ((site, paths),) = head_site(config).items()
    head = {site: acc.result(site, paths)}
    out.update(head)
    if on_layer is not None:
        on_layer(-1, head, time.perf_counter() - start)
    return out, seconds


# --- Parquet cache ------------------------------------------------------------------------

_SCHEMA = pa.schema(
    [
        ("site", pa.string()),
        ("paths", pa.list_(pa.string())),
        ("tokens", pa.int64()),
        ("in_features", pa.int64()),
        ("absmax", pa.list_(pa.float32())),
        ("percentile", pa.list_(pa.float32())),
        ("mean_abs", pa.list_(pa.float32())),
        ("gram", pa.binary()),  # float64 [in, in], row-major
    ]
)


def default_cache_dir() -> Path:
    """<CACHE_DIR>/calibration (`tenantq.model.files.CACHE_DIR`, the evals' cache folder)."""
    return CACHE_DIR / "calibration"


def _write_sites(path: Path, sites: dict[str, InputStats]) -> None:
    rows = {name: [] for name in _SCHEMA.names}
    for s in sites.values():
        for name, value in (
            ("site", s.site), ("paths", list(s.paths)), ("tokens", s.tokens),
            ("in_features", s.absmax.shape[0]), ("absmax", s.absmax),
            ("percentile", s.percentile), ("mean_abs", s.mean_abs),
            ("gram", np.ascontiguousarray(s.gram, np.float64).tobytes()),
        ):  # fmt: skip
            rows[name].append(value)
    with atomic_path(path) as tmp:
        pq.write_table(pa.table(rows, schema=_SCHEMA), tmp)


def _read_sites(path: Path) -> dict[str, InputStats]:
    out = {}
    for row in pq.read_table(path, schema=_SCHEMA).to_pylist():
        n = row["in_features"]
        out[row["site"]] = InputStats(
            row["site"], tuple(row["paths"]), row["tokens"],
            np.asarray(row["absmax"], np.float32), np.asarray(row["percentile"], np.float32),
            np.asarray(row["mean_abs"], np.float32),
            np.frombuffer(row["gram"], np.float64).reshape(n, n).copy(),
        )  # fmt: skip
    return out


def collect_statistics(
    model_path: str | Path,
    windows: np.ndarray,
    *,
    model_id: str,
    data_hash: str,
    cache_dir: str | Path | None = None,
    percentile: float = DEFAULT_PERCENTILE,
    params: dict | None = None,
    progress: Callable[[int, int, float], None] | None = None,
    agree: Callable[[bool], bool] = bool,
) -> CalibrationStats:
    """Statistics of the checkpoint at `model_path` on `windows`, from the cache if present.

    `model_id` and `data_hash` name what is measured (`tenantq.evals.identity.model_identity`
    of the folder, `tenantq.evals.data.array_hash` of the windows: one definition each,
    computed by the caller since quant sits above evals).

    The cache folder (`cache_dir`/key) holds one Parquet file per layer, written as each
    layer finishes, and `meta.json` written last: a run cut off midway is recomputed, never
    half-read. `params` (float, path -> array) skips loading when the caller holds them.
    `progress(layer, num_layers, seconds)` is called per layer. `agree(found)` says whether
    to read the cache found on disk: on a multi-host slice every host must make the same
    choice (`tenantq.engine.sharding.on_every_host`), or one host would read while another
    computes and waits in a collective the first never joins.
    """
    from tenantq.model.loader import load_params

    model_path = Path(model_path)
    config = ModelConfig.from_file(model_path)
    key = cache_key(version=_STATS_VERSION, model=model_id, data=data_hash, percentile=percentile)
    folder = Path(cache_dir or default_cache_dir()) / key
    meta_path = folder / "meta.json"
    if agree(meta_path.is_file()):
        meta = json.loads(meta_path.read_text())
        sites: dict[str, InputStats] = {}
        for name in meta["files"]:
            sites.update(_read_sites(folder / name))
        return CalibrationStats(model_id, data_hash, sites, True, meta["seconds_per_layer"])
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.parquet"):
        stale.unlink()
    files: list[str] = []

    def persist(layer: int, sites: dict[str, InputStats], seconds: float) -> None:
        name = "head.parquet" if layer < 0 else f"layer_{layer:04d}.parquet"
        _write_sites(folder / name, sites)
        files.append(name)
        if progress is not None and layer >= 0:
            progress(layer, config.num_layers, seconds)

    if params is None:
        params = load_params(model_path, config, dtype=jnp.bfloat16)
    sites, seconds = compute_statistics(
        config, params, windows, percentile=percentile, on_layer=persist
    )
    meta = {
        "model_id": model_id, "dataset_hash": data_hash, "percentile": percentile,
        "windows": list(np.shape(windows)), "files": files, "seconds_per_layer": seconds,
        "version": _STATS_VERSION,
    }  # fmt: skip
    atomic_write_text(meta_path, json.dumps(meta, indent=2))
    return CalibrationStats(model_id, data_hash, sites, False, seconds)
