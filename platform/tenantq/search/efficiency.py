"""Search efficiency on a finite space: the space, its exhaustive quality cache, the front.

A finite structured space (MLP format x attention format x KV format and key axis) on the
quickstart deployment, every plan built by `space.plan_from_params` and counted by
`capacity.budget` exactly as the driver does. One exhaustive pass measures each distinct
plan's quality once and caches it on disk by plan fingerprint (one JSON file per plan,
written atomically, so a killed pass resumes); samplers are then compared on the cache alone,
by front coverage (issue 12's definition) and Optuna's hypervolume, through the driver's own
`make_sampler` and the same ask/tell rule (a plan already measured is not counted again).
The capacity-aware sampler runs on the space's knapsack form (`landscape_problem`, built for
any finite space of named axes: the 3-axis space or the per-layer one), and `ask_cost` times it
on a real-size per-tensor space built from a capacity preset.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tenantq.model.files import atomic_write_text
from tenantq.search.spec import ExperimentSpec, SpaceSpec

MLP_FORMATS = ("bf16", "fp8_e4m3", "int8", "int4", "nvfp4", "mxfp4")
ATTN_FORMATS = ("bf16", "fp8_e4m3", "int8", "int4")
# KV choice = "format/key axis"; values always per token (DESIGN.md), keys as named.
KV_CHOICES = (
    "bf16",
    "fp8_e4m3/channel",
    "fp8_e4m3/token",
    "int4/channel",
    "int4/token",
    "nvfp4/token",
    "mxfp4/token",
)
AXES = {"mlp": MLP_FORMATS, "attn": ATTN_FORMATS, "kv": KV_CHOICES}
QUALITY_METRIC = "fidelity.kl_mean"
SUITE_PATH = Path(__file__).resolve().parent / "efficiency_suite.toml"
DEFAULT_SPEC = Path(__file__).resolve().parents[3] / "experiments" / "quickstart.toml"


@dataclass(frozen=True)
class SpacePoint:
    """One plan of the finite space: its choice per axis, fingerprint and exact tenants."""

    choice: tuple[str, ...]  # (mlp, attn, kv); per layer: (mlp_0.., kv_0..)
    fingerprint: str
    tenants: int
    plan_json: str


def efficiency_space(spec: ExperimentSpec) -> SpaceSpec:
    """The spec's structured space narrowed to the three searched axes (no bf16 edge layers,
    no sinks, no bf16 KV layers; embed and lm_head stay bf16)."""
    kv_formats = sorted({c.split("/")[0] for c in KV_CHOICES})
    return spec.space.model_copy(
        update={
            "kind": "structured",
            "weight_formats": list(dict.fromkeys(MLP_FORMATS + ATTN_FORMATS)),
            "embed_formats": ["bf16"],
            "uniform_weights": False,
            "bf16_first_layers": [0],
            "bf16_last_layers": [0],
            "key_formats": kv_formats,
            "value_formats": kv_formats,
            "key_axes": ["channel", "token"],
            "sink_tokens": [0],
            "kv_bf16_layers": ["none"],
        }
    )


def space_params(choice: tuple[str, str, str], config) -> dict[str, Any]:
    """The structured space's parameters for one (mlp, attn, kv) choice."""
    mlp, attn, kv = choice
    key_format, _, key_axis = kv.partition("/")
    params: dict[str, Any] = {
        "w.attn_qkv": attn,
        "w.attn_o": attn,
        "w.mlp_gate_up": mlp,
        "w.mlp_down": mlp,
        "w.embed": "bf16",
        "bf16_first_layers": 0,
        "bf16_last_layers": 0,
        "kv.key_format": key_format,
        "kv.key_axis": key_axis or "channel",
        "kv.value_format": key_format,
        "kv.sink_tokens": 0,
        "kv.bf16_layers": "none",
    }
    if "lm_head" in config.tensors():
        params["w.lm_head"] = "bf16"
    return params


def build_points(spec_path: str | Path = DEFAULT_SPEC) -> tuple[list[SpacePoint], Any]:
    """Every plan of the space on `spec_path`'s deployment; returns (points, prepared spec)."""
    from tenantq.capacity import budget
    from tenantq.search.context import study_context
    from tenantq.search.space import plan_from_params
    from tenantq.search.spec import load_spec

    base = load_spec(spec_path)
    spec = base.model_copy(update={"space": efficiency_space(base)})
    prep = study_context(spec, Path(spec_path).read_text())
    points = []
    for mlp in MLP_FORMATS:
        for attn in ATTN_FORMATS:
            for kv in KV_CHOICES:
                choice = (mlp, attn, kv)
                plan = plan_from_params(
                    spec.space,
                    space_params(choice, prep.config),
                    prep.config,
                    algorithm=spec.calibration.algorithm,
                )
                b = budget(
                    prep.capacity_config, plan, prep.deployment, spec.deployment.context_tokens
                )
                points.append(SpacePoint(choice, plan.fingerprint(), b.tenants, plan.to_json()))
    return points, prep


# ---------------------------------------------------------------- the per-layer space
# Issue 25's larger space: every layer's MLP format x every layer's KV format (keys per
# channel, values per token), attention, embed and lm_head bf16. On the 4-layer reference
# model 3^4 x 2^4 = 1,296 plans; measured exhaustively into experiments/ground-truth/.
LAYER_MLP_FORMATS = ("bf16", "int8", "int4")
LAYER_KV_FORMATS = ("bf16", "int4")
SPACE_NAMES = ("mlp-attn-kv", "per-layer")
MAX_LAYER_PLANS = 50_000  # the per-layer space is enumerated: 6^L plans (L <= 6 layers)
TRUTH_TABLES = {
    "mlp-attn-kv": "mlp-attn-kv-168.jsonl",
    "per-layer": "layer-mlp-kv-1296.jsonl",
}


