"""Fidelity: per-token KL(baseline || candidate), top-1 agreement and perplexities, on device.

Logits never leave the device: the candidate's `[B, S, V]` logits (`Engine.device_logits`)
meet the cached baseline inside jit and only per-token numbers come back. Up to
`exact_vocab_limit` (32K) the baseline keeps its full log-distribution (bounded by that limit
times the suite's tokens) and KL is exact. Above it the baseline keeps its top-k log-probs,
the log-mass p_tail of the rest and m tokens sampled from the rest (with their log-probs);
KL = sum_topk p_i log(p_i/q_i) + p_tail * mean_j log(p_sj/q_sj), the tail sum estimated
without bias by sampling. Lumping the tail into one bin instead is a lower bound that missed
28-42% of the KL at k=64 on the reference model; `python -m tenantq.bench evals` measures both.
`kl_against_baseline` is the one measurement every caller makes: compare, average KL per
window (the pairing unit) and the paired bootstrap CI of its mean against the baseline's 0.
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

from tenantq.evals import stats
from tenantq.model.files import atomic_path


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
    tail_ids: jax.Array | None = None  # [n, P, m]: tokens sampled from the tail
    tail_sample_logp: jax.Array | None = None  # [n, P, m]: their baseline log-probs

    @property
    def exact(self) -> bool:
        return self.logp is not None


@jax.jit
def _summarize(logits):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top2 = jax.lax.top_k(logp, 2)[0]
    return logp, jnp.argmax(logp, -1).astype(jnp.int32), top2[..., 0] - top2[..., 1]


@partial(jax.jit, static_argnums=(1, 2))
def _top_k_tail(logp, k, samples, key):
    """Top-k ids and log-probs, the tail's log-mass, and `samples` tail draws per position.

    Draws are inverse-CDF samples (one cumulative sum over the vocabulary per position), so
    memory stays at one [b, s, V] array however many samples are drawn."""
    topk_logp, topk_ids = jax.lax.top_k(logp, k)
    outside = _mask_out(logp, topk_ids)
    tail = jax.nn.logsumexp(outside, axis=-1)
    cdf = jnp.cumsum(jnp.exp(outside - tail[..., None]), axis=-1)
    u = jax.random.uniform(key, (*logp.shape[:2], samples)) * cdf[..., -1:]
    find = jax.vmap(jax.vmap(partial(jnp.searchsorted, side="right")))
    draws = jnp.minimum(find(cdf, u), logp.shape[-1] - 1).astype(jnp.int32)
    return topk_ids.astype(jnp.int32), topk_logp, tail, draws, jnp.take_along_axis(logp, draws, -1)


def _mask_out(logp, ids):
    """`logp` [b, s, V] with the entries `ids` [b, s, k] set to -inf."""
    b, s = ids.shape[:2]
    bi = jnp.arange(b)[:, None, None]
    si = jnp.arange(s)[None, :, None]
    return logp.at[bi, si, ids].set(-jnp.inf)


@jax.jit
def _compare_exact(base_logp, base_top1, logits):
    logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    p = jnp.exp(base_logp)
    kl = jnp.sum(jnp.where(p > 0, p * (base_logp - logq), 0.0), axis=-1)
    return kl, jnp.argmax(logq, -1) == base_top1


@partial(jax.jit, static_argnames="lumped")
def _compare_topk(topk_ids, topk_logp, tail_logp, tail_ids, tail_sample_logp, base_top1, logits,
                  lumped=False):  # fmt: skip
    """Top-k KL plus the tail: sampled (unbiased) or, with `lumped`, one bin (a lower bound)."""
    logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    q_k = jnp.take_along_axis(logq, topk_ids, axis=-1)
    p_k, p_tail = jnp.exp(topk_logp), jnp.exp(tail_logp)
    kl = jnp.sum(p_k * (topk_logp - q_k), -1)
    if lumped:
        q_tail = jax.nn.logsumexp(_mask_out(logq, topk_ids), axis=-1)
        tail_kl = tail_logp - q_tail
    else:
        tail_kl = jnp.mean(tail_sample_logp - jnp.take_along_axis(logq, tail_ids, -1), -1)
    kl = kl + jnp.where(p_tail > 0, p_tail * tail_kl, 0.0)
    return kl, jnp.argmax(logq, -1) == base_top1


def compute_baseline(
    engine, rows: np.ndarray, *, exact: bool, top_k: int, tail_samples: int = 64, seed: int = 0,
    kv_tokens: int | None = None,
) -> FidelityBaseline:  # fmt: skip
    """Run the (bf16) engine over `rows` [n, L] (BOS first) and keep what comparison needs.
    `kv_tokens`: the KV window floor (`Engine.device_logits`); compare at the same one."""
    n, length = rows.shape
    positions = length - 1
    logps, topk = [], ([], [], [], [], [])
    top1 = np.zeros((n, positions), np.int32)
    margin = np.zeros((n, positions), np.float32)
    target_logp = np.zeros((n, positions), np.float32)
    for start, logits, tlogp in engine.device_logits(rows.tolist(), kv_tokens=kv_tokens):
        m = min(len(rows) - start, logits.shape[0])
        logp, t1, mg = _summarize(logits[:m, :positions])
        top1[start : start + m] = np.asarray(t1)
        margin[start : start + m] = np.asarray(mg)
        target_logp[start : start + m] = np.asarray(tlogp[:m, :positions])
        if exact:
            logps.append(logp)
        else:
            key = jax.random.fold_in(jax.random.PRNGKey(seed), start)
            for acc, part in zip(topk, _top_k_tail(logp, top_k, tail_samples, key), strict=True):
                acc.append(part)
    base = FidelityBaseline(rows[:, 1:].astype(np.int32), target_logp, top1, margin)
    if exact:
        base.logp = jnp.concatenate(logps)
    else:
        parts = [jnp.concatenate(a) for a in topk]
        base.topk_ids, base.topk_logp, base.tail_logp = parts[:3]
        base.tail_ids, base.tail_sample_logp = parts[3:]
    return base


def compare(
    engine, rows: np.ndarray, base: FidelityBaseline, *, lumped_tail: bool = False,
    kv_tokens: int | None = None,
) -> dict[str, np.ndarray]:  # fmt: skip
    """Per-token KL, top-1 agreement and the candidate's log p(next token), [n, P] each.

    `lumped_tail` (top-k baselines only): the one-bin lower bound instead of the sampled tail.
    `kv_tokens`: the KV window floor the baseline was computed at.
    """
    n, length = rows.shape
    positions = length - 1
    kl = np.zeros((n, positions), np.float32)
    agree = np.zeros((n, positions), bool)
    cand_logp = np.zeros((n, positions), np.float32)
    for start, logits, tlogp in engine.device_logits(rows.tolist(), kv_tokens=kv_tokens):
        m = min(len(rows) - start, logits.shape[0])
        sl = slice(start, start + m)
        lg = logits[:m, :positions]
        top1 = jnp.asarray(base.top1[sl])
        if base.exact:
            k, a = _compare_exact(base.logp[sl], top1, lg)
        else:
            k, a = _compare_topk(
                base.topk_ids[sl], base.topk_logp[sl], base.tail_logp[sl], base.tail_ids[sl],
                base.tail_sample_logp[sl], top1, lg, lumped=lumped_tail,
            )  # fmt: skip
        kl[sl], agree[sl] = np.asarray(k), np.asarray(a)
        cand_logp[sl] = np.asarray(tlogp[:m, :positions])
    return {"kl": kl, "top1_agree": agree, "target_logp": cand_logp}


@dataclass(frozen=True)
class KLMeasurement:
    """A candidate's KL against the bf16 baseline on one set of windows."""

    per_token: dict[str, np.ndarray]  # `compare`'s [n, P] arrays: kl, top1_agree, target_logp
    per_window: np.ndarray  # [n] mean KL of each window: the unit a paired contrast resamples
    ci: stats.PairedCI  # mean KL over windows against the baseline's 0, paired bootstrap

    @classmethod
    def of(cls, per_token: dict[str, np.ndarray], *, resamples: int, seed: int = 0):
        """The measurement of `compare`'s output: windows resampled, `resamples` draws from
        `seed`."""
        per_window = per_token["kl"].mean(axis=1)
        ci = stats.paired_bootstrap(
            np.zeros_like(per_window), per_window, resamples=resamples, seed=seed
        )
        return cls(per_token, per_window, ci)


