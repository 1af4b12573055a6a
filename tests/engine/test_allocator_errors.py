"""PageAllocator's edges: bad input named in one line, refusals that carry their figures.

Found by mutation testing (`make mutation TARGETS=allocator`): each test pins a behaviour a
mutant changed without any other test noticing (an error's message, a boundary, the
default tenant's bookkeeping, what an idle `ensure` returns).
"""

from __future__ import annotations

import pytest

from tenantq.engine.allocator import DEFAULT_TENANT, Grant, PageAllocator, PoolExhausted


@pytest.mark.parametrize(
    ("num_pages", "page_tokens", "message"),
    [(0, 16, "num_pages must be positive, got 0"), (4, 0, "page_tokens must be positive, got 0")],
)
def test_sizes_must_be_positive(num_pages: int, page_tokens: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PageAllocator(num_pages, page_tokens)


def test_the_smallest_pool_is_one_page_of_one_token() -> None:
    alloc = PageAllocator(num_pages=1, page_tokens=1)
    alloc.open(0)
    assert alloc.ensure(0, 1).new_pages == (0,)
    with pytest.raises(PoolExhausted):
        alloc.ensure(0, 2)


def test_bad_calls_name_what_is_wrong() -> None:
    alloc = PageAllocator(num_pages=4, page_tokens=4)
    alloc.add_tenant("a")
    assert alloc.tenant_usage()["a"] == (0, 0)  # no guarantee unless one is given
    with pytest.raises(ValueError, match="tenant 'a' already exists"):
        alloc.add_tenant("a", 1)
    with pytest.raises(ValueError, match="guaranteed_pages must be >= 0, got -1"):
        alloc.add_tenant("b", -1)
    for name in ("", None, 3):
        with pytest.raises(
            ValueError, match=f"a tenant name must be a non-empty string, got {name!r}"
        ):
            alloc.add_tenant(name, 1)
    for pages in (True, 1.5, "2"):
        with pytest.raises(ValueError, match="guaranteed_pages must be a whole number of pages"):
            alloc.add_tenant("c", pages)
    alloc.open(1, "a")
    with pytest.raises(ValueError, match="sequence 1 is already open"):
        alloc.open(1)
    with pytest.raises(ValueError, match=r"unknown tenant 'z'; known: \['a', 'default'\]"):
        alloc.open(2, "z")
    for call in (alloc.close, alloc.block_table, alloc.tenant_of):
        with pytest.raises(ValueError, match="sequence 7 is not open"):
            call(7)
    assert alloc.tenant_of(1) == "a"


def test_a_refusal_carries_its_figures() -> None:
    alloc = PageAllocator(num_pages=4, page_tokens=4)
    alloc.add_tenant("a", guaranteed_pages=1)
    alloc.open(1, "a")
    alloc.ensure(1, 12)  # 3 pages: 2 over a's guarantee
    alloc.open(2, "a")
    with pytest.raises(PoolExhausted) as refused:
        alloc.ensure(2, 8)  # 2 more pages, 1 free
    got = refused.value
    assert (got.tenant, got.pages_needed, got.pages_free, got.guaranteed_pages) == ("a", 2, 1, 1)


def test_ensure_within_the_pages_held_grants_nothing() -> None:
    alloc = PageAllocator(num_pages=4, page_tokens=4)
    alloc.open(1)
    alloc.ensure(1, 6)
    assert alloc.ensure(1, 8) == Grant((), ())  # 8 tokens still fit the 2 pages held


def test_the_default_tenant_can_be_a_borrower_that_is_preempted() -> None:
    alloc = PageAllocator(num_pages=4, page_tokens=4)
    alloc.add_tenant("g", guaranteed_pages=2)
    alloc.open(1, DEFAULT_TENANT)
    alloc.ensure(1, 16)  # the default tenant (no guarantee) borrows the whole pool
    alloc.open(2, "g")
    assert alloc.ensure(2, 8).preempted == (1,)
    assert alloc.tenant_usage() == {DEFAULT_TENANT: (0, 0), "g": (2, 2)}


def test_redeclaring_the_default_tenant_keeps_its_pages() -> None:
    alloc = PageAllocator(num_pages=4, page_tokens=4)
    alloc.open(1)
    alloc.ensure(1, 8)
    alloc.add_tenant(DEFAULT_TENANT, guaranteed_pages=1)
    assert alloc.tenant_usage()[DEFAULT_TENANT] == (2, 1)
    alloc.close(1)
    assert alloc.tenant_usage()[DEFAULT_TENANT] == (0, 1) and alloc.free_pages == 4