def layer_plan(mlp: tuple[str, ...], kv: tuple[str, ...], group_size: int | None):
    """The plan of one per-layer choice: a rule per quantized layer's MLP, a per-layer KV
    format (`KVPlan.layer_formats`) per quantized layer's cache."""
    from tenantq.quant.plan import KVPlan, QuantPlan, Rule

    rules = tuple(
        Rule(f"layers/{i}/mlp/(gate|up|down)_proj", f, group_size=group_size)
        for i, f in enumerate(mlp)
        if f != "bf16"
    )
    layers = tuple((i, f, f) for i, f in enumerate(kv) if f != "bf16")
    return QuantPlan(rules=rules, kv=KVPlan(layer_formats=layers))


def build_layer_points(spec_path: str | Path = DEFAULT_SPEC) -> tuple[list[SpacePoint], Any]:
    """Every plan of the per-layer space on `spec_path`'s deployment, tenants by
    `capacity.budget`; returns (points, prepared spec)."""
    import itertools

    from tenantq.capacity import budget
    from tenantq.search.context import study_context
    from tenantq.search.spec import load_spec

    spec = load_spec(spec_path)
    prep = study_context(spec, Path(spec_path).read_text())
    layers = prep.config.num_layers
    size = (len(LAYER_MLP_FORMATS) * len(LAYER_KV_FORMATS)) ** layers
    if size > MAX_LAYER_PLANS:
        raise ValueError(
            f"--space per-layer on {spec_path}: {layers} layers: "
            f"{len(LAYER_MLP_FORMATS) * len(LAYER_KV_FORMATS)}^{layers} = {size:.3g} plans; "
            f"an exhaustive space holds at most {MAX_LAYER_PLANS:,} (a model of <= 6 layers)"
        )
    points = []
    for mlp in itertools.product(LAYER_MLP_FORMATS, repeat=layers):
        for kv in itertools.product(LAYER_KV_FORMATS, repeat=layers):
            plan = layer_plan(mlp, kv, spec.space.group_size)
            b = budget(prep.capacity_config, plan, prep.deployment, spec.deployment.context_tokens)
            points.append(SpacePoint(mlp + kv, plan.fingerprint(), b.tenants, plan.to_json()))
    return points, prep


def layer_axes(layers: int) -> dict[str, tuple[str, ...]]:
    """The per-layer space's axes, in its points' choice order: mlp_0.., then kv_0.."""
    return {**{f"mlp_{i}": LAYER_MLP_FORMATS for i in range(layers)},
            **{f"kv_{i}": LAYER_KV_FORMATS for i in range(layers)}}  # fmt: skip


def space_axes(name: str, config) -> dict[str, tuple[str, ...]]:
    """The axes of the space called `name` on a model of `config`'s shape."""
    return dict(AXES) if name == "mlp-attn-kv" else layer_axes(config.num_layers)


def space_points(name: str, spec_path: str | Path = DEFAULT_SPEC):
    """(points, prepared spec) of the space called `name` (SPACE_NAMES)."""
    if name == "mlp-attn-kv":
        return build_points(spec_path)
    if name == "per-layer":
        return build_layer_points(spec_path)
    raise ValueError(f"--space {name!r}: unknown; choose one of {', '.join(SPACE_NAMES)}")


# ---------------------------------------------------------------- the quality cache
def cache_path(cache_dir: Path, fingerprint: str) -> Path:
    return Path(cache_dir) / f"{fingerprint}.json"


def read_cache(cache_dir: str | Path) -> dict[str, dict[str, Any]]:
    """fingerprint -> cached record, for every complete record under `cache_dir`."""
    out = {}
    for p in sorted(Path(cache_dir).glob("*.json")):
        try:
            record = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # a damaged record is measured again, never trusted
        if record.get("fingerprint") == p.stem and QUALITY_METRIC in record.get("summary", {}):
            out[p.stem] = record
    return out


