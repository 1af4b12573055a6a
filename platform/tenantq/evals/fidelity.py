"""Fidelity: per-token KL(baseline || candidate), top-1 agreement and perplexities, on device.

Logits never leave the device: the candidate's `[B, S, V]` logits meet the cached baseline
inside jit and only per-token numbers come back. Up to `exact_vocab_limit` (32K) the baseline
keeps its full log-distribution (bounded by that limit times the suite's tokens) and KL is
exact. Above it the baseline keeps its top-k log-probs plus the log-mass of the rest, and KL
is taken over the k tokens and one tail bin: sum_i p_i log(p_i/q_i) + p_tail log(p_tail/q_tail).
Merging outcomes never increases KL (the log-sum inequality), so this is a lower bound on
the exact KL; `python -m tenantq.bench evals` measures the gap on the reference model.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def device_logits(engine, rows: list[list[int]]):
    """Yield `(start, logits [b, s, V], log p(next token) [b, s])` as device arrays.

    The rows go through the engine's own prefill step (the paged pool in the plan's KV
    formats), chunked by the pool's sequence limit and padded to the engine's buckets. It
    reads the engine's chunking and prefill helpers because `Engine.logits` copies [B, S, V]
    to the host, which fidelity must avoid for large vocabularies.
    """
    for start, chunk in engine._chunks(rows):
        targets = [r[1:] for r in chunk]
        logits, target_logp = engine._prefill_chunk(chunk, "all", reserve=0, targets=targets)
        yield start, logits, target_logp


@dataclass
class FidelityBaseline:
    """The bf16 model's per-token outputs on the fidelity windows ([rows, positions, ...])."""

    tokens: np.ndarray  # [n, P] int32: the predicted (next) tokens
    target_logp: np.ndarray  # [n, P] float32
    top1: np.ndarray  # [n, P] int32
    margin: np.ndarray  # [n, P] float32: top-1 minus top-2 log-prob
    logp: jax.Array | None = None  # [n, P, V] exact mode (on device)
    topk_ids: jax.Array | None = None  # [n, P, k] top-k mode
    topk_logp: jax.Array | None = None  # [n, P, k]
    tail_logp: jax.Array | None = None  # [n, P]: log of the mass outside the top k

    @property
    def exact(self) -> bool:
        return self.logp is not None


@jax.jit
def _summarize(logits):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top2 = jax.lax.top_k(logp, 2)[0]
    return logp, jnp.argmax(logp, -1).astype(jnp.int32), top2[..., 0] - top2[..., 1]


@partial(jax.jit, static_argnums=1)
def _top_k_tail(logp, k):
    topk_logp, topk_ids = jax.lax.top_k(logp, k)
    return topk_ids.astype(jnp.int32), topk_logp, _logsumexp_outside(logp, topk_ids)


def _logsumexp_outside(logp, ids):
    """log of the probability mass of `logp` [b, s, V] outside `ids` [b, s, k]."""
    b, s = ids.shape[:2]
    bi = jnp.arange(b)[:, None, None]
    si = jnp.arange(s)[None, :, None]
    return jax.nn.logsumexp(logp.at[bi, si, ids].set(-jnp.inf), axis=-1)


@jax.jit
def _compare_exact(base_logp, base_top1, logits):
    logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    p = jnp.exp(base_logp)
    kl = jnp.sum(jnp.where(p > 0, p * (base_logp - logq), 0.0), axis=-1)
    return kl, jnp.argmax(logq, -1) == base_top1


@jax.jit
def _compare_topk(topk_ids, topk_logp, tail_logp, base_top1, logits):
    logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    q_k = jnp.take_along_axis(logq, topk_ids, axis=-1)
    q_tail = _logsumexp_outside(logq, topk_ids)
    p_k, p_tail = jnp.exp(topk_logp), jnp.exp(tail_logp)
    kl = jnp.sum(p_k * (topk_logp - q_k), -1)
    kl = kl + jnp.where(p_tail > 0, p_tail * (tail_logp - q_tail), 0.0)
    return kl, jnp.argmax(logq, -1) == base_top1


def compute_baseline(engine, rows: np.ndarray, *, exact: bool, top_k: int) -> FidelityBaseline:
    """Run the (bf16) engine over `rows` [n, L] (BOS first) and keep what comparison needs."""
    n, length = rows.shape
    positions = length - 1
    logps, topk = [], ([], [], [])
    top1 = np.zeros((n, positions), np.int32)
    margin = np.zeros((n, positions), np.float32)
    target_logp = np.zeros((n, positions), np.float32)
    for start, logits, tlogp in device_logits(engine, rows.tolist()):
        m = min(len(rows) - start, logits.shape[0])
        logp, t1, mg = _summarize(logits[:m, :positions])
        top1[start : start + m] = np.asarray(t1)
        margin[start : start + m] = np.asarray(mg)
        target_logp[start : start + m] = np.asarray(tlogp[:m, :positions])
        if exact:
            logps.append(logp)
        else:
            for acc, part in zip(topk, _top_k_tail(logp, top_k), strict=True):
                acc.append(part)
    base = FidelityBaseline(rows[:, 1:].astype(np.int32), target_logp, top1, margin)
    if exact:
        base.logp = jnp.concatenate(logps)
    else:
        base.topk_ids, base.topk_logp, base.tail_logp = (jnp.concatenate(a) for a in topk)
    return base


