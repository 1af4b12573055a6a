"""Multi-token writes into the paged pool that start mid-page and cross page boundaries.

The engine's own prefill always writes from position 0, so a write that starts inside a
page (a chunked prefill, a speculative or multi-token decode step) is exercised here
directly through the pool's jit-side `CacheLayout` protocol (`write`/`read`). What is read
back is compared with an expectation built from numerics alone: a full key page is
`dequantize(quantize(page, axis=0))` (per-channel scales over the page's tokens), the
newest partial page is the residual window exactly, values are quantized per token. The
pool is a float32 engine's (unquantized KV kept in float32), so no bf16 rounding intervenes.
"""

from __future__ import annotations

import numpy as np
import pytest

from tenantq.engine.pool import PagedPool
from tenantq.numerics import dequantize, quantize
from tenantq.quant.plan import KVPlan, QuantPlan

PAGE_TOKENS = 4
KEYS, VALUES = "int8", "fp8_e4m3"


def _pool(config) -> PagedPool:
    kv = KVPlan(KEYS, "channel", VALUES, "token")
    return PagedPool(
        config, QuantPlan(kv=kv), dtype="float32", page_tokens=PAGE_TOKENS, max_seqs=2,
        max_seq_tokens=32,
    )  # fmt: skip


def _write_run(pool: PagedPool, seq: int, start: int, keys, values) -> None:
    """Write tokens start..start+len-1 of sequence `seq` into layer 0, as one step does.

    The one place this file reaches the pool's jit-side layout; adapt here if it moves.
    """
    s = keys.shape[1]
    pool.make_room([seq], [start + s])
    table = pool.table([seq])
    positions = (start + np.arange(s, dtype=np.int32))[None]
    valid = np.ones((1, s), bool)
    pool.state = pool.layout.write(pool.state, 0, table, positions, valid, keys, values)


def _read(pool: PagedPool, seq: int, tokens: int):
    keys, values, _ = pool.layout.read(pool.state, 0, pool.table([seq]), tokens)
    return np.asarray(keys[0, :tokens]), np.asarray(values[0, :tokens])


def _expected_keys(k: np.ndarray, tokens: int) -> np.ndarray:
    """Full pages per-channel int8 over their tokens; the partial last page as written."""
    out = []
    for first in range(0, tokens, PAGE_TOKENS):
        page = k[first : first + PAGE_TOKENS]
        full = first + PAGE_TOKENS <= tokens
        out.append(np.asarray(dequantize(quantize(page, KEYS, axis=0))) if full else page)
    return np.concatenate(out)[:tokens]


# (tokens already written, tokens written in one step): each run starts inside a page.
# A run of s tokens starting at offset o of a page touches ceil((o + s) / P) pages, at most
# (s + P - 2) // P + 1 when o = P - 1: (3, 6) reaches that maximum (pages 0, 1, 2 for s=6,
# P=4); (1, 10) ends exactly on a page boundary; (5, 2) stays inside page 1.
RUNS = [(3, 6), (1, 10), (5, 2), (3, 13)]


@pytest.mark.parametrize(("before", "run"), RUNS)
def test_a_run_starting_mid_page_keeps_every_token(config, before: int, run: int) -> None:
    rng = np.random.default_rng(before * 100 + run)
    h, d = config.num_kv_heads, config.head_dim
    tokens = before + run
    k = (rng.standard_normal((tokens, h, d)) * 3).astype(np.float32)
    v = rng.standard_normal((tokens, h, d)).astype(np.float32)
    pool = _pool(config)
    seq = pool.allocate(tokens)
    _write_run(pool, seq, 0, k[None, :before], v[None, :before])
    _write_run(pool, seq, before, k[None, before:], v[None, before:])
    got_k, got_v = _read(pool, seq, tokens)
    # Equal exactly: the same float32 inputs and the same codec give the same float32 values.
    np.testing.assert_array_equal(got_k, _expected_keys(k, tokens))
    want_v = np.asarray(dequantize(quantize(v, VALUES, axis=-1)))
    np.testing.assert_array_equal(got_v, want_v)
    # A dropped token reads back as zeros; every written token here is non-zero.
    assert (np.abs(got_k).sum(axis=(1, 2)) > 0).all()


def test_one_run_and_the_same_tokens_in_two_runs_store_the_same_pool(config) -> None:
    # Chunking a write (3 tokens, then 9 starting at offset 3) changes nothing stored.
    rng = np.random.default_rng(7)
    h, d = config.num_kv_heads, config.head_dim
    k = rng.standard_normal((1, 12, h, d)).astype(np.float32)
    v = rng.standard_normal((1, 12, h, d)).astype(np.float32)
    whole, split = _pool(config), _pool(config)
    a, b = whole.allocate(12), split.allocate(12)
    _write_run(whole, a, 0, k, v)
    _write_run(split, b, 0, k[:, :3], v[:, :3])
    _write_run(split, b, 3, k[:, 3:], v[:, 3:])
    for one, two in zip(_read(whole, a, 12), _read(split, b, 12), strict=True):
        np.testing.assert_array_equal(one, two)