def write_record(cache_dir: Path, record: dict[str, Any]) -> Path:
    """Write one plan's record atomically (`tenantq.model.files.atomic_write_text`)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_path(cache_dir, record["fingerprint"])
    atomic_write_text(target, json.dumps(record, sort_keys=True))
    return target


def exhaustive_pass(
    points: list[SpacePoint],
    model_path: Path,
    cache_dir: Path,
    *,
    suite: str | Path = SUITE_PATH,
    log=print,
) -> dict[str, dict[str, Any]]:
    """Measure every distinct plan not yet cached with one Evaluator (one bf16 baseline)."""
    from tenantq.evals import Evaluator
    from tenantq.quant.plan import QuantPlan

    cache_dir = Path(cache_dir)
    done = read_cache(cache_dir)
    todo: dict[str, SpacePoint] = {}
    for p in points:
        if p.fingerprint not in done:
            todo.setdefault(p.fingerprint, p)
    log(f"{len(done)} plans cached, {len(todo)} to measure")
    if not todo:
        return done
    evaluator = Evaluator(model_path, suite, cache_dir=cache_dir / "baseline")
    for i, p in enumerate(todo.values(), 1):
        began = time.perf_counter()
        result = evaluator.evaluate(QuantPlan.from_json(p.plan_json))
        summary = {k: v for k, v in result.summary.items() if isinstance(v, int | float | str)}
        record = {
            "fingerprint": p.fingerprint,
            "choice": list(p.choice),
            "tenants": p.tenants,
            "plan": p.plan_json,
            "summary": summary,
            "timings_s": dict(result.timings_s),
            "dataset_hash": evaluator.dataset_hash,
            "model": evaluator.identity,
        }
        write_record(cache_dir, record)
        done[p.fingerprint] = record
        log(
            f"[{i}/{len(todo)}] {'/'.join(p.choice)} tenants={p.tenants} "
            f"kl={summary[QUALITY_METRIC]:.5f} {time.perf_counter() - began:.1f}s"
        )
    return done


# ---------------------------------------------------------------- front, coverage, hypervolume
COVERAGE_SLACK = 0.25  # the definition: quality within 25% of the best at that level
KL_FLOOR = 1e-4  # hypervolume axis is log10(max(KL, floor)); bf16's KL is exactly 0
SAMPLERS = ("random", "nsga2", "tpe", "capacity_aware")  # capacity_aware_finite on request
NSGA2_POPULATION = 6  # issue 12's comparison: the quickstart spec's NSGA-II population then
MAX_ASKS_PER_EVALUATION = 50  # a sampler that only repeats measured plans is stopped here
# what `make_comparison_sampler` builds: the driver's kinds the landscape can host, GP, the
# enumerating capacity-aware sampler of issue 12 and the one-shot baselines
COMPARISON_SAMPLERS = ("random", "nsga2", "tpe", "gp", "capacity_aware", "capacity_aware_finite",
                       "modelopt", "modelopt_counted")  # fmt: skip


def pareto_front(points: list[tuple[int, float]]) -> dict[int, float]:
    """Tenant level -> loss of the non-dominated (tenants up, loss down) points."""
    front: dict[int, float] = {}
    best = float("inf")
    for tenants, loss in sorted(points, key=lambda p: (-p[0], p[1])):
        if loss < best:
            front[tenants] = loss
            best = loss
    return front


def front_coverage(
    found: list[tuple[int, float]], front: dict[int, float], slack: float = COVERAGE_SLACK
) -> float:
    """Share of `front`'s tenant levels that some found point reaches: at least that many
    tenants with loss at most (1 + slack) x the front's loss there."""
    if not front:
        raise ValueError("front coverage needs a non-empty exhaustive front")
    reached = sum(
        any(t >= level and q <= (1 + slack) * best for t, q in found)
        for level, best in front.items()
    )
    return reached / len(front)


def hypervolume(found: list[tuple[int, float]], reference: tuple[float, float]) -> float:
    """Area dominated by `found` in (tenants, log10 KL) up to `reference` (tenants, log10 KL),
    by Optuna's own exact hypervolume (`optuna._hypervolume.compute_hypervolume`, the one
    `plot_hypervolume_history` uses; it minimizes, so tenants enter negated)."""
    from optuna._hypervolume import compute_hypervolume

    losses = np.array([[-t, math.log10(max(q, KL_FLOOR))] for t, q in found], float)
    ref = np.array([-reference[0], reference[1]], float)
    inside = losses[np.all(losses < ref, axis=1)] if len(losses) else losses
    if len(inside) == 0:
        return 0.0
    return float(compute_hypervolume(inside, ref))


def hv_reference(all_points: list[tuple[int, float]]) -> tuple[float, float]:
    """0 tenants and 0.1 decade above the space's worst finite KL: every plan lies inside (a
    NaN KL, a broken plan, is on no front and sets no reference)."""
    worst = max((q for _, q in all_points if math.isfinite(q)), default=KL_FLOOR)
    return 0.0, math.log10(max(worst, KL_FLOOR)) + 0.1


# ---------------------------------------------------------------- sampler comparison
@dataclass(frozen=True)
class Landscape:
    """The space with every plan's measured loss (from the cache): what samplers search."""

    points: tuple[SpacePoint, ...]
    loss: dict[str, float]  # fingerprint -> QUALITY_METRIC
    # axis name -> its values, in the order of each point's `choice`; the first value of every
    # axis is the reference (bf16). Axes named "kv" or "kv_<i>" are the KV side.
    axes: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(AXES))

    @classmethod
    def from_cache(
        cls,
        points: list[SpacePoint],
        cache: dict[str, dict],
        metric: str = QUALITY_METRIC,
        axes: dict[str, tuple[str, ...]] | None = None,
    ) -> Landscape:
        """Losses from the cached summaries; `metric` is a lower-is-better summary key, or
        '-KEY' for a higher-is-better one (e.g. '-fidelity.top1_agree_delta')."""
        missing = sorted({p.fingerprint for p in points} - set(cache))
        if missing:
            raise ValueError(
                f"{len(missing)} of the space's plans have no cached quality (first "
                f"{missing[0]}); run the exhaustive pass (--measure) first"
            )
        sign, key = (-1.0, metric[1:]) if metric.startswith("-") else (1.0, metric)
        summary = cache[points[0].fingerprint]["summary"]
        if not isinstance(summary.get(key), int | float):
            numeric = sorted(k for k, v in summary.items() if isinstance(v, int | float))
            raise ValueError(f"metric {key!r} is not in the cache; cached: {', '.join(numeric)}")
        for p in points:
            if not isinstance(cache[p.fingerprint]["summary"].get(key), int | float):
                raise ValueError(
                    f"plan {p.fingerprint}: no numeric {key!r} in its cached quality; measure "
                    f"it again (remove its row or record, then --measure)"
                )
        return cls(tuple(points), {p.fingerprint: sign * cache[p.fingerprint]["summary"][key]
                                   for p in points}, dict(axes or AXES))  # fmt: skip

    def all_points(self) -> list[tuple[int, float]]:
        unique = {p.fingerprint: (p.tenants, self.loss[p.fingerprint]) for p in self.points}
        return list(unique.values())