def kl_against_baseline(
    engine, rows: np.ndarray, base: FidelityBaseline, *, resamples: int, seed: int = 0,
    kv_tokens: int | None = None,
) -> KLMeasurement:  # fmt: skip
    """`compare`, then the mean KL per window and its paired bootstrap CI (windows resampled,
    `resamples` draws from `seed`): the evaluator's, sensitivity's and the calibration bench's
    KL figure, computed here once."""
    per_token = compare(engine, rows, base, kv_tokens=kv_tokens)
    return KLMeasurement.of(per_token, resamples=resamples, seed=seed)


def topk_from_exact(
    base: FidelityBaseline, k: int, tail_samples: int = 64, seed: int = 0
) -> FidelityBaseline:
    """The top-k + tail form of an exact baseline (to measure the approximation's error)."""
    if not base.exact:
        raise ValueError("topk_from_exact needs an exact baseline")
    parts = _top_k_tail(base.logp, k, tail_samples, jax.random.PRNGKey(seed))
    return FidelityBaseline(base.tokens, base.target_logp, base.top1, base.margin, None, *parts)


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
        cols["tail_ids"] = fixed(np.asarray(base.tail_ids))
        cols["tail_sample_logp"] = fixed(np.asarray(base.tail_sample_logp))
    with atomic_path(path) as tmp:
        pq.write_table(pa.table(cols), tmp, compression="zstd")


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
        base.tail_ids = jnp.asarray(fixed("tail_ids"))
        base.tail_sample_logp = jnp.asarray(fixed("tail_sample_logp"))
    return base
