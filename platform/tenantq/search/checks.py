"""The study's checks that need the model and the deployment, in one function (`check_study`).

`tenantq search --check` and the run call the same function, so a spec `--check` accepts
is a spec the run starts: the deployment's context against the model's positions, a memory
that holds some plan of the space, the capacity_aware sampler's needs, the suites against
the model, and the stores' files. Options the chosen sampler or space ignores are warnings
naming them (`IgnoredOptionWarning`), not errors: the study still means what it says.
"""

from __future__ import annotations

import warnings

from tenantq.search.spec import ExperimentSpec


class IgnoredOptionWarning(UserWarning):
    """A spec value that changes nothing for the chosen sampler or space (named, not fatal)."""


def check_study(spec: ExperimentSpec, config=None, profile=None) -> list[str]:
    """Raise one ValueError line for a study that cannot run as written; warn (and return the
    warnings) for values that would be ignored. `config`: the study model's `ModelConfig`
    (read from `spec.model` when None); `profile`: its `SensitivityProfile`, if any."""
    from tenantq.model.config import ModelConfig

    if config is None:
        config = ModelConfig.from_file(spec.model_path() / "config.json")
    _check_checkpoint(spec, config)
    _check_context(spec, config)
    _check_calibration(spec, config)
    if spec.space.kind != "sensitivity" or profile is not None:
        from tenantq.search.space import parameter_choices

        parameter_choices(spec.space, config, profile)  # choices the model cannot take
    _check_some_plan_fits(spec, config)
    _check_suites(spec, config)
    _check_capacity_aware(spec, config, profile)
    if not spec.quality_objectives() and spec.constraints:
        raise ValueError(
            "constraints: a capacity-only study (objective 'tenants' only) measures no quality, "
            "so every trial would fail its constraints; add a quality objective or remove them"
        )
    check_store_files(spec)
    ignored = ignored_options(spec)
    for message in ignored:
        warnings.warn(message, IgnoredOptionWarning, stacklevel=2)
    return ignored


def _check_checkpoint(spec: ExperimentSpec, config) -> None:
    """The model's safetensors headers against its config.json (names, shapes, dtypes: the
    loader's own `check_checkpoint`, no tensor data read), so a broken checkpoint is the
    loader's one line at `--check`, not a worker's failure after the stores exist. NaN/inf
    weights need the data: the workers' load reports them."""
    from tenantq.model.loader import check_checkpoint

    try:
        check_checkpoint(spec.model_path(), config)
    except ValueError as err:
        raise ValueError(f"model: {err}") from None


def _check_context(spec: ExperimentSpec, config) -> None:
    """A tenant's context and its sink tokens within the model's positions."""
    limit = config.max_position_embeddings
    context = spec.deployment.context_tokens
    if context > limit:
        raise ValueError(
            f"deployment.context_tokens: {context} exceeds the model's "
            f"max_position_embeddings of {limit} (config.json); use at most {limit}"
        )
    over = [n for n in spec.space.sink_tokens if n > limit]
    if over:
        raise ValueError(
            f"space.sink_tokens: choices {over} exceed the model's context of {limit} tokens"
        )


def _check_calibration(spec: ExperimentSpec, config) -> None:
    """Calibration windows within the model's positions, and the calibration text (when the
    spec names one) a file holding the windows asked for: the workers' own draw
    (`evals.windows.calibration_windows`: the same reading, tokenizing and count), so
    the error is theirs, at `--check`. The file is tokenized only until it holds 4x what is
    drawn."""
    cal = spec.calibration
    limit = config.max_position_embeddings
    if cal.sequence_tokens > limit:
        raise ValueError(
            f"calibration.sequence_tokens: {cal.sequence_tokens} exceeds the model's "
            f"max_position_embeddings of {limit} (config.json); use at most {limit}"
        )
    if cal.data is None:
        return  # the reference train split
    from tenantq.evals.windows import calibration_windows
    from tenantq.model.tokenizer import require_tokenizer

    try:
        tokenizer = require_tokenizer(spec.model_path(), config.vocab_size)
        calibration_windows(
            tokenizer, config, source=cal.data, num_sequences=cal.sequences,
            seq_tokens=cal.sequence_tokens,
        )  # fmt: skip
    except ValueError as err:
        raise ValueError(f"calibration.data: {err}") from None


def _cheapest(formats: list[str]) -> list[str]:
    """The formats of fewest bits per element (ties kept: their scales differ)."""
    from tenantq.numerics import get_format

    bits = min(get_format(f).element_bits for f in formats)
    return sorted({f for f in formats if get_format(f).element_bits == bits})