def axis_params(choice: tuple[str, ...], axes=AXES) -> dict[str, str]:
    return dict(zip(axes, choice, strict=True))


def is_kv_axis(name: str) -> bool:
    """The KV side of a landscape's axes: "kv" (the 3-axis space) or "kv_<layer>"."""
    return name == "kv" or name.startswith("kv_")


def make_comparison_sampler(kind: str, seed: int, landscape: Landscape, spec: ExperimentSpec):
    """The sampler the driver would build for `kind` (its own `make_sampler`), or the
    capacity-aware one (`KnapsackSampler`) over the landscape's space, its byte figures from
    `landscape_problem`."""
    from tenantq.search.samplers import make_sampler

    if kind not in COMPARISON_SAMPLERS:  # make_sampler would build a RandomSampler for it
        raise ValueError(f"sampler {kind!r}: unknown; choose from {', '.join(COMPARISON_SAMPLERS)}")
    if kind == "capacity_aware":
        return landscape_sampler(landscape, spec, seed)
    if kind == "capacity_aware_finite":  # the enumerating sampler of issue 12, for comparison
        from tenantq.search.capacity_aware import Candidate, CapacityAwareSampler

        candidates = [
            Candidate(axis_params(p.choice, landscape.axes), p.tenants, p.fingerprint)
            for p in landscape.points
        ]
        return CapacityAwareSampler(candidates, quality_index=1, seed=seed)
    if kind == "gp":  # Optuna 5's GP sampler (logEHVI for two objectives), its defaults
        import optuna

        return optuna.samplers.GPSampler(seed=seed)
    if kind == "modelopt":
        return OneShotSampler(modelopt_order(landscape), seed=seed, axes=landscape.axes)
    if kind == "modelopt_counted":  # its scores paid for: the single-group plans measured first
        order = modelopt_order(landscape)
        ref = reference_choice(landscape)
        singles = [c for c in order if sum(x != r for x, r in zip(c, ref, strict=True)) <= 1]
        rest = [c for c in order if c not in set(singles)]
        return OneShotSampler(singles + rest, seed=seed, axes=landscape.axes)
    update: dict[str, Any] = {"kind": kind, "seed": seed}
    if kind == "nsga2":  # the population the quickstart spec had while it named NSGA-II
        update["population_size"] = spec.sampler.population_size or NSGA2_POPULATION
    sampler = spec.sampler.model_copy(update=update)
    return make_sampler(spec.model_copy(update={"sampler": sampler}))


_PROBLEMS: dict[tuple, Any] = {}


def reference_choice(landscape: Landscape) -> tuple[str, ...]:
    """The all-reference plan's choice: every axis at its first value (bf16)."""
    return tuple(values[0] for values in landscape.axes.values())


def landscape_problem(landscape: Landscape, spec: ExperimentSpec):
    """The landscape's space as the knapsack sampler sees it, for any space whose points vary
    one axis at a time from the reference: one weight group per weight axis (its options' bytes
    = the weight bytes `capacity.budget` counts for the plan that changes that axis alone),
    one KV option per combination of the KV axes (`is_kv_axis`; static and per-tenant bytes of
    that plan's KV), on the spec's deployment. Refused, naming the axis or plan, when an axis
    changes both sides or when the sum does not give a plan's tenants (the space is then not
    additive in bytes). Cached per (spec, space)."""
    import itertools

    from tenantq.capacity import budget
    from tenantq.quant.plan import QuantPlan
    from tenantq.search import knapsack
    from tenantq.search.capacity_aware import _kv_bytes
    from tenantq.search.context import study_context

    axes = landscape.axes
    # every plan in the key: a landscape differing in any plan's tenants is checked afresh
    plans = tuple((p.choice, p.fingerprint, p.tenants, p.plan_json) for p in landscape.points)
    key = (spec.model_dump_json(), tuple(axes.items()), plans)
    if key in _PROBLEMS:
        return _PROBLEMS[key]
    prep = study_context(spec, "")
    by_choice = {p.choice: p for p in landscape.points}
    ref = reference_choice(landscape)
    names = list(axes)

    def point(changes: dict[str, str]) -> SpacePoint:
        choice = tuple(changes.get(n, r) for n, r in zip(names, ref, strict=True))
        if choice not in by_choice:
            raise ValueError(f"landscape: no plan for {'/'.join(choice)}; the space must hold "
                             f"every combination of its axes' values")  # fmt: skip
        return by_choice[choice]

    def sides(p: SpacePoint) -> tuple[int, tuple[int, int]]:
        plan = QuantPlan.from_json(p.plan_json)
        b = budget(prep.capacity_config, plan, prep.deployment, spec.deployment.context_tokens)
        return sum(t.bytes_per_chip for t in b.tensors), _kv_bytes(prep, plan)

    base_w, base_kv = sides(point({}))
    groups = []
    for n in names:
        if is_kv_axis(n):
            continue
        opts = []
        for v in axes[n]:
            w, kv = sides(point({n: v}))
            if kv != base_kv:
                raise ValueError(f"landscape axis {n!r}: value {v!r} changes the KV bytes; name "
                                 f"a KV axis 'kv' or 'kv_<i>'")  # fmt: skip
            opts.append(knapsack.Option({n: v}, w - base_w))
        groups.append(tuple(opts))
    kv_names = [n for n in names if is_kv_axis(n)]
    kvs = []
    for values in itertools.product(*(axes[n] for n in kv_names)):
        params = dict(zip(kv_names, values, strict=True))
        w, kv = sides(point(params))
        if w != base_w:
            raise ValueError(f"landscape KV axes {params}: change the weight bytes")
        kvs.append(knapsack.KVOption(params, *kv))
    dep = prep.deployment
    problem = knapsack.Problem(
        (knapsack.Section({}, base_w, tuple(groups)),), tuple(kvs), dep.hardware.hbm_bytes,
        dep.reserve_bytes_per_chip,
    )  # fmt: skip
    # every plan's tenants from the sum, as `capacity.budget` counts them (the sampler's claim)
    option = {next(iter(o.params.items())): o.bytes for g in groups for o in g}
    kv_of = {tuple(sorted(k.params.items())): k for k in kvs}
    for p in landscape.points:
        params = axis_params(p.choice, axes)
        w = base_w + sum(option[(n, v)] for n, v in params.items() if not is_kv_axis(n))
        k = kv_of[tuple(sorted((n, v) for n, v in params.items() if is_kv_axis(n)))]
        if problem.tenants(w, k) != p.tenants:
            raise ValueError(f"landscape plan {'/'.join(p.choice)}: {p.tenants} tenants by "
                             f"budget, {problem.tenants(w, k)} by the sum of its axes' bytes; "
                             f"the space is not additive in bytes")  # fmt: skip
    _PROBLEMS[key] = problem
    return problem


