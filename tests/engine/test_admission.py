"""Admission to the paged pool: exhaustion is an explicit outcome, tenants get their share."""

from __future__ import annotations

import numpy as np
import pytest

from tenantq.engine import Engine, PoolExhausted, SequencePreempted
from tenantq.engine.pool import PagedPool


def _engine(config, params, **options) -> Engine:
    options = {"page_tokens": 4, "max_seq_tokens": 64, "max_seqs": 8, **options}
    return Engine(config, params, dtype="float32", **options)


def test_a_greedy_tenant_cannot_take_another_tenants_guarantee(config, params) -> None:
    eng = _engine(config, params, num_pages=8)
    eng.add_tenant("steady", guaranteed_pages=4)
    eng.add_tenant("greedy", guaranteed_pages=0)
    # greedy borrows the whole pool: four sequences of 7 tokens, 2 pages each
    greedy = [eng.prefill([[3] * 7], reserve_tokens=4, tenant="greedy")[0] for _ in range(4)]
    assert eng.cache.tenant_usage()["greedy"] == (8, 0) and eng.cache.free_pages == 0
    with pytest.raises(PoolExhausted, match="'greedy' needs 2 more.*refused") as refused:
        eng.prefill([[4] * 8], tenant="greedy")  # above its guarantee: refused, not truncated
    assert (refused.value.tenant, refused.value.pages_free) == ("greedy", 0)
    # steady asks for its 4 guaranteed pages: greedy's two newest sequences are preempted
    steady, _ = eng.prefill([[5] * 8, [6] * 8], reserve_tokens=4, tenant="steady")
    assert eng.cache.tenant_usage() == {"default": (0, 0), "steady": (4, 4), "greedy": (4, 0)}
    eng.decode(greedy[0], [7])  # the older borrowers keep running (token 8 fits page 2)
    with pytest.raises(SequencePreempted, match="was preempted"):
        eng.decode(greedy[3], [7])
    assert greedy[3].lengths.tolist() == [7]  # nothing was appended or truncated
    for batch in [*greedy, steady]:
        eng.release(batch)
    assert eng.cache.free_pages == 8


def test_exhaustion_is_refused_clearly_and_leaks_nothing(config, params) -> None:
    eng = _engine(config, params, num_pages=4)
    with pytest.raises(PoolExhausted, match="needs 5 more page.*4 free of 4.*nothing truncated"):
        eng.prefill([list(range(3, 23))])  # 20 tokens = 5 pages of 4
    assert eng.cache.free_pages == 4  # the refused prefill returned its slot and pages
    batch, _ = eng.prefill([list(range(3, 19))], reserve_tokens=4)  # 16 tokens: all 4 pages
    with pytest.raises(PoolExhausted, match="needs 1 more page"):
        eng.decode(batch, [5])  # token 17 needs a fifth page
    assert batch.lengths.tolist() == [16]
    eng.release(batch)
    assert eng.cache.free_pages == 4


def test_a_prompt_longer_than_the_context_is_an_error(config, params) -> None:
    eng = _engine(config, params)
    context = config.max_position_embeddings
    with pytest.raises(ValueError, match=f"exceeds the model's context of {context}"):
        eng.generate([[3] * (context - 2)], 4)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        PagedPool(config, max_seq_tokens=context + 1)


def test_generate_for_a_tenant_matches_the_default_and_returns_pages(config, params) -> None:
    eng = _engine(config, params, num_pages=16)
    eng.add_tenant("a", guaranteed_pages=6)
    prompts = [[5, 9, 3, 7, 11], [8, 1, 2]]
    assert eng.generate(prompts, 6, tenant="a") == eng.generate(prompts, 6)
    assert eng.cache.tenant_usage()["a"] == (0, 6) and eng.cache.free_pages == 16
    with pytest.raises(ValueError, match="unknown tenant"):
        eng.generate(prompts, 2, tenant="nobody")


def test_pool_bytes_buys_the_pages_that_fit(config, params) -> None:
    pool = PagedPool(config, page_tokens=4, max_seqs=2, pool_bytes=10_000)
    page_bytes = 2 * config.num_layers * 4 * config.num_kv_heads * config.head_dim * 2
    assert pool.num_pages == 10_000 // page_bytes
    assert pool.nbytes <= 10_000 < pool.nbytes + page_bytes
    assert np.asarray(pool.state[0]["keys"]["pages"]).shape == (pool.num_pages, 4, 2, 8)
