"""The sampler factory: the spec's `[sampler]` as an Optuna sampler, seeded for this start.

A resumed study must not replay the draws of its first start (a seeded RandomSampler or
NSGA-II rebuilt with the same seed asks the same parameters again, which come back as
duplicates). So the seed of a start is derived from the spec's seed and the number of trials
the study already holds (`start_seed`): the first start uses the spec's seed unchanged, a
resume a different, still reproducible one.
"""

from __future__ import annotations

import hashlib

from tenantq.search.spec import ExperimentSpec


def start_seed(seed: int, trials_so_far: int) -> int:
    """The spec's seed for a new study; for a study holding `trials_so_far` trials a seed
    derived from both (numpy's range, 0 .. 2^32 - 1)."""
    if trials_so_far == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{trials_so_far}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def make_sampler(spec: ExperimentSpec, context=None, *, trials_so_far: int = 0):
    """`context`: the study's `StudyContext` (the capacity-aware and grid samplers enumerate
    its space); built from the spec when None (tests, the sampler bench)."""
    import optuna

    s = spec.sampler
    if s.kind is None:  # a SamplerSpec built outside an ExperimentSpec: the spec's default
        from tenantq.search.spec import default_sampler_kind

        s = s.model_copy(update={"kind": default_sampler_kind(spec)})
    seed = start_seed(s.seed, trials_so_far)
    if s.kind == "grid" and context is None:
        from tenantq.search.context import study_context

        context = study_context(spec, "")
    if s.kind == "nsga2":
        kwargs = {"population_size": s.population_size} if s.population_size else {}
        return optuna.samplers.NSGAIISampler(seed=seed, **kwargs)
    if s.kind == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True)
    if s.kind == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    if s.kind == "grid":
        from tenantq.search.space import parameter_choices

        choices = parameter_choices(spec.space, context.config, context.profile)
        grid = {k: list(v) for k, v in choices.items()}
        return optuna.samplers.GridSampler(grid, seed=seed)
    if s.kind == "capacity_aware":
        from tenantq.search.capacity_aware import sampler_for_context, sampler_for_spec

        if context is None:
            return sampler_for_spec(spec, seed=seed)
        return sampler_for_context(context, seed=seed)
    return optuna.samplers.RandomSampler(seed=seed)