def landscape_sampler(landscape: Landscape, spec: ExperimentSpec, seed: int = 0):
    """`KnapsackSampler` over the landscape: tenants and fingerprints from its points."""
    from optuna.distributions import CategoricalDistribution

    from tenantq.search.capacity_aware import KnapsackSampler

    by_choice = {p.choice: p for p in landscape.points}
    names = list(landscape.axes)

    def locate(params):
        p = by_choice[tuple(params[n] for n in names)]
        return p.fingerprint, p.tenants

    return KnapsackSampler(
        landscape_problem(landscape, spec),
        quality=[(1, 1.0)],
        locate=locate,
        distributions={a: CategoricalDistribution(list(v)) for a, v in landscape.axes.items()},
        seed=seed,
    )


# ---------------------------------------------------------------- a one-shot baseline
def _spread(n: int) -> list[int]:
    """0..n-1 ordered so that every prefix is spread over the range: ends, middle, quarters..."""
    if n <= 2:
        return list(range(n))
    order, seen, parts = [0, n - 1], {0, n - 1}, [(0, n - 1)]
    while parts:
        nxt = []
        for lo, hi in parts:
            mid = (lo + hi) // 2
            if mid not in seen:
                order.append(mid)
                seen.add(mid)
            if mid - lo > 1:
                nxt.append((lo, mid))
            if hi - mid > 1:
                nxt.append((mid, hi))
        parts = nxt
    return order + [i for i in range(n) if i not in seen]


def modelopt_order(landscape: Landscape) -> list[tuple[str, ...]]:
    """The plans a one-shot, ModelOpt auto_quantize-style search measures, in order.

    Sensitivity is scored once per (axis, value) and never updated: the loss of the plan that
    changes that axis alone (the rest at the reference, bf16), read from the landscape free of
    charge, as a sensitivity profile computed before a study is. Weights are chosen first (for
    each weight-byte level the weight axes' values of least summed score: a knapsack over the
    weight axes, KV at the reference), KV separately after (the KV axes' values on their own
    score-vs-tenants front, weights at the reference); a plan is a front weight choice with a
    front KV choice, predicted loss = the sum of the scores. The plans on the predicted
    (tenants, loss) front are measured spread over the tenant range (ends, middle, quarters,
    ...), then the other plans by predicted loss; no measurement changes the order."""
    import itertools

    by_choice = {p.choice: p for p in landscape.points}
    names = list(landscape.axes)
    ref = reference_choice(landscape)
    base = landscape.loss[by_choice[ref].fingerprint]

    def with_(changes: dict[int, str]) -> tuple[str, ...]:
        return tuple(changes.get(i, r) for i, r in enumerate(ref))

    score = {(i, v): landscape.loss[by_choice[with_({i: v})].fingerprint] - base
             for i, n in enumerate(names) for v in landscape.axes[n]}  # fmt: skip

    def predicted(choice) -> float:
        return sum(score[(i, v)] for i, v in enumerate(choice))

    w_idx = [i for i, n in enumerate(names) if not is_kv_axis(n)]
    k_idx = [i for i, n in enumerate(names) if is_kv_axis(n)]

    def side_front(idx):
        values = itertools.product(*(landscape.axes[names[i]] for i in idx))
        combos = [with_(dict(zip(idx, vals, strict=True))) for vals in values]
        return pareto_front_keys([(c, by_choice[c].tenants, predicted(c)) for c in combos])

    weights, kvs = side_front(w_idx), side_front(k_idx)
    plans = [tuple(k[i] if i in k_idx else w[i] for i in range(len(ref)))
             for w in weights for k in kvs]  # fmt: skip
    front = sorted(
        pareto_front_keys([(c, by_choice[c].tenants, predicted(c)) for c in plans]),
        key=lambda c: by_choice[c].tenants,
    )
    order = [front[i] for i in _spread(len(front))]
    chosen = set(order)
    rest = sorted((c for c in by_choice if c not in chosen), key=lambda c: (predicted(c), c))
    return order + rest


