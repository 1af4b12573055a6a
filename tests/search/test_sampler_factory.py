"""The sampler factory (tenantq.search.samplers): which Optuna sampler each `[sampler] kind`
builds, with which arguments, and the seed of each start. Optuna's sampler classes and the
capacity-aware builders are replaced by recorders, so each case is milliseconds and states
exactly what the factory passed; the seed of a resume is checked against sha256 by hand.
"""

from __future__ import annotations

import hashlib

import optuna
import pytest

# parse_spec imports the evaluator on its first call (~4 s): imported here, at collection, so
# mutmut's runs forked after collection (forkserver_warmup = collect) do not each pay it
import tenantq.evals.evaluator  # noqa: F401
from tenantq.search import capacity_aware, samplers
from tenantq.search.spec import SamplerSpec, parse_spec

SPEC = {
    "model": "reference",
    "deployment": {"hardware": "cpu", "memory": "9830KiB", "context_tokens": 256},
    "study": {"name": "factory", "trials": 3},
}


def _spec(sampler=None, objectives=None):
    raw = dict(SPEC)
    if sampler is not None:
        raw["sampler"] = sampler
    if objectives is not None:
        raw["objectives"] = objectives
    return parse_spec(raw)


@pytest.fixture
def built(monkeypatch):
    """Every sampler the factory can build, as (name, args, kwargs) records."""
    calls = []

    def recorder(name):
        def make(*args, **kwargs):
            calls.append((name, args, kwargs))
            return name

        return make

    for cls in ("NSGAIISampler", "TPESampler", "GPSampler", "GridSampler", "RandomSampler"):
        monkeypatch.setattr(optuna.samplers, cls, recorder(cls))
    monkeypatch.setattr(capacity_aware, "sampler_for_spec", recorder("for_spec"))
    monkeypatch.setattr(capacity_aware, "sampler_for_context", recorder("for_context"))
    return calls


def test_a_first_start_uses_the_specs_seed_unchanged():
    assert samplers.start_seed(0, 0) == 0
    assert samplers.start_seed(12345, 0) == 12345
    assert samplers.start_seed(2**32 - 1, 0) == 2**32 - 1


@pytest.mark.parametrize(("seed", "trials"), [(0, 1), (0, 4), (7, 4), (2**32 - 1, 100)])
def test_a_resume_seed_is_the_first_four_bytes_of_sha256_of_seed_and_trials(seed, trials):
    digest = hashlib.sha256(f"{seed}:{trials}".encode()).digest()
    expected = digest[0] | digest[1] << 8 | digest[2] << 16 | digest[3] << 24  # little-endian
    got = samplers.start_seed(seed, trials)
    assert got == expected and 0 <= got < 2**32


def test_resumes_of_different_length_get_different_seeds():
    seeds = {samplers.start_seed(0, n) for n in range(1, 50)}
    assert len(seeds) == 49 and 0 not in seeds


@pytest.mark.parametrize("trials", [0, 3])
def test_nsga2_gets_the_start_seed_and_the_population_size(built, trials):
    spec = _spec({"kind": "nsga2", "seed": 11, "population_size": 6})
    assert samplers.make_sampler(spec, trials_so_far=trials) == "NSGAIISampler"
    seed = samplers.start_seed(11, trials)
    assert built == [("NSGAIISampler", (), {"seed": seed, "population_size": 6})]


def test_nsga2_without_a_population_size_leaves_optunas_default(built):
    samplers.make_sampler(_spec({"kind": "nsga2", "seed": 5}))
    assert built == [("NSGAIISampler", (), {"seed": 5})]


def test_tpe_is_multivariate_and_gp_and_random_get_the_seed(built):
    for kind in ("tpe", "gp", "random"):
        samplers.make_sampler(_spec({"kind": kind, "seed": 9}), trials_so_far=2)
    seed = samplers.start_seed(9, 2)
    assert built == [
        ("TPESampler", (), {"seed": seed, "multivariate": True}),
        ("GPSampler", (), {"seed": seed}),
        ("RandomSampler", (), {"seed": seed}),
    ]


def test_grid_enumerates_the_contexts_parameter_choices(built, monkeypatch):
    from tenantq.search import space

    class Context:
        config, profile = "config", "profile"

    seen = []

    def choices(sp, config, profile):
        seen.append((sp, config, profile))
        return {"a": ("x", "y"), "b": (1, 2, 3)}

    monkeypatch.setattr(space, "parameter_choices", choices)
    spec = _spec({"kind": "grid", "seed": 3})
    samplers.make_sampler(spec, Context(), trials_so_far=1)
    assert seen == [(spec.space, "config", "profile")]
    grid = {"a": ["x", "y"], "b": [1, 2, 3]}
    assert built == [("GridSampler", (grid,), {"seed": samplers.start_seed(3, 1)})]


def test_grid_without_a_context_builds_the_studys_own(built, monkeypatch):
    from tenantq.search import context, space

    class Context:
        config, profile = "cfg", None

    made = []
    monkeypatch.setattr(
        context, "study_context", lambda spec, text: made.append((spec, text)) or Context()
    )
    monkeypatch.setattr(space, "parameter_choices", lambda sp, c, p: {"a": ("x",)})
    spec = _spec({"kind": "grid"})
    samplers.make_sampler(spec)
    assert made == [(spec, "")]
    assert built == [("GridSampler", ({"a": ["x"]},), {"seed": 0})]


def test_capacity_aware_is_built_on_the_context_when_given_else_on_the_spec(built):
    spec = _spec({"kind": "capacity_aware", "seed": 4})
    samplers.make_sampler(spec, trials_so_far=2)
    samplers.make_sampler(spec, "the-context", trials_so_far=0)
    assert built == [
        ("for_spec", (spec,), {"seed": samplers.start_seed(4, 2)}),
        ("for_context", ("the-context",), {"seed": 4}),
    ]


def test_a_sampler_without_a_kind_takes_the_specs_default(built):
    # with a quality objective: capacity_aware; a capacity-only study: nsga2
    spec = _spec({"kind": "tpe", "seed": 2})
    spec = spec.model_copy(update={"sampler": SamplerSpec(seed=2)})
    assert spec.sampler.kind is None
    samplers.make_sampler(spec)
    only_capacity = _spec(objectives=[{"metric": "tenants", "direction": "maximize"}])
    only_capacity = only_capacity.model_copy(update={"sampler": SamplerSpec(seed=8)})
    samplers.make_sampler(only_capacity)
    assert [(name, kw) for name, _, kw in built] == [
        ("for_spec", {"seed": 2}),
        ("NSGAIISampler", {"seed": 8}),
    ]


def test_the_real_samplers_are_optunas_kinds():
    # no recorders: each kind is the Optuna class, seeded (two draws of a fresh study agree)
    for kind, cls in (("nsga2", optuna.samplers.NSGAIISampler), ("tpe", optuna.samplers.TPESampler),
                      ("random", optuna.samplers.RandomSampler)):  # fmt: skip
        spec = _spec({"kind": kind, "seed": 1})
        draws = []
        for _ in range(2):
            sampler = samplers.make_sampler(spec)
            assert type(sampler) is cls
            study = optuna.create_study(sampler=sampler)
            draws.append(study.ask().suggest_float("x", 0, 1))
        assert draws[0] == draws[1]
