"""The documented preemption policy, and guarantees that fill the pool exactly.

`PageAllocator`'s policy: when a tenant within its guarantee needs pages and none are free,
the tenant furthest above its own guarantee loses its most recently admitted sequence
first, repeated until enough pages are free. These tests set up more than one borrower so
that "furthest over", "most recently admitted" and "largest sequence id" each pick a
different victim, and check the one the policy names.
"""

from __future__ import annotations

import pytest

from tenantq.engine.allocator import PageAllocator, PoolExhausted

P = 4  # tokens per page


def _grow(alloc: PageAllocator, seq: int, tenant: str, pages: int):
    alloc.open(seq, tenant)
    return alloc.ensure(seq, pages * P)


def test_the_tenant_furthest_over_its_guarantee_loses_its_newest_sequence() -> None:
    alloc = PageAllocator(num_pages=10, page_tokens=P)
    alloc.add_tenant("a", guaranteed_pages=2)
    alloc.add_tenant("b", guaranteed_pages=0)
    alloc.add_tenant("c", guaranteed_pages=8)  # 2 + 0 + 8 = the whole pool
    _grow(alloc, 9, "b", 2)  # b's oldest sequence has the largest id
    _grow(alloc, 1, "a", 3)  # a: 3 pages, 1 over its guarantee
    _grow(alloc, 3, "b", 3)  # b's newest: b holds 5 pages, 5 over its guarantee
    assert alloc.free_pages == 2
    grant = _grow(alloc, 4, "c", 5)  # within c's guarantee: 3 pages must be reclaimed
    # b is furthest over (5 > 1); its newest sequence (3, three pages) frees exactly enough.
    # Choosing the least-over borrower would take a's sequence 1; the oldest of b's, or
    # b's largest id, would take sequence 9 (two pages, not enough alone).
    assert grant.preempted == (3,)
    assert len(grant.new_pages) == 5 and alloc.free_pages == 0
    assert not alloc.is_open(3) and alloc.is_open(9) and alloc.is_open(1)
    assert alloc.tenant_usage() == {"default": (0, 0), "a": (3, 2), "b": (2, 0), "c": (5, 8)}


def test_the_furthest_borrower_is_chosen_again_after_each_preemption() -> None:
    # b starts 4 over and a 3 over; after b loses one 2-page sequence it is 2 over, so the
    # next page must come from a (now furthest over), not from b again.
    alloc = PageAllocator(num_pages=9, page_tokens=P)
    alloc.add_tenant("a", guaranteed_pages=1)
    alloc.add_tenant("b", guaranteed_pages=0)
    alloc.add_tenant("c", guaranteed_pages=4)
    _grow(alloc, 1, "a", 2)
    _grow(alloc, 2, "a", 2)  # a: 4 pages, 3 over
    _grow(alloc, 3, "b", 2)
    _grow(alloc, 4, "b", 2)  # b: 4 pages, 4 over
    assert alloc.free_pages == 1
    grant = _grow(alloc, 5, "c", 4)  # needs 3 more than the one free page
    assert grant.preempted == (4, 2)  # b's newest (b 4 over), then a's newest (a 3 over > 2)
    assert alloc.tenant_usage()["c"] == (4, 4) and alloc.free_pages == 1


def test_guarantees_that_sum_exactly_to_the_pool_are_accepted_and_honoured() -> None:
    alloc = PageAllocator(num_pages=6, page_tokens=P)
    alloc.add_tenant("a", guaranteed_pages=4)
    alloc.add_tenant("b", guaranteed_pages=2)  # 4 + 2 == 6: accepted
    with pytest.raises(ValueError, match="cannot guarantee 1 pages to 'c': 6 of 6"):
        alloc.add_tenant("c", guaranteed_pages=1)  # one page past the pool
    _grow(alloc, 1, "b", 6)  # b borrows a's whole share
    grant = _grow(alloc, 2, "a", 4)  # a still gets its 4 guaranteed pages
    assert grant.preempted == (1,) and len(grant.new_pages) == 4
    _grow(alloc, 3, "b", 2)  # and b its 2
    assert alloc.tenant_usage() == {"default": (0, 0), "a": (4, 4), "b": (2, 2)}
    with pytest.raises(PoolExhausted, match="'b' needs 1 more page"):
        alloc.ensure(3, 3 * P)  # above b's guarantee in a full pool: refused


def test_redeclaring_the_default_tenant_counts_only_the_others_guarantees() -> None:
    # "default" (the one tenant that may be declared again) holds 2 of 8 pages and a and b
    # the other 6; declaring it again with 2 is 6 + 2 = 8 <= 8: accepted, not 8 + 2.
    alloc = PageAllocator(num_pages=8, page_tokens=P)
    alloc.add_tenant("default", guaranteed_pages=2)
    alloc.add_tenant("a", guaranteed_pages=3)
    alloc.add_tenant("b", guaranteed_pages=3)
    alloc.add_tenant("default", guaranteed_pages=2)
    assert alloc.tenant_usage() == {"default": (0, 2), "a": (0, 3), "b": (0, 3)}
    with pytest.raises(ValueError, match="cannot guarantee 3 pages to 'default': 6 of 8"):
        alloc.add_tenant("default", guaranteed_pages=3)