def pareto_front_keys(items) -> list:
    """Keys of the non-dominated (key, tenants up, loss down) items, one per tenant level."""
    out, best = [], float("inf")
    for key, _, loss in sorted(items, key=lambda x: (-x[1], x[2])):
        if loss < best:
            out.append(key)
            best = loss
    return out


class OneShotSampler:
    """Proposes a fixed list of plans in order (the next one the study does not hold), never
    learning from a measurement: the one-shot baseline as an Optuna sampler."""

    def __new__(cls, order, seed=None, axes=AXES):
        from optuna.distributions import CategoricalDistribution
        from optuna.samplers import BaseSampler, RandomSampler

        class _OneShot(BaseSampler):
            def __init__(self):
                self.order = list(order)
                self._fallback = RandomSampler(seed=seed)
                self._space = {a: CategoricalDistribution(list(v)) for a, v in axes.items()}

            def infer_relative_search_space(self, study, trial):
                return dict(self._space)

            def sample_relative(self, study, trial, search_space):
                held = {
                    tuple(t.params.get(a) for a in axes) for t in study.get_trials(deepcopy=False)
                }
                for c in self.order:
                    if c not in held:
                        return axis_params(c, axes)
                return {}

            def sample_independent(self, study, trial, name, dist):
                return self._fallback.sample_independent(study, trial, name, dist)

        return _OneShot()


# The driver's baselines (space.baseline_params): all bf16; fp8 weights with fp8 KV (keys per
# channel); int4 weights with bf16 KV. A baseline the space cannot express is left out, as
# the driver leaves it out.
DRIVER_BASELINES = (("bf16", "bf16"), ("fp8_e4m3", "fp8_e4m3"), ("int4", "bf16"))
BASELINES = (  # the 3-axis space's
    ("bf16", "bf16", "bf16"),
    ("fp8_e4m3", "fp8_e4m3", "fp8_e4m3/channel"),
    ("int4", "int4", "bf16"),
)


def baseline_choices(axes: dict[str, tuple[str, ...]]) -> list[tuple[str, ...]]:
    """`DRIVER_BASELINES` as choices of a space with these axes: every weight axis at the
    weights' format, every KV axis at the KV format (keys per channel where the value names an
    axis); the ones some axis cannot take are left out."""
    out = []
    for weights, kv in DRIVER_BASELINES:
        choice = []
        for n, values in axes.items():
            want = (kv, f"{kv}/channel") if is_kv_axis(n) else (weights,)
            hit = [v for v in want if v in values]
            if not hit:
                break
            choice.append(hit[0])
        else:
            out.append(tuple(choice))
    return out


def run_sampler(
    sampler, landscape: Landscape, budget: int, *, baselines: bool = False, trace: bool = False
):
    """Ask/tell until `budget` distinct plans are measured; a plan already measured is answered
    from the study without counting (as the driver does). With `baselines`, the driver's
    baselines the space can express (`baseline_choices`) are enqueued first and count toward
    the budget. Returns (found points in the order measured, asks); with `trace`, also the
    number of asks made when each found point was measured (so one run to the largest budget
    answers every smaller one: a sampler's picks do not depend on the budget)."""
    import optuna

    axes = landscape.axes
    by_choice = {p.choice: p for p in landscape.points}
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    for choice in baseline_choices(axes) if baselines else ():
        study.enqueue_trial(axis_params(choice, axes))
    measured: dict[str, tuple[int, float]] = {}
    asked_at: list[int] = []
    asks = 0
    while len(measured) < budget and asks < MAX_ASKS_PER_EVALUATION * budget:
        trial = study.ask()
        asks += 1
        choice = tuple(trial.suggest_categorical(a, list(v)) for a, v in axes.items())
        p = by_choice[choice]
        value = (p.tenants, landscape.loss[p.fingerprint])
        if p.fingerprint not in measured:
            measured[p.fingerprint] = value
            asked_at.append(asks)
        study.tell(trial, list(value))
    if trace:
        return list(measured.values()), asks, asked_at
    return list(measured.values()), asks


def prefix(found, asked_at, budget: int) -> tuple[list[tuple[int, float]], int]:
    """What a run stopped at `budget` would have returned, from a longer run's trace: the first
    `budget` plans measured within its ask cap, and the asks it made."""
    cap = MAX_ASKS_PER_EVALUATION * budget
    n = 0
    while n < min(budget, len(found)) and asked_at[n] <= cap:
        n += 1
    if n == budget:
        return found[:n], asked_at[n - 1]
    return found[:n], cap  # it would have run out of asks first


