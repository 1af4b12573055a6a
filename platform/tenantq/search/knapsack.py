"""The capacity side of a search space as a multiple-choice knapsack, solved without enumeration.

Tenants = (pool - static KV scales) // tenant bytes, the pool = memory - weights - reserve,
weight bytes a sum over tensors (so over the space's weight parameters) and the KV side a
small set of distinct KV plans. For one KV plan, "at least t tenants" is a cap on weight
bytes, so "lowest predicted loss at >= t tenants" is a multiple-choice knapsack over the weight
groups, solved by dynamic programming over bytes. Bytes are counted in a unit `u`: the gcd of
the groups' byte differences when that keeps the table small (the DP is then exact), else the
differences are rounded *up* to `u` (every plan the DP returns really has at least the tenants
it is credited with; `Sizing.exact` says which). The figures come from the project's byte
functions (`capacity.budget`), never a second count; the sampler confirms its pick by `budget`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tenantq.storage.pool import pool_bytes_left

MAX_CELLS = 1 << 16  # DP table width: ~0.1-0.3 s per solve for 226 groups of 4 options


@dataclass(frozen=True)
class Option:
    """One choice of a group: the trial parameters it sets and the weight bytes it costs."""

    params: dict[str, Any]
    bytes: int


@dataclass(frozen=True)
class Section:
    """Weight groups that are additive given the section's own fixed parameters (a structured
    space's bf16 edge layers, for one): weight bytes = const_bytes + sum of chosen options."""

    params: dict[str, Any]
    const_bytes: int
    groups: tuple[tuple[Option, ...], ...]


@dataclass(frozen=True)
class KVOption:
    """One distinct KV plan: its parameters, static-scale bytes and bytes per tenant (per chip)."""

    params: dict[str, Any]
    static_bytes: int
    tenant_bytes: int


@dataclass(frozen=True)
class Problem:
    """The capacity side of a space: sections of weight groups, KV options, the chip's memory
    and reserve (per chip, the figures `capacity.budget` uses)."""

    sections: tuple[Section, ...]
    kv: tuple[KVOption, ...]
    hbm_bytes: int
    reserve_bytes: int
    sizing: dict[int, Sizing] = field(default_factory=dict, compare=False, repr=False)

    def tenants(self, weight_bytes: int, kv: KVOption) -> int:
        """`capacity.budget`'s tenant count for these weight bytes and KV plan."""
        pool = pool_bytes_left(self.hbm_bytes, weight_bytes, self.reserve_bytes)
        return max(0, pool - kv.static_bytes) // kv.tenant_bytes

    def weight_cap(self, tenants: int, kv: KVOption) -> int:
        """The most weight bytes with at least `tenants` tenants under `kv` (may be < 0)."""
        if tenants <= 0:
            return math.inf  # type: ignore[return-value]
        return self.hbm_bytes - self.reserve_bytes - kv.static_bytes - tenants * kv.tenant_bytes

    def size(self) -> int:
        """How many parameter sets the space has (an exact integer, however large)."""
        return len(self.kv) * sum(math.prod(len(g) for g in s.groups) for s in self.sections)


@dataclass(frozen=True)
class Sizing:
    """A section's byte unit: extra bytes of option o of group g = `ticks[g][o] * unit`
    (exact) or at most that (rounded up)."""

    base: int  # const bytes + every group's cheapest option
    unit: int
    ticks: tuple[np.ndarray, ...]
    cells: int  # table width - 1 (the largest tick sum)
    exact: bool


def sizing(section: Section, max_cells: int = MAX_CELLS) -> Sizing:
    mins = [min(o.bytes for o in g) for g in section.groups]
    extras = [
        np.array([o.bytes - m for o in g], dtype=np.int64)
        for g, m in zip(section.groups, mins, strict=True)
    ]
    span = int(sum(int(e.max()) for e in extras))
    g = 0
    for e in extras:
        for x in e.tolist():
            g = math.gcd(g, x)
    g = max(g, 1)
    exact = span // g <= max_cells
    unit = g if exact else -(-span // max_cells)
    ticks = tuple(-(-e // unit) for e in extras)
    return Sizing(
        base=section.const_bytes + sum(mins),
        unit=unit,
        ticks=ticks,
        cells=int(sum(int(t.max()) for t in ticks)),
        exact=exact,
    )


@dataclass(frozen=True)
class Solved:
    """A section's DP: best[w] is the least cost of a choice whose ticks sum to <= w."""

    section: int
    sizing: Sizing
    best: np.ndarray
    choice: tuple[np.ndarray, ...]  # per group, the option chosen at each width

    def bytes_at(self, w: int) -> int:
        """An upper bound on the weight bytes of the plan backtracked at width w (exact when
        the sizing is)."""
        return self.sizing.base + w * self.sizing.unit

    def options_at(self, w: int) -> list[int]:
        out = []
        for g in range(len(self.choice) - 1, -1, -1):
            o = int(self.choice[g][w])
            out.append(o)
            w -= int(self.sizing.ticks[g][o])
        return out[::-1]


def solve(problem: Problem, section: int, costs: Sequence[np.ndarray]) -> Solved:
    """The multiple-choice knapsack of one section: `costs[g][o]` the additive cost of option o
    of group g; returns the table of least costs per byte width and the choices behind it."""
    sec = problem.sections[section]
    sz = problem.sizing.get(section)
    if sz is None:
        sz = problem.sizing[section] = sizing(sec)
    n = sz.cells + 1
    best = np.zeros(n)
    choices = []
    for ticks, cost in zip(sz.ticks, costs, strict=True):
        new = np.full(n, np.inf)
        pick = np.zeros(n, dtype=np.int16)
        for o, (t, c) in enumerate(
            zip(ticks.tolist(), np.asarray(cost, float).tolist(), strict=True)
        ):
            cand = best[: n - t] + c
            better = cand < new[t:]
            np.copyto(new[t:], cand, where=better)
            np.copyto(pick[t:], o, where=better)
        best = new
        choices.append(pick)
    return Solved(section, sz, best, tuple(choices))


def levels(problem: Problem, solved: Solved, kv: KVOption) -> tuple[np.ndarray, np.ndarray]:
    """(tenants, widths): every tenant level t this section reaches under `kv` and the widest
    table cell whose plans surely hold t tenants (its least cost is the best at >= t)."""
    sz = solved.sizing
    top = problem.tenants(sz.base, kv)
    low = problem.tenants(solved.bytes_at(sz.cells), kv)
    ts = np.arange(low, top + 1, dtype=np.int64)
    room = problem.hbm_bytes - problem.reserve_bytes - kv.static_bytes - sz.base
    caps = room - ts * kv.tenant_bytes  # extra weight bytes that keep >= t tenants
    ws = np.where(ts <= low, sz.cells, np.minimum(sz.cells, np.maximum(caps, -1) // sz.unit))
    keep = ws >= 0
    return ts[keep], ws[keep]


def check_problem(problem: Problem) -> None:
    """Refuse a problem the DP cannot represent (no groups options, a zero tenant size)."""
    for s in problem.sections:
        for g in s.groups:
            if not g:
                raise ValueError("capacity_aware: a weight parameter with no choices")
    for k in problem.kv:
        if k.tenant_bytes <= 0:
            raise ValueError("capacity_aware: a KV plan with no bytes per tenant")
    if len(problem.sections) == 0 or len(problem.kv) == 0:
        raise ValueError("capacity_aware: the space has no plans")