def _check_some_plan_fits(spec: ExperimentSpec, config) -> None:
    """Some plan of the space holds a tenant: every tensor in one of the space's cheapest
    formats, no bf16 layers and no sinks, bounds the space's plans' bytes from below; when
    none of those fits a tenant, every trial would report 0."""
    from tenantq.capacity import budget, get_model_config
    from tenantq.quant.plan import QuantPlan

    space = spec.space
    weight_choices = _cheapest(list(space.weight_formats) + list(space.embed_formats or []))
    kv_choices = _cheapest(list(space.key_formats) + list(space.value_formats))
    capacity_config = get_model_config(spec.deployment.model) if spec.deployment.model else config
    deployment = spec.deployment.build()
    reasons = []
    for weights in weight_choices:
        for kv in kv_choices:
            try:
                plan = QuantPlan.uniform(weights, kv, group_size=space.group_size)
            except ValueError:  # a group the format does not take (e.g. a cast format)
                plan = QuantPlan.uniform(weights, kv)
            b = budget(capacity_config, plan, deployment, spec.deployment.context_tokens)
            if b.tenants > 0:
                return
            reasons.append(b.reason)
    raise ValueError(
        f"deployment: no plan of the space fits a tenant of {spec.deployment.context_tokens} "
        f"tokens even with every weight in {'/'.join(weight_choices)} and the KV cache in "
        f"{'/'.join(kv_choices)} ({reasons[0]}); give more memory or chips, or a shorter "
        "deployment.context_tokens"
    )


def _check_suites(spec: ExperimentSpec, config) -> None:
    from tenantq.evals.suite import check_suite_for_model, load_suite

    if not spec.quality_objectives() and not spec.eval.confirm_suite:
        return  # a capacity-only study runs no suite
    for key, name in (
        ("eval.suite", spec.eval.suite),
        ("eval.confirm_suite", spec.eval.confirm_suite),
    ):
        if name:
            try:
                suite = load_suite(name)
                check_suite_for_model(suite, config, "suite")
                _check_suite_data(suite)
            except ValueError as err:
                raise ValueError(f"{key}: {err}") from None


def _check_suite_data(suite) -> None:
    """A suite's own fidelity text (a file, not the shipped split) is readable and holds text:
    the evaluator's `load_documents`, at `--check` instead of in every worker."""
    from tenantq.evals.data import REFERENCE_TEST, load_documents

    f = suite.fidelity
    if f is not None and f.source != REFERENCE_TEST:
        try:
            load_documents(f.source, f.text_field)
        except ValueError as err:
            raise ValueError(f"suite {suite.name!r}: fidelity.source: {err}") from None


def _check_capacity_aware(spec: ExperimentSpec, config, profile) -> None:
    """capacity_aware ranks plans by a quality objective (any space size: its capacity side
    is a knapsack, not an enumeration)."""
    if spec.sampler.kind != "capacity_aware":
        return
    if not spec.quality_objectives():
        raise ValueError(
            "sampler.kind: 'capacity_aware' needs a quality objective besides 'tenants' "
            "(it measures the plan predicted to improve the front most); add one, or use "
            "'random' or 'grid' for a capacity-only study"
        )


# Space fields and the space kinds that read them (search.space.parameter_choices); set on
# another kind, a field is a warning naming it.
SPACE_FIELD_KINDS = {
    "uniform_weights": ("structured",),
    "bf16_first_layers": ("structured",),
    "bf16_last_layers": ("structured",),
    "embed_formats": ("structured", "per_tensor"),
    "profile": ("sensitivity",),
    "max_keep_bf16": ("sensitivity",),
}
# Needle variants that read `count` (reference.needles.build_needle: distractors or values).
COUNTED_NEEDLES = ("multikey", "multivalue")


def ignored_options(spec: ExperimentSpec) -> list[str]:
    """Values the chosen sampler, space or suite never reads, each named with why (written
    in the spec and different from the default: a default that changes nothing is silent)."""
    out = []
    kind = spec.sampler.kind
    population = spec.sampler.population_size
    if population is not None and kind != "nsga2":
        out.append(
            f"sampler.population_size = {population} is ignored: only the "
            f"'nsga2' sampler has a population (sampler.kind is {kind!r})"
        )
    elif population is not None and population > spec.study.trials:
        out.append(
            f"sampler.population_size = {population} is more than study.trials = "
            f"{spec.study.trials}: NSGA-II never finishes its first (random) generation, so "
            "the study is a random search; lower it or ask for more trials"
        )
    space = spec.space
    for key, kinds in SPACE_FIELD_KINDS.items():
        value, default = (
            getattr(space, key),
            type(space).model_fields[key].get_default(call_default_factory=True),
        )
        if key == "profile" and space.kind == "per_tensor" and kind == "capacity_aware":
            continue  # the capacity-aware sampler's prior (capacity_aware.profile_prior)
        if space.kind not in kinds and key in space.model_fields_set and value != default:
            applies = " or ".join(repr(k) for k in kinds)
            also = (
                ", or to 'per_tensor' with the 'capacity_aware' sampler (its prior)"
                if key == "profile"
                else ""
            )
            out.append(
                f"space.{key} = {value!r} is ignored: it applies to space.kind = {applies}"
                f"{also} (this space is {space.kind!r}, sampler.kind {kind!r})"
            )
    out += _ignored_suite_options(spec)
    return out


