"""The study context: a spec checked once against its model, space, suites and stores.

`study_context` is the one place a run's checks are called (`tenantq search --check` calls the
same), and the StudyContext it returns carries what every other part needs (`plan_and_budget`,
the study's content identity), so that samplers and the driver never re-check or import each
other.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from tenantq.search.objectives import CapacityObjective
from tenantq.search.space import (
    SensitivityProfile,
    baseline_params,
    parameter_choices,
    plan_from_params,
)
from tenantq.search.spec import CAPACITY_METRIC, CAPACITY_METRICS, ExperimentSpec, wants_baselines


@dataclass
class StudyContext:
    """Everything derived from the spec before anything is written anywhere: the checked
    spec, the model and deployment, and `plan_and_budget`, the one way params become a plan
    and its exact tenants (the driver, the samplers and the bench all call it)."""

    spec: ExperimentSpec
    spec_text: str
    model_path: Path
    config: Any
    capacity_config: Any
    deployment: Any
    profile: SensitivityProfile | None
    baselines: list[dict[str, Any]]

    @cached_property
    def capacity(self) -> CapacityObjective:
        """What the capacity value of a trial is in this study (tenants by memory, or at the
        spec's service level); samplers call `capacity.tenants(plan, budget)`."""
        return CapacityObjective.for_spec(self.spec, self.capacity_config, self.deployment)

    def plan_and_budget(self, params: dict[str, Any]):
        """(plan, budget) of the trial parameters `params`; ValueError on a plan the model
        cannot take."""
        spec = self.spec
        plan = plan_from_params(
            spec.space, params, self.config, algorithm=spec.calibration.algorithm,
            profile=self.profile,
        )  # fmt: skip
        return plan, self.budget_of(plan)

    def budget_of(self, plan):
        """The capacity budget of `plan` on the study's deployment (no worker needed)."""
        from tenantq.capacity import budget

        return budget(
            self.capacity_config, plan, self.deployment, self.spec.deployment.context_tokens
        )

    def identity(self) -> dict[str, str]:
        """What the study measures, by content: the spec (less the fields a resume may
        change), the model folder, the suites; and the code version (recorded, not compared:
        see `store.check_identity`)."""
        from tenantq.evals.identity import cache_key, config_key_digests, model_identity
        from tenantq.evals.suite import load_suite
        from tenantq.tracking import code_version

        spec = self.spec.model_dump(mode="json")
        spec["study"].pop("trials", None)
        spec["workers"].pop("count", None)
        suites = {"eval.suite": self.spec.eval.suite}
        if self.spec.eval.confirm_suite:
            suites["eval.confirm_suite"] = self.spec.eval.confirm_suite
        loaded = {k: load_suite(v) for k, v in suites.items()}
        return {
            "spec": cache_key(spec=spec),
            "model": model_identity(self.model_path),
            **{k: cache_key(suite=s.model_dump(mode="json")) for k, s in loaded.items()},
            "code": code_version(),
            "files": self._file_digests(loaded),
            "config_keys": config_key_digests(self.model_path / "config.json"),
        }

    def _file_digests(self, suites: dict[str, Any]) -> dict[str, str]:
        """One content digest per input file: the model folder's files (by name, not path),
        the suites' fidelity text files, calibration.data and space.profile."""
        from tenantq.evals.identity import file_digest, model_file_digests

        out = {f"model/{k}": v for k, v in model_file_digests(self.model_path).items()}
        for key, suite in suites.items():
            source = suite.fidelity.source if suite.fidelity is not None else None
            if source and Path(source).is_file():
                out[f"{key} fidelity.source"] = file_digest(source)
        for key, path in (
            ("calibration.data", self.spec.calibration.data),
            ("space.profile", getattr(self.spec.space, "profile", None)),
        ):
            if path and Path(path).is_file():
                out[key] = file_digest(path)
        return out


_Prepared = StudyContext  # the name before the split


def study_context(spec: ExperimentSpec, spec_text: str = "") -> StudyContext:
    """The run's checks, all in one place (`--check` calls this too): the spec against the
    model, the space, the suites and the stores. Raises ValueError; writes nothing."""
    from tenantq.capacity import get_model_config
    from tenantq.model.config import ModelConfig
    from tenantq.search.checks import check_study

    model_path = spec.model_path()
    if not (model_path / "config.json").is_file():
        hint = "; this spec needs a local checkpoint" if spec.requires else ""
        raise ValueError(f"model: {model_path} has no config.json{hint}")
    config = ModelConfig.from_file(model_path / "config.json")
    data = spec.calibration.data
    if data is not None and not Path(data).is_file():
        raise ValueError(
            f"calibration.data: {data} is not a file; give a .txt, .jsonl or .parquet file "
            "of calibration text, or leave it out for the reference model's train split"
        )
    capacity_config = get_model_config(spec.deployment.model) if spec.deployment.model else config
    deployment = spec.deployment.build()
    capacity_config.check_tensor_parallel(deployment.chips, valid_name="deployment.chips values")
    profile = (
        SensitivityProfile.load(spec.space.profile, config)
        if spec.space.kind == "sensitivity"
        else None
    )
    parameter_choices(spec.space, config, profile)  # raises on choices the model cannot take
    check_metrics(spec)
    check_stores(spec)
    check_study(spec, config, profile)  # tenantq.search.checks: the model-aware checks
    if spec.study.trial_timeout is not None and not (
        spec.quality_objectives() or spec.eval.confirm_suite
    ):
        print(
            f"tenantq search: study.trial_timeout = {spec.study.trial_timeout:g} has no effect: "
            "a capacity-only study runs no worker (every figure is arithmetic in the driver)",
            file=sys.stderr,
        )
    baselines = baseline_params(spec.space, config, profile) if wants_baselines(spec) else []
    return StudyContext(
        spec, spec_text, model_path, config, capacity_config, deployment, profile, baselines
    )


def check_metrics(spec: ExperimentSpec) -> None:
    """Objectives and constraints name metrics the spec's suites report (`suite_metrics`):
    a misspelt one is an error now, not a failure of every trial. The confirmation suite
    must report the objectives too (the front is re-measured on it)."""
    import difflib

    from tenantq.evals.suite import load_suite, suite_metrics

    where = [("eval.suite", spec.eval.suite)]
    if spec.eval.confirm_suite:
        where.append(("eval.confirm_suite", spec.eval.confirm_suite))
    for key_name, name in where:
        try:
            suite = load_suite(name)
        except ValueError as err:
            raise ValueError(f"{key_name}: {err}") from None
        metrics = suite_metrics(suite)
        named = [
            (f"objectives.{i}.metric", o.metric)
            for i, o in enumerate(spec.objectives)
            if o.metric not in CAPACITY_METRICS
        ]
        if key_name == "eval.suite":  # constraints are checked on the search suite's results
            named += [
                (f"constraints.{i}", c.metric if c.bound == "value" else f"{c.metric}.{c.bound}")
                for i, c in enumerate(spec.constraints or [])
            ]
        for key, metric in named:
            if metric in metrics:
                continue
            close = difflib.get_close_matches(metric, [*metrics, CAPACITY_METRIC], n=3)
            hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
            # the headline deltas (each also has .ci_low/.ci_high), not all of them
            deltas = [
                m
                for m in metrics
                if m in ("fidelity.kl_mean", "fidelity.top1_agree_delta", "fidelity.ppl_ratio")
                or (".acc_delta" in m and not m.endswith(("ci_low", "ci_high", "noise_floor")))
            ]
            raise ValueError(
                f"{key}: suite {suite.name!r} ({key_name}) does not report {metric!r}; {hint}"
                f"its deltas are {', '.join(deltas)} ({len(metrics)} metrics in all, with "
                f"their .ci_low/.ci_high), and the capacity objective is {CAPACITY_METRIC!r}"
            )


# MLflow URIs that are SQLAlchemy database URLs (the rest: files, servers, Databricks).
_MLFLOW_DB_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def _check_database_url(url: str, key: str, what: str) -> None:
    """A SQLAlchemy URL whose dialect and driver load here, and for a sqlite file, whose
    folder exists; checked without connecting or creating anything."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    forms = "sqlite:///FILE.db, postgresql://USER@HOST/DB or mysql://USER@HOST/DB"
    try:
        parsed = make_url(url)
        dialect = parsed.get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError):
        raise ValueError(
            f"{key}: {url!r} is not a database URL {what} can use; write {forms}"
        ) from None
    try:
        dialect.import_dbapi()
    except ImportError as err:
        raise ValueError(
            f"{key}: {url!r} needs the {parsed.get_backend_name()} driver, which is not "
            f"installed ({err}); install it, or use {forms}"
        ) from None
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        folder = Path(parsed.database).expanduser().absolute().parent
        if what == "Optuna" and not folder.is_dir():  # sqlite creates the file, not folders
            raise ValueError(
                f"{key}: the folder of {parsed.database!r} ({folder}) does not exist; create "
                "it, or give a sqlite:/// path in an existing folder"
            )


def check_stores(spec: ExperimentSpec) -> None:
    """`study.storage` is an Optuna RDB URL and `tracking.uri` a URI MLflow takes, checked
    before either store is opened, so that a typo in one does not leave the other written."""
    _check_database_url(spec.study.storage, "study.storage", "Optuna")
    uri = spec.tracking.uri
    scheme = uri.split(":", 1)[0] if "://" in uri or uri.startswith("sqlite:") else ""
    if scheme.split("+")[0] in _MLFLOW_DB_SCHEMES:
        _check_database_url(uri, "tracking.uri", "MLflow")
        return
    from tenantq.tracking import check_tracking_uri

    check_tracking_uri(uri, "tracking.uri")