def compare(
    landscape: Landscape,
    spec: ExperimentSpec,
    budgets: tuple[int, ...] = (10, 20, 25, 40),
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4),
    samplers: tuple[str, ...] = SAMPLERS,
    *,
    baselines: bool = False,
) -> list[dict[str, Any]]:
    """One row per (sampler, budget, seed): coverage, hypervolume ratio, asks."""
    import optuna

    if not budgets or min(budgets) < 1 or max(budgets) > len(landscape.loss):
        raise ValueError(f"budgets {list(budgets)}: each must be at least 1 and at most the "
                         f"space's {len(landscape.loss)} distinct plans")  # fmt: skip

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    everything = landscape.all_points()
    front = pareto_front(everything)
    ref = hv_reference(everything)
    hv_all = hypervolume(everything, ref)
    rows = []
    for kind in samplers:
        for seed in seeds:  # one run to the largest budget; each smaller one is its prefix
            sampler = make_comparison_sampler(kind, seed, landscape, spec)
            found, _, asked_at = run_sampler(
                sampler, landscape, max(budgets), baselines=baselines, trace=True
            )
            for budget in budgets:
                got, asks = prefix(found, asked_at, budget)
                rows.append({
                    "sampler": kind, "budget": budget, "seed": seed, "evaluated": len(got),
                    "asks": asks, "coverage": front_coverage(got, front),
                    "hv_ratio": hypervolume(got, ref) / hv_all,
                })  # fmt: skip
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean, min and max over seeds per (sampler, budget)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["sampler"], r["budget"]), []).append(r)
    out = []
    for (kind, budget), rs in groups.items():
        cov = [r["coverage"] for r in rs]
        hv = [r["hv_ratio"] for r in rs]
        out.append({
            "sampler": kind, "budget": budget, "seeds": len(rs),
            "coverage_mean": float(np.mean(cov)), "coverage_min": min(cov),
            "coverage_max": max(cov), "hv_ratio_mean": float(np.mean(hv)),
            "hv_ratio_min": min(hv), "evaluated_mean": float(np.mean([r["evaluated"] for r in rs])),
            "asks_mean": float(np.mean([r["asks"] for r in rs])),
        })  # fmt: skip
    return out


def render_table(summary: list[dict[str, Any]]) -> str:
    """Coverage and hypervolume per budget (rows) and sampler (columns)."""
    samplers = list(dict.fromkeys(s["sampler"] for s in summary))
    budgets = sorted({s["budget"] for s in summary})
    cell = {(s["sampler"], s["budget"]): s for s in summary}
    head = f"{'budget':>6}  " + "  ".join(f"{k:>24}" for k in samplers)
    lines = ["front coverage, mean [min, max] over seeds", head]
    for b in budgets:
        cells = []
        for k in samplers:
            s = cell[(k, b)]
            cells.append(
                f"{100 * s['coverage_mean']:>6.1f}% [{100 * s['coverage_min']:3.0f}, "
                f"{100 * s['coverage_max']:3.0f}]".rjust(24)
            )
        lines.append(f"{b:>6}  " + "  ".join(cells))
    lines += ["", "hypervolume / exhaustive hypervolume, mean (min); asks per evaluation", head]
    for b in budgets:
        cells = []
        for k in samplers:
            s = cell[(k, b)]
            text = f"{s['hv_ratio_mean']:.3f} ({s['hv_ratio_min']:.3f}); "
            text += f"{s['asks_mean'] / max(s['evaluated_mean'], 1):.1f}"
            cells.append(text.rjust(24))
        lines.append(f"{b:>6}  " + "  ".join(cells))
    return "\n".join(lines)


# ---------------------------------------------------------------- sampler cost at scale
def preset_context(
    preset: str = "llama-3.1-8b",
    *,
    hardware: str = "tpu-v6e",
    context_tokens: int = 8192,
    kind: str = "per_tensor",
    quality: tuple[str, ...] = ("fidelity.kl_mean",),
):
    """A study context whose space is built on a capacity preset's shapes (no checkpoint: the
    per-tensor space of Llama-3.1-8B has 32 layers x 7 tensors + embed and lm_head), for
    measuring the capacity-aware sampler's cost per ask on a real-size space."""
    from tenantq.capacity import get_model_config
    from tenantq.search.context import StudyContext
    from tenantq.search.spec import parse_spec

    spec = parse_spec({
        "model": "reference",
        "deployment": {"hardware": hardware, "context_tokens": context_tokens, "model": preset},
        "space": {"kind": kind, "group_size": 128, "bf16_first_layers": [0, 1, 2],
                  "bf16_last_layers": [0, 1, 2]},
        "objectives": [{"metric": "tenants", "direction": "maximize"}]
        + [{"metric": m, "direction": "minimize"} for m in quality],
        "sampler": {"kind": "capacity_aware"},
        "study": {"name": "scale", "trials": 25},
    })  # fmt: skip
    config = get_model_config(preset)
    return StudyContext(spec, "", Path("."), config, config, spec.deployment.build(), None, [])


def ask_cost(context, asks: int = 10, seed: int = 0) -> dict[str, Any]:
    """Seconds per ask of the capacity-aware sampler on `context`'s space, told a synthetic
    additive loss (0.01 per int4 tensor, 0.002 per 8-bit one) and the exact tenants."""
    import optuna

    from tenantq.search.capacity_aware import sampler_for_context
    from tenantq.search.space import suggest

    began = time.perf_counter()
    sampler = sampler_for_context(context, seed=seed)
    build = time.perf_counter() - began
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    times = []
    for _ in range(asks):
        began = time.perf_counter()
        trial = study.ask()
        params = suggest(trial, context.spec.space, context.config)
        times.append(time.perf_counter() - began)
        _, b = context.plan_and_budget(params)
        loss = sum(0.01 if v == "int4" else 0.002 if v in ("int8", "fp8_e4m3") else 0.0
                   for v in params.values())  # fmt: skip
        study.tell(trial, [b.tenants, loss])
    return {
        "plans": sampler.problem.size(),
        "build_s": build,
        "ask_s_mean": float(np.mean(times)),
        "ask_s_max": float(np.max(times)),
        "asks": asks,
        "exact_bytes": all(s.exact for s in sampler.problem.sizing.values()),
    }


# ---------------------------------------------------------------- a synthetic landscape
SYNTHETIC_WEIGHT_KL = {"bf16": 0.0, "fp8_e4m3": 2e-4, "int8": 1e-4, "int4": 4e-3, "nvfp4": 3e-3,
                       "mxfp4": 6e-3}  # fmt: skip