def compare(engine, rows: np.ndarray, base: FidelityBaseline) -> dict[str, np.ndarray]:
    """Per-token KL, top-1 agreement and the candidate's log p(next token), [n, P] each."""
    n, length = rows.shape
    positions = length - 1
    kl = np.zeros((n, positions), np.float32)
    agree = np.zeros((n, positions), bool)
    cand_logp = np.zeros((n, positions), np.float32)
    for start, logits, tlogp in device_logits(engine, rows.tolist()):
        m = min(len(rows) - start, logits.shape[0])
        sl = slice(start, start + m)
        lg = logits[:m, :positions]
        top1 = jnp.asarray(base.top1[sl])
        if base.exact:
            k, a = _compare_exact(base.logp[sl], top1, lg)
        else:
            k, a = _compare_topk(
                base.topk_ids[sl], base.topk_logp[sl], base.tail_logp[sl], top1, lg
            )
        kl[sl], agree[sl] = np.asarray(k), np.asarray(a)
        cand_logp[sl] = np.asarray(tlogp[:m, :positions])
    return {"kl": kl, "top1_agree": agree, "target_logp": cand_logp}


def topk_from_exact(base: FidelityBaseline, k: int) -> FidelityBaseline:
    """The top-k + tail form of an exact baseline (to measure the approximation's error)."""
    if not base.exact:
        raise ValueError("topk_from_exact needs an exact baseline")
    ids, logp_k, tail = _top_k_tail(base.logp, k)
    return FidelityBaseline(
        base.tokens, base.target_logp, base.top1, base.margin,
        topk_ids=ids, topk_logp=logp_k, tail_logp=tail,
    )  # fmt: skip


# ---------------------------------------------------------------- the baseline on disk
def save_baseline(base: FidelityBaseline, path: Path) -> None:
    """One Parquet row per predicted token; written to a temp name, then renamed."""
    n, positions = base.tokens.shape
    cols = {
        "row": pa.array(np.repeat(np.arange(n, dtype=np.int32), positions)),
        "pos": pa.array(np.tile(np.arange(positions, dtype=np.int32), n)),
        "token": pa.array(base.tokens.ravel()),
        "target_logp": pa.array(base.target_logp.ravel()),
        "top1": pa.array(base.top1.ravel()),
        "margin": pa.array(base.margin.ravel()),
    }

    def fixed(values: np.ndarray) -> pa.Array:
        width = values.shape[-1]
        return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), width)

    if base.exact:
        cols["logp"] = fixed(np.asarray(base.logp))
    else:
        cols["topk_ids"] = fixed(np.asarray(base.topk_ids))
        cols["topk_logp"] = fixed(np.asarray(base.topk_logp))
        cols["tail_logp"] = pa.array(np.asarray(base.tail_logp).ravel())
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(pa.table(cols), tmp, compression="zstd")
    tmp.replace(path)


def load_baseline(path: Path, rows: np.ndarray) -> FidelityBaseline:
    """Read a baseline written by `save_baseline` for these `rows`; ValueError if it differs."""
    table = pq.read_table(path)
    n, positions = rows.shape[0], rows.shape[1] - 1
    if table.num_rows != n * positions:
        raise ValueError(
            f"baseline cache {path} holds {table.num_rows} tokens, need {n * positions}"
        )

    def col(name: str) -> np.ndarray:
        return table.column(name).to_numpy().reshape(n, positions)

    def fixed(name: str) -> np.ndarray:
        flat = table.column(name).combine_chunks().flatten().to_numpy()
        return flat.reshape(n, positions, -1)

    base = FidelityBaseline(col("token"), col("target_logp"), col("top1"), col("margin"))
    if not np.array_equal(base.tokens, rows[:, 1:]):
        raise ValueError(f"baseline cache {path} was computed on other tokens")
    if "logp" in table.column_names:
        base.logp = jnp.asarray(fixed("logp"))
    else:
        base.topk_ids = jnp.asarray(fixed("topk_ids"))
        base.topk_logp = jnp.asarray(fixed("topk_logp"))
        base.tail_logp = jnp.asarray(col("tail_logp"))
    return base
