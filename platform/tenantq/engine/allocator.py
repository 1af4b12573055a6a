"""Page allocation for the paged KV pool: block tables, tenants, guaranteed quotas.

The pool is a fixed number of pages shared by every sequence. Each tenant may be given a
guaranteed number of pages; it can borrow free pages above that, and a borrower gives them
back when another tenant asks for pages inside its own guarantee (its newest sequence is
preempted). A tenant above its guarantee with no free page left is refused, never truncated.
This is pure bookkeeping (no arrays): the pool in `engine` turns block tables into pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tenantq.engine.cache import CacheFull

DEFAULT_TENANT = "default"


class PoolExhausted(CacheFull):
    """The pool cannot grant the pages a sequence needs; nothing was changed.

    `tenant`, `pages_needed`, `pages_free` and `guaranteed_pages` say why, for callers that
    retry later or report the refusal.
    """

    def __init__(
        self, message: str, *, tenant: str, pages_needed: int, pages_free: int,
        guaranteed_pages: int,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.tenant, self.pages_needed = tenant, pages_needed
        self.pages_free, self.guaranteed_pages = pages_free, guaranteed_pages


@dataclass
class _Tenant:
    name: str
    guaranteed_pages: int
    used_pages: int = 0


@dataclass
class _Sequence:
    seq_id: int
    tenant: str
    admitted_order: int
    pages: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Grant:
    """Result of growing a sequence: pages added, and sequences preempted to make room."""

    new_pages: tuple[int, ...]
    preempted: tuple[int, ...]


class PageAllocator:
    """Block tables over `num_pages` pages of `page_tokens` tokens each.

    Preemption policy (documented, deterministic): when a tenant within its guarantee needs
    pages and none are free, take them from the tenant furthest above its own guarantee,
    preempting that tenant's most recently admitted sequence first, until enough are free.
    A preempted sequence loses all its pages and its id is reported in `Grant.preempted`.
    """

    def __init__(self, num_pages: int, page_tokens: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        if page_tokens <= 0:
            raise ValueError(f"page_tokens must be positive, got {page_tokens}")
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        # Pop from the end: page 0 is handed out first, which keeps tests readable.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._tenants: dict[str, _Tenant] = {DEFAULT_TENANT: _Tenant(DEFAULT_TENANT, 0)}
        self._seqs: dict[int, _Sequence] = {}
        self._order = 0

    # ---------------------------------------------------------------- tenants
    def add_tenant(self, name: str, guaranteed_pages: int = 0) -> None:
        if name in self._tenants and name != DEFAULT_TENANT:
            raise ValueError(f"tenant {name!r} already exists")
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tenant name must be a non-empty string, got {name!r}")
        if isinstance(guaranteed_pages, bool) or not isinstance(guaranteed_pages, int):
            raise ValueError(
                f"guaranteed_pages must be a whole number of pages, got {guaranteed_pages!r}"
            )
        if guaranteed_pages < 0:
            raise ValueError(f"guaranteed_pages must be >= 0, got {guaranteed_pages}")
        promised = sum(t.guaranteed_pages for n, t in self._tenants.items() if n != name)
        if promised + guaranteed_pages > self.num_pages:
            raise ValueError(
                f"cannot guarantee {guaranteed_pages} pages to {name!r}: {promised} of "
                f"{self.num_pages} pages are already guaranteed to other tenants"
            )
        used = self._tenants[name].used_pages if name in self._tenants else 0
        self._tenants[name] = _Tenant(name, guaranteed_pages, used)

    def tenant_usage(self) -> dict[str, tuple[int, int]]:
        """tenant -> (pages used, pages guaranteed)."""
        return {n: (t.used_pages, t.guaranteed_pages) for n, t in self._tenants.items()}

    # ---------------------------------------------------------------- sequences
    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)

    def open(self, seq_id: int, tenant: str = DEFAULT_TENANT) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already open")
        if tenant not in self._tenants:
            raise ValueError(f"unknown tenant {tenant!r}; known: {sorted(self._tenants)}")
        self._order += 1
        self._seqs[seq_id] = _Sequence(seq_id, tenant, self._order)

    def is_open(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).pages)

    def tenant_of(self, seq_id: int) -> str:
        return self._seq(seq_id).tenant

    def ensure(self, seq_id: int, total_tokens: int) -> Grant:
        """Grow `seq_id`'s block table to hold `total_tokens`; all or nothing."""
        seq = self._seq(seq_id)
        need = self.pages_for(total_tokens) - len(seq.pages)
        if need <= 0:
            return Grant((), ())
        tenant = self._tenants[seq.tenant]
        preempted: list[int] = []
        if need > len(self._free):
            within_guarantee = tenant.used_pages + need <= tenant.guaranteed_pages
            if not within_guarantee:
                raise PoolExhausted(
                    f"tenant {tenant.name!r} needs {need} more page(s) for sequence {seq_id} "
                    f"({total_tokens} tokens) but the pool has {len(self._free)} free of "
                    f"{self.num_pages}; the tenant holds {tenant.used_pages} page(s) against a "
                    f"guarantee of {tenant.guaranteed_pages}: refused, nothing truncated",
                    tenant=tenant.name,
                    pages_needed=need,
                    pages_free=len(self._free),
                    guaranteed_pages=tenant.guaranteed_pages,
                )
            preempted = self._reclaim(need - len(self._free), exclude=seq.tenant)
        new = [self._free.pop() for _ in range(need)]
        seq.pages.extend(new)
        tenant.used_pages += need
        return Grant(tuple(new), tuple(preempted))

    def close(self, seq_id: int) -> list[int]:
        """Return all of a finished (or preempted) sequence's pages to the pool."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise ValueError(f"sequence {seq_id} is not open")
        self._tenants[seq.tenant].used_pages -= len(seq.pages)
        self._free.extend(reversed(seq.pages))
        return seq.pages

    # ---------------------------------------------------------------- internals
    def _seq(self, seq_id: int) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise ValueError(f"sequence {seq_id} is not open") from None

    def _reclaim(self, pages_needed: int, exclude: str) -> list[int]:
        """Preempt borrowers' newest sequences until `pages_needed` pages are free."""
        preempted: list[int] = []
        freed = 0
        while freed < pages_needed:
            borrowers = [
                t
                for t in self._tenants.values()
                if t.name != exclude and t.used_pages > t.guaranteed_pages
            ]
            if not borrowers:
                # Guarantees sum to at most num_pages, so a tenant within its guarantee always
                # finds a borrower while pages are short; reaching here is a bookkeeping bug.
                raise AssertionError("no borrower to reclaim from while a guarantee is unmet")
            victim_tenant = max(borrowers, key=lambda t: t.used_pages - t.guaranteed_pages)
            victim = max(
                (s for s in self._seqs.values() if s.tenant == victim_tenant.name and s.pages),
                key=lambda s: s.admitted_order,
            )
            freed += len(self.close(victim.seq_id))
            preempted.append(victim.seq_id)
        return preempted