def _ignored_suite_options(spec: ExperimentSpec) -> list[str]:
    from tenantq.evals.suite import load_suite

    out = []
    for key, name in (
        ("eval.suite", spec.eval.suite),
        ("eval.confirm_suite", spec.eval.confirm_suite),
    ):
        if not name:
            continue
        try:
            suite = load_suite(name)
        except ValueError:
            continue  # named by the suite checks
        for i, n in enumerate(suite.needles):
            if "count" in n.model_fields_set and n.variant not in COUNTED_NEEDLES:
                out.append(
                    f"{key}: suite {suite.name!r} needles.{i}.count = {n.count} is ignored: "
                    f"only {' and '.join(COUNTED_NEEDLES)} needles have a count (variant is "
                    f"{n.variant!r})"
                )
    return out


# ---------------------------------------------------------------- stores
def check_store_files(spec: ExperimentSpec) -> None:
    """Both stores' sqlite files (Optuna's `study.storage`, MLflow's `tracking.uri`)."""
    from tenantq.tracking import check_sqlite_file

    for url, key in ((spec.study.storage, "study.storage"), (spec.tracking.uri, "tracking.uri")):
        check_sqlite_file(url, key)
        _check_sqlite_folder(url, key)
        _check_not_locked(url, key)


def _check_sqlite_folder(url: str, key: str) -> None:
    """sqlite creates a database file, never its folder: a missing one would fail only when
    the store is opened (MLflow's after Optuna's was written, or the other way round)."""
    from tenantq.tracking.runs import sqlite_file

    path = sqlite_file(url)
    if path is not None and not path.absolute().parent.is_dir():
        raise ValueError(
            f"{key}: the folder of {str(path)!r} ({path.absolute().parent}) does not exist; "
            "create it, or give a sqlite:/// path in an existing folder"
        )


# How long the check waits for another process's write to end (Optuna and MLflow write in
# short transactions; a store held longer is another study's run, or a crashed lock).
LOCK_WAIT_S = 2.0


def _check_not_locked(url: str, key: str) -> None:
    """An existing sqlite store another process holds locked would fail after the other
    store was created: take the write lock (`BEGIN IMMEDIATE`) and give it back, writing
    nothing (sqlite3 is Python's own; SQLAlchemy would do the same through it)."""
    import sqlite3

    from tenantq.tracking.runs import sqlite_file

    path = sqlite_file(url)
    if path is None or not path.is_file() or path.stat().st_size == 0:
        return
    try:
        con = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=LOCK_WAIT_S)
    except sqlite3.Error as err:
        raise ValueError(f"{key}: cannot open {path} ({err})") from None
    try:
        con.isolation_level = None  # no implicit transaction: the BEGIN below is the only one
        con.execute("BEGIN IMMEDIATE")
        con.execute("ROLLBACK")
    except sqlite3.OperationalError as err:
        raise ValueError(
            f"{key}: {path} is locked by another process ({err}, after {LOCK_WAIT_S:g} s); "
            "wait for the other study or command to end, or use another file"
        ) from None
    finally:
        con.close()


def check_resumable(spec: ExperimentSpec) -> None:
    """`--resume` of a study its sqlite store does not hold (or a store that does not exist):
    an error before MLflow's store is opened, so the failed resume creates no empty one."""
    from tenantq.tracking.runs import sqlite_file

    path = sqlite_file(spec.study.storage)
    if path is None:
        return  # a server: the run asks it, before MLflow is written
    if not path.exists():
        raise ValueError(
            f"--resume: study.storage {spec.study.storage!r} does not exist ({path}), so it "
            f"holds no study {spec.study.name!r}; run without --resume to start it"
        )
    import optuna

    from tenantq.tracking import check_sqlite_file

    check_sqlite_file(spec.study.storage, "study.storage")
    names = optuna.study.get_all_study_names(spec.study.storage)
    if spec.study.name not in names:
        raise ValueError(
            f"--resume: no study {spec.study.name!r} in {spec.study.storage}; studies there: "
            f"{', '.join(names) or 'none'}"
        )


def no_trial_completed(counts: dict[str, int]) -> str | None:
    """The one line `tenantq search` ends with when the study has no completed trial."""
    if counts.get("complete", 0) > 0:
        return None
    return (
        f"no trial completed ({counts.get('failed', 0)} failed); the front is empty. The "
        "trials' errors are in MLflow (each failed trial's run) and in the study's trial "
        "user attrs 'error'"
    )