SYNTHETIC_KV_KL = {"bf16": 0.0, "fp8_e4m3/channel": 7e-4, "fp8_e4m3/token": 7.5e-4,
                   "int4/channel": 4.7e-3, "int4/token": 7.4e-3, "nvfp4/token": 5e-3,
                   "mxfp4/token": 1.5e-2}  # fmt: skip


def synthetic_landscape(points: list[SpacePoint], seed: int) -> Landscape:
    """The 168-plan space's real tenants with a made-up KL (no evaluation): per-choice costs of
    the order the reference model shows, +30% when both weights and KV are quantized (an
    interaction the additive model cannot fit), and +-15% noise per plan from `seed`. For
    developing samplers only: figures on it are not measurements of the model."""
    import random

    rng = random.Random(seed)
    loss = {}
    for p in points:
        mlp, attn, kv = p.choice
        w = 1.6 * SYNTHETIC_WEIGHT_KL[mlp] + 0.8 * SYNTHETIC_WEIGHT_KL[attn]
        both = 1.3 if (mlp != "bf16" and SYNTHETIC_KV_KL[kv] > 0) else 1.0
        loss[p.fingerprint] = (w + SYNTHETIC_KV_KL[kv]) * both * rng.uniform(0.85, 1.15)
    return Landscape(tuple(points), loss)


# ---------------------------------------------------------------- the quickstart space
QUICKSTART_TABLE = "quickstart-measured.jsonl"  # measured plans only: no exhaustive truth


def quickstart_hypervolume(
    spec_path: str | Path = DEFAULT_SPEC,
    samplers: tuple[str, ...] = ("capacity_aware", "nsga2", "tpe"),
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4),
    budgets: tuple[int, ...] = (10, 25),
    *,
    table: str | Path,
    suite: str | Path = SUITE_PATH,
    evaluator=None,
    log=print,
) -> list[dict[str, Any]]:
    """Hypervolume of the measured front after each budget of distinct plans, per sampler and
    seed, on the quickstart spec's own space (millions of plans; no exhaustive truth).

    The spec's objectives are narrowed to tenants and `fidelity.kl_mean` on the efficiency
    suite (one compile and one forward per plan; the quick suite's needles would add a decode
    compile each). Samplers come from the driver's `make_sampler` with the study's context,
    plans and tenants from `plan_and_budget`. Every plan's KL is kept in `table` (the ground-
    truth table: shared by all runs, resumed, refused when stale), so a plan two runs reach is
    measured once. Hypervolume in (tenants, log10 KL) from 0 tenants and 0.1 decade above the
    worst KL any run measured, common to all runs."""
    import optuna

    from tenantq.search import ground_truth as truth
    from tenantq.search.context import study_context
    from tenantq.search.samplers import make_sampler
    from tenantq.search.space import suggest
    from tenantq.search.spec import load_spec

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    base = load_spec(spec_path)
    kept = [o for o in base.objectives if o.metric in ("tenants", QUALITY_METRIC)]
    spec = base.model_copy(update={"objectives": kept})
    context = study_context(spec, "")
    if evaluator is None:
        from tenantq.evals import Evaluator
        from tenantq.model.files import CACHE_DIR

        evaluator = Evaluator(context.model_path, suite, cache_dir=CACHE_DIR / "ground-truth")
    rows = truth.read_table(table, model=evaluator.identity, dataset=evaluator.dataset_hash)
    commit = truth.code_commit()
    runs = []
    new_plans = 0  # measured by this call: the compiled executables are dropped every 25
    for kind in samplers:
        for seed in seeds:
            chosen = spec.sampler.model_copy(update={"kind": kind, "seed": seed})
            sampler = make_sampler(spec.model_copy(update={"sampler": chosen}), context)
            study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
            found: dict[str, tuple[int, float]] = {}
            asks = 0
            while len(found) < max(budgets) and asks < MAX_ASKS_PER_EVALUATION * max(budgets):
                trial = study.ask()
                asks += 1
                params = suggest(trial, spec.space, context.config)
                plan, b = context.plan_and_budget(params)
                fp = plan.fingerprint()
                if fp not in rows or "error" in rows[fp]:  # a failed row: measured again
                    if new_plans and new_plans % truth.RELEASE_EVERY == 0:  # see ground_truth
                        truth.release_compiled()
                    new_plans += 1
                    began = time.perf_counter()
                    result = evaluator.evaluate(plan)
                    point = SpacePoint(tuple(f"{k}={v}" for k, v in sorted(params.items())),
                                       fp, b.tenants, "")  # fmt: skip
                    row = truth.row_for(point, result.summary, evaluator.identity,
                                        evaluator.dataset_hash, commit,
                                        time.perf_counter() - began)  # fmt: skip
                    # one plan per write (minutes each), merged with rows other runs wrote
                    rows = truth.merge_into_table(table, {fp: row}, model=evaluator.identity,
                                                  dataset=evaluator.dataset_hash)  # fmt: skip
                kl = rows[fp]["metrics"][QUALITY_METRIC]
                found.setdefault(fp, (b.tenants, kl))
                study.tell(trial, [b.tenants, kl])
            log(f"{kind} seed {seed}: {len(found)} distinct plans in {asks} asks")
            runs.append({"sampler": kind, "seed": seed, "found": list(found.values())})
    ref = hv_reference([point for r in runs for point in r["found"]])
    return [{"sampler": r["sampler"], "seed": r["seed"], "budget": budget,
             "evaluated": len(r["found"][:budget]),
             "hypervolume": hypervolume(r["found"][:budget], ref)}
            for r in runs for budget in budgets]  # fmt: skip
