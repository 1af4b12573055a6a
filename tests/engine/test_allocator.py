"""Page allocation: block tables, exhaustion as an explicit outcome, fair sharing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tenantq.engine.allocator import PageAllocator, PoolExhausted


def test_block_tables_grow_by_pages_and_return_on_close() -> None:
    alloc = PageAllocator(num_pages=8, page_tokens=16)
    alloc.open(1)
    assert alloc.ensure(1, 1).new_pages == (0,)
    assert alloc.ensure(1, 16).new_pages == ()  # 16 tokens still fit one page
    assert alloc.ensure(1, 17).new_pages == (1,)
    assert alloc.block_table(1) == [0, 1]
    assert alloc.free_pages == 6
    assert alloc.close(1) == [0, 1]
    assert alloc.free_pages == 8


def test_exhaustion_refuses_and_changes_nothing() -> None:
    alloc = PageAllocator(num_pages=4, page_tokens=16)
    alloc.open(1)
    alloc.ensure(1, 48)  # 3 pages
    alloc.open(2)
    with pytest.raises(PoolExhausted, match="needs 2 more page.*1 free of 4.*nothing truncated"):
        alloc.ensure(2, 17)
    assert alloc.block_table(2) == [] and alloc.free_pages == 1


def test_greedy_tenant_cannot_starve_a_guaranteed_one() -> None:
    # Pool of 20 pages; "b" is guaranteed 8. "a" (no guarantee) borrows the whole pool with
    # many sequences; "b" then still gets all 8 of its pages, by preempting a's newest.
    alloc = PageAllocator(num_pages=20, page_tokens=16)
    alloc.add_tenant("a", guaranteed_pages=0)
    alloc.add_tenant("b", guaranteed_pages=8)
    for seq in range(10):
        alloc.open(seq, "a")
        alloc.ensure(seq, 32)  # 2 pages each: 20 pages in all
    assert alloc.free_pages == 0
    alloc.open(100, "b")
    grant = alloc.ensure(100, 8 * 16)
    assert len(grant.new_pages) == 8
    assert grant.preempted == (9, 8, 7, 6)  # newest first, 2 pages each
    assert all(not alloc.is_open(s) for s in grant.preempted)
    assert alloc.tenant_usage()["b"] == (8, 8)
    # Past its guarantee, b is refused like anyone else while the pool is full.
    with pytest.raises(PoolExhausted, match="guarantee of 8"):
        alloc.ensure(100, 9 * 16)


def test_guarantees_cannot_exceed_the_pool() -> None:
    alloc = PageAllocator(num_pages=10, page_tokens=16)
    alloc.add_tenant("a", 6)
    with pytest.raises(ValueError, match="already guaranteed"):
        alloc.add_tenant("b", 5)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 80), st.booleans()),
        min_size=1,
        max_size=40,
    )
)
def test_pages_are_conserved_and_guarantees_honoured(ops) -> None:
    # Invariants: no page is held twice or lost; a tenant asking within its guarantee is
    # never refused (guarantees sum to <= the pool, so borrowers can always be preempted).
    alloc = PageAllocator(num_pages=24, page_tokens=8)
    guarantees = {"a": 6, "b": 10, "c": 0}
    for name, g in guarantees.items():
        alloc.add_tenant(name, g)
    for next_id, (tenant, tokens, close_after) in enumerate(ops):
        alloc.open(next_id, tenant)
        used = alloc.tenant_usage()[tenant][0]
        within = used + alloc.pages_for(tokens) <= guarantees[tenant]
        try:
            alloc.ensure(next_id, tokens)
        except PoolExhausted:
            assert not within, "a request within the guarantee was refused"
        if close_after:
            alloc.close(next_id)
        held = [p for s in range(next_id + 1) if alloc.is_open(s) for p in alloc.block_table(s)]
        assert len(held) == len(set(held))
        assert len(held) + alloc.free_pages == alloc.num_pages
        assert sum(u for u, _ in alloc.tenant_usage().values()) == len(held)
