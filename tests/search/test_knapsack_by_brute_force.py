"""The weight knapsack (tenantq.search.knapsack) against exhaustive enumeration.

Small random problems (3-5 groups of 1-4 options, 1-3 KV plans, a reserve and static scales)
are enumerated plan by plan: tenants by the pool formula written out here (memory - weights
- reserve - static, floored by bytes per tenant, never negative), costs summed. The DP's
least cost at each tenant level must equal the brute-force minimum over plans with at least
that many tenants, and the plan it backtracks must hold them at that cost (exact sizing); with
rounded sizing every backtracked plan still holds its level and costs the least among plans
whose rounded ticks fit the cell. Every bound is exact integer arithmetic or a float equality
of the same sums.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from tenantq.search import knapsack

SEEDS = range(12)


def _tenants(hbm, reserve, weights, kv) -> int:
    """The pool formula, independently of knapsack/storage: bytes left after the weights, the
    reserve and the static scales, in whole tenants (0 when nothing is left)."""
    left = hbm - weights - reserve - kv.static_bytes
    return left // kv.tenant_bytes if left > 0 else 0


def _problem(seed: int, *, grain: int = 1000, sections: int = 1):
    """A random problem; option bytes are multiples of `grain` plus (when grain == 1) any
    offset, so the exact unit is the gcd of the byte differences."""
    rng = np.random.default_rng(seed)
    secs = []
    for s in range(sections):
        n_groups = int(rng.integers(3, 6))
        groups = []
        for g in range(n_groups):
            n_opts = int(rng.integers(1, 5))
            groups.append(
                tuple(
                    knapsack.Option({f"s{s}g{g}": o}, int(rng.integers(1, 30)) * grain + 7)
                    for o in range(n_opts)
                )
            )
        secs.append(
            knapsack.Section({"section": s}, int(rng.integers(0, 20)) * grain, tuple(groups))
        )
    n_kv = int(rng.integers(1, 4))
    kvs = tuple(
        knapsack.KVOption({"kv": k}, int(rng.integers(0, 3)) * 700, int(rng.integers(2, 9)) * 900)
        for k in range(n_kv)
    )
    total = max(s.const_bytes + sum(max(o.bytes for o in g) for g in s.groups) for s in secs)
    hbm = total + int(rng.integers(5, 40)) * 1000
    problem = knapsack.Problem(tuple(secs), kvs, hbm, int(rng.integers(0, 4)) * 1000)
    costs = [[np.round(rng.uniform(0, 1, len(g)), 3) for g in s.groups] for s in secs]
    return problem, costs


def _plans(section):
    """Every choice of a section: (options per group, weight bytes)."""
    for combo in itertools.product(*(range(len(g)) for g in section.groups)):
        yield (
            combo,
            section.const_bytes
            + sum(g[o].bytes for g, o in zip(section.groups, combo, strict=True)),
        )


@pytest.mark.parametrize("seed", SEEDS)
def test_least_cost_at_each_tenant_level_is_the_brute_force_minimum(seed):
    problem, costs = _problem(seed)
    sec = problem.sections[0]
    solved = knapsack.solve(problem, 0, costs[0])
    assert solved.sizing.exact and solved.section == 0
    plans = list(_plans(sec))
    for kv in problem.kv:
        ts, ws = knapsack.levels(problem, solved, kv)
        tenants = {combo: _tenants(problem.hbm_bytes, problem.reserve_bytes, b, kv)
                   for combo, b in plans}  # fmt: skip
        # every level from the heaviest plan's tenants to the lightest's, each once, ascending
        assert ts.tolist() == list(range(min(tenants.values()), max(tenants.values()) + 1))
        for t, w in zip(ts.tolist(), ws.tolist(), strict=True):
            brute = min(
                sum(costs[0][g][o] for g, o in enumerate(c)) for c, n in tenants.items() if n >= t
            )
            assert solved.best[w] == pytest.approx(brute, abs=1e-12), (t, w)
            opts = tuple(solved.options_at(w))
            assert tenants[opts] >= t
            assert sum(costs[0][g][o] for g, o in enumerate(opts)) == pytest.approx(
                brute, abs=1e-12
            )


@pytest.mark.parametrize("seed", SEEDS)
def test_every_table_cell_is_the_least_cost_of_the_plans_whose_ticks_fit(seed):
    # best[w] = min over plans with tick sum <= w (exact sizing: ticks = extra bytes / gcd)
    problem, costs = _problem(seed)
    sec = problem.sections[0]
    solved = knapsack.solve(problem, 0, costs[0])
    sz = solved.sizing
    assert len(solved.best) == sz.cells + 1 and len(solved.choice) == len(sec.groups)
    per_width = np.full(sz.cells + 1, np.inf)
    for combo, b in _plans(sec):
        ticks = sum(int(sz.ticks[g][o]) for g, o in enumerate(combo))
        assert b == sz.base + ticks * sz.unit  # exact: bytes are base + ticks x unit
        c = sum(costs[0][g][o] for g, o in enumerate(combo))
        per_width[ticks] = min(per_width[ticks], c)
    expected = np.minimum.accumulate(per_width)
    np.testing.assert_allclose(solved.best, expected, atol=1e-12)
    for w in range(sz.cells + 1):
        opts = solved.options_at(w)
        assert sum(int(sz.ticks[g][o]) for g, o in enumerate(opts)) <= w
        assert sum(costs[0][g][o] for g, o in enumerate(opts)) == pytest.approx(expected[w])
        assert solved.bytes_at(w) == sz.base + w * sz.unit


@pytest.mark.parametrize("seed", SEEDS)
def test_exact_sizing_is_the_gcd_of_the_byte_differences(seed):
    problem, _ = _problem(seed)
    sec = problem.sections[0]
    sz = knapsack.sizing(sec)
    mins = [min(o.bytes for o in g) for g in sec.groups]
    diffs = [o.bytes - m for g, m in zip(sec.groups, mins, strict=True) for o in g]
    gcd = math.gcd(*diffs) or 1
    assert sz.exact and sz.unit == gcd
    assert sz.base == sec.const_bytes + sum(mins)
    for g, m, t in zip(sec.groups, mins, sz.ticks, strict=True):
        assert t.tolist() == [(o.bytes - m) // gcd for o in g]
    assert sz.cells == sum(
        (max(o.bytes for o in g) - m) // gcd for g, m in zip(sec.groups, mins, strict=True)
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("max_cells", [8, 31])
def test_rounded_sizing_rounds_every_option_up_to_its_unit(seed, max_cells):
    # bytes with an odd offset per option: the gcd is 1, the span far over max_cells
    rng = np.random.default_rng(100 + seed)
    groups = tuple(
        tuple(knapsack.Option({f"g{g}": o}, int(rng.integers(1, 10**5))) for o in range(3))
        for g in range(4)
    )
    sec = knapsack.Section({}, 123, groups)
    sz = knapsack.sizing(sec, max_cells=max_cells)
    mins = [min(o.bytes for o in g) for g in groups]
    span = sum(max(o.bytes for o in g) - m for g, m in zip(groups, mins, strict=True))
    assert not sz.exact
    assert sz.unit == -(-span // max_cells)  # the least unit that fits the span in max_cells
    assert sz.base == 123 + sum(mins)
    for g, m, t in zip(groups, mins, sz.ticks, strict=True):
        extra = [o.bytes - m for o in g]
        # rounded up, by less than a unit
        assert all(x <= k * sz.unit < x + sz.unit for x, k in zip(extra, t.tolist(), strict=True))
    assert sz.cells == sum(int(t.max()) for t in sz.ticks) <= max_cells + len(groups)


@pytest.mark.parametrize("seed", SEEDS)
def test_rounded_levels_never_credit_a_plan_with_tenants_it_lacks(seed):
    rng = np.random.default_rng(200 + seed)
    groups = tuple(
        tuple(knapsack.Option({f"g{g}": o}, int(rng.integers(1, 10**5))) for o in range(3))
        for g in range(4)
    )
    kv = knapsack.KVOption({"kv": 0}, 1000, 9000)
    problem = knapsack.Problem((knapsack.Section({}, 0, groups),), (kv,), 500_000, 2000)
    preset = problem.sizing[0] = knapsack.sizing(problem.sections[0], max_cells=16)
    costs = [rng.uniform(0, 1, 3) for _ in groups]
    solved = knapsack.solve(problem, 0, costs)
    # the section's sizing set on the problem is the one solved with (not made anew)
    assert solved.sizing is preset and problem.sizing[0] is preset and not preset.exact
    ts, ws = knapsack.levels(problem, solved, kv)
    assert len(ts) > 0
    for t, w in zip(ts.tolist(), ws.tolist(), strict=True):
        opts = solved.options_at(w)
        real = sum(groups[g][o].bytes for g, o in enumerate(opts))
        assert real <= solved.bytes_at(w)
        assert _tenants(problem.hbm_bytes, problem.reserve_bytes, real, kv) >= t
        # the widest cell that surely holds t: one more would not (or it is the last)
        assert (
            w == solved.sizing.cells
            or _tenants(problem.hbm_bytes, problem.reserve_bytes, solved.bytes_at(w + 1), kv) < t
        )


@pytest.mark.parametrize("seed", SEEDS)
def test_a_second_section_is_solved_on_its_own_groups(seed):
    problem, costs = _problem(seed, sections=2)
    for si in (0, 1):
        solved = knapsack.solve(problem, si, costs[si])
        assert solved.section == si and problem.sizing[si] is solved.sizing
        kv = problem.kv[-1]
        best = {}
        for combo, b in _plans(problem.sections[si]):
            t = _tenants(problem.hbm_bytes, problem.reserve_bytes, b, kv)
            best[t] = min(best.get(t, math.inf), sum(costs[si][g][o] for g, o in enumerate(combo)))
        ts, ws = knapsack.levels(problem, solved, kv)
        for t, w in zip(ts.tolist(), ws.tolist(), strict=True):
            assert solved.best[w] == pytest.approx(min(c for n, c in best.items() if n >= t))


@pytest.mark.parametrize("seed", SEEDS)
def test_tenants_weight_cap_and_size_by_the_pool_formula(seed):
    problem, _ = _problem(seed, sections=2)
    for kv in problem.kv:
        for w in range(0, problem.hbm_bytes + 3000, 997):
            assert problem.tenants(w, kv) == _tenants(
                problem.hbm_bytes, problem.reserve_bytes, w, kv
            )
        for t in range(1, 12):
            cap = problem.weight_cap(t, kv)
            # the most weight bytes that keep >= t tenants: cap keeps them, one byte more not
            assert cap == (
                problem.hbm_bytes - problem.reserve_bytes - kv.static_bytes - t * kv.tenant_bytes
            )
            if cap >= 0:
                assert problem.tenants(cap, kv) >= t > problem.tenants(cap + 1, kv)
        assert problem.weight_cap(0, kv) == math.inf and problem.weight_cap(-1, kv) == math.inf
    by_hand = len(problem.kv) * sum(math.prod(len(g) for g in s.groups) for s in problem.sections)
    assert (
        problem.size()
        == by_hand
        == len(problem.kv) * sum(len(list(_plans(s))) for s in problem.sections)
    )


def test_tenants_are_zero_when_the_weights_leave_no_pool():
    kv = knapsack.KVOption({}, 100, 10)
    p = knapsack.Problem((), (kv,), 1000, 200)
    assert p.tenants(700, kv) == 0  # pool 100, static 100: nothing left
    assert p.tenants(690, kv) == 1  # pool 110, 10 left: one tenant
    assert p.tenants(5000, kv) == 0  # weights over memory: the pool is 0, not negative
    assert p.tenants(0, kv) == 70
    one = knapsack.KVOption({}, 100, 1)  # one byte a tenant: an empty pool is still 0 tenants
    assert p.tenants(700, one) == 0 and p.tenants(699, one) == 1 and p.tenants(900, one) == 0


def test_a_level_whose_cap_is_exactly_the_base_keeps_only_the_base_width():
    # room for exactly one tenant at the base plan (cap 0 extra bytes): the level's width is
    # 0, so the cheaper option one byte heavier (0 tenants) is not credited with it
    sec = knapsack.Section({}, 800, ((knapsack.Option({}, 100), knapsack.Option({}, 101),
                                      knapsack.Option({}, 200)),))  # fmt: skip
    kv = knapsack.KVOption({}, 0, 100)
    p = knapsack.Problem((sec,), (kv,), 1000, 0)
    solved = knapsack.solve(p, 0, [np.array([1.0, 0.0, 0.5])])
    assert solved.sizing.unit == 1
    ts, ws = knapsack.levels(p, solved, kv)
    assert ts.tolist() == [0, 1] and ws.tolist() == [100, 0]
    assert solved.options_at(0) == [0] and p.tenants(solved.bytes_at(0), kv) == 1
    assert p.tenants(solved.bytes_at(1), kv) == 0


def test_costs_that_do_not_match_the_groups_are_refused():
    # one cost array per group and one cost per option: a short list is an error, not a
    # knapsack over the first groups (zip strict)
    sec = knapsack.Section({}, 0, ((knapsack.Option({}, 1), knapsack.Option({}, 2)),) * 2)
    p = knapsack.Problem((sec,), (knapsack.KVOption({}, 0, 1),), 100, 0)
    with pytest.raises(ValueError):
        knapsack.solve(p, 0, [np.array([0.1, 0.2])])
    with pytest.raises(ValueError):
        knapsack.solve(p, 0, [np.array([0.1, 0.2]), np.array([0.1])])
    with pytest.raises(ValueError):
        knapsack.solve(p, 0, [np.array([0.1, 0.2]), np.array([0.1, 0.2, 0.3])])


@pytest.mark.parametrize(
    ("span", "max_cells", "exact"), [(64, 64, True), (65, 64, False), (63, 64, True)]
)
def test_the_table_is_exact_up_to_max_cells_ticks(span, max_cells, exact):
    # one group of two options span bytes apart (gcd = span): 1 tick, always exact; with a
    # unit-gcd third option the span in units is span itself
    sec = knapsack.Section({}, 0, ((knapsack.Option({}, 0), knapsack.Option({}, 1),
                                    knapsack.Option({}, span)),))  # fmt: skip
    sz = knapsack.sizing(sec, max_cells=max_cells)
    assert sz.exact is exact
    assert sz.unit == (1 if exact else -(-span // max_cells))
    assert sz.cells == (span if exact else -(-span // sz.unit))


def test_equal_options_give_a_unit_of_one_and_a_single_cell():
    sec = knapsack.Section({}, 5, ((knapsack.Option({}, 40), knapsack.Option({}, 40)),))
    sz = knapsack.sizing(sec)
    assert (sz.unit, sz.cells, sz.base, sz.exact) == (1, 0, 45, True)
    kv = knapsack.KVOption({}, 0, 10)
    p = knapsack.Problem((sec,), (kv,), 200, 0)
    solved = knapsack.solve(p, 0, [np.array([0.5, 0.25])])
    assert solved.best.tolist() == [0.25] and solved.options_at(0) == [1]
    ts, ws = knapsack.levels(p, solved, kv)
    assert ts.tolist() == [15] and ws.tolist() == [0]


def test_ties_keep_the_first_option():
    # equal cost and bytes: the DP keeps the earlier option (strictly better replaces)
    sec = knapsack.Section({}, 0, ((knapsack.Option({}, 10), knapsack.Option({}, 10),
                                    knapsack.Option({}, 20)),))  # fmt: skip
    p = knapsack.Problem((sec,), (knapsack.KVOption({}, 0, 1),), 100, 0)
    solved = knapsack.solve(p, 0, [np.array([0.5, 0.5, 0.5])])
    assert [solved.options_at(w) for w in range(solved.sizing.cells + 1)] == [[0], [0]]


def test_a_level_no_plan_reaches_is_left_out():
    # one tenant needs 100 bytes: the light plan (weights 850) holds 1, the heavy (950) none;
    # level 0 is every plan's (width: the whole table), level 1 only the light plan's
    sec = knapsack.Section({}, 800, ((knapsack.Option({}, 50), knapsack.Option({}, 150)),))
    kv = knapsack.KVOption({}, 0, 100)
    p = knapsack.Problem((sec,), (kv,), 1000, 0)
    solved = knapsack.solve(p, 0, [np.array([1.0, 0.0])])
    ts, ws = knapsack.levels(p, solved, kv)
    assert ts.tolist() == [0, 1] and ws.tolist() == [1, 0]
    assert solved.best[ws].tolist() == [0.0, 1.0]
    # memory too small even for the lightest plan's static scales: no level but 0
    tight = knapsack.Problem((sec,), (knapsack.KVOption({}, 500, 100),), 1000, 0)
    ts, ws = knapsack.levels(tight, knapsack.solve(tight, 0, [np.array([1.0, 0.0])]),
                             tight.kv[0])  # fmt: skip
    assert ts.tolist() == [0] and ws.tolist() == [1]


def test_a_base_over_memory_leaves_only_level_zero_at_full_width():
    # base weights alone exceed memory: tenants 0 for every plan, level 0 at the full width
    sec = knapsack.Section({}, 2000, ((knapsack.Option({}, 0), knapsack.Option({}, 30)),))
    kv = knapsack.KVOption({}, 0, 7)
    p = knapsack.Problem((sec,), (kv,), 1000, 100)
    solved = knapsack.solve(p, 0, [np.array([0.3, 0.1])])
    ts, ws = knapsack.levels(p, solved, kv)
    assert ts.tolist() == [0] and ws.tolist() == [solved.sizing.cells]
    assert solved.best[ws[0]] == 0.1


@pytest.mark.parametrize(
    ("problem", "words"),
    [
        (knapsack.Problem((knapsack.Section({}, 0, ((),)),), (knapsack.KVOption({}, 0, 1),), 9, 0),
         "no choices"),
        (knapsack.Problem((knapsack.Section({}, 0, ()),), (knapsack.KVOption({}, 0, 0),), 9, 0),
         "no bytes per tenant"),
        (knapsack.Problem((knapsack.Section({}, 0, ()),), (knapsack.KVOption({}, 0, -4),), 9, 0),
         "no bytes per tenant"),
        (knapsack.Problem((), (knapsack.KVOption({}, 0, 1),), 9, 0), "no plans"),
        (knapsack.Problem((knapsack.Section({}, 0, ()),), (), 9, 0), "no plans"),
    ],
)  # fmt: skip
def test_problems_the_dp_cannot_represent_are_refused(problem, words):
    messages = {
        "no choices": "capacity_aware: a weight parameter with no choices",
        "no bytes per tenant": "capacity_aware: a KV plan with no bytes per tenant",
        "no plans": "capacity_aware: the space has no plans",
    }
    with pytest.raises(ValueError) as err:
        knapsack.check_problem(problem)
    assert str(err.value) == messages[words]


def test_a_representable_problem_passes_the_check():
    problem, _ = _problem(0, sections=2)
    knapsack.check_problem(problem)  # no error
    one = knapsack.Problem((knapsack.Section({}, 0, ()),), (knapsack.KVOption({}, 0, 1),), 9, 0)
    knapsack.check_problem(one)
