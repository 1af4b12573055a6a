"""A study read back from MLflow alone: the parent run, its nested trial runs and their artifacts.

The report never asks the driver or Optuna; everything comes from the tracking store at any
URI, in the layout `tenantq.tracking` writes (dashboards/README.md): a parent run tagged
`tenantq.kind=study`, nested runs tagged `tenantq.kind=trial` with the flattened plan as params,
metrics with `.ci_low`/`.ci_high`, and artifacts loaded only when a figure needs them.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

PARENT_TAG = "mlflow.parentRunId"
CAPACITY_METRIC = "tenants"  # the objective the driver computes (tenantq.search.spec)
SLO_METRIC = "tenants_at_slo"  # the capacity at `[deployment] slo` (tenantq.search.spec)
TENANTS_KEY = "capacity.tenants"


@dataclass
class TrialRecord:
    """One nested trial run as MLflow holds it."""

    number: int
    run_id: str
    status: str  # MLflow run status: FINISHED, FAILED, ...
    params: dict[str, str]
    metrics: dict[str, float]
    tags: dict[str, str]
    # when the driver logged the run (a trial's run is created at its end); None when the
    # store gave no start time (such a trial is left off the timeline)
    logged_ms: int | None
    client: Any = field(repr=False, default=None)
    # the metric holding the study's capacity value (`StudyRecord.capacity_key`)
    capacity_key: str = TENANTS_KEY
    _downloaded: dict[str, bytes] = field(repr=False, default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.status == "FAILED"

    @property
    def tenants(self) -> float | None:
        """The study's capacity value: tenants by memory, or at the SLO when the study's
        capacity objective is `tenants_at_slo`."""
        return self.metrics.get(self.capacity_key)

    @property
    def tenants_by_memory(self) -> float | None:
        return self.metrics.get(TENANTS_KEY)

    @property
    def on_front(self) -> bool:
        return self.tags.get("tenantq.pareto") == "true"

    @property
    def shippable(self) -> bool:
        return self.tags.get("tenantq.shippable") == "true"

    @property
    def duplicate_of(self) -> int | None:
        d = self.tags.get("tenantq.duplicate_of")
        return int(d) if d else None

    @property
    def fingerprint(self) -> str:
        return self.params.get("plan.fingerprint", "")

    @property
    def is_bf16(self) -> bool:
        """Every weight class and both KV formats in bf16: the baseline every delta is against."""
        weights = [v for k, v in self.params.items() if k.startswith("weights.")]
        return (
            bool(weights)
            and all(v in ("bf16", "absent") for v in weights)
            and self.params.get("kv.key_format") == "bf16"
            and self.params.get("kv.value_format") == "bf16"
        )

    @property
    def is_baseline(self) -> bool:
        """A baseline: tagged so, or a uniform plan (one weight format, one KV format)."""
        if self.tags.get("tenantq.baseline") == "true":
            return True
        weights = {v for k, v in self.params.items() if k.startswith("weights.") and v != "absent"}
        kv = {self.params.get("kv.key_format"), self.params.get("kv.value_format")}
        return len(weights) == 1 and len(kv) == 1 and self.params.get("kv.bf16_layers") == "none"

    def plan_summary(self) -> str:
        """The flattened plan on a few lines (for hover text and tables)."""
        w = ", ".join(
            f"{k.removeprefix('weights.')}={v}"
            for k, v in sorted(self.params.items())
            if k.startswith("weights.")
        )
        p = self.params
        kv = (
            f"K {p.get('kv.key_format', '?')}/{p.get('kv.key_axis', '?')}, "
            f"V {p.get('kv.value_format', '?')}/{p.get('kv.value_axis', '?')}, "
            f"sinks {p.get('kv.sink_tokens', '?')}, bf16 layers {p.get('kv.bf16_layers', '?')}"
        )
        return f"weights: {w}\nKV: {kv}"

    def gate_words(self) -> str:
        """Each gate's verdict and two-sided `changed` flag, one gate a line, in the words the
        evaluator wrote (tags `tenantq.verdict.<metric>`, `tenantq.changed.<metric>`)."""
        lines = []
        for key, word in sorted(self.tags.items()):
            if key.startswith("tenantq.verdict."):
                metric = key.removeprefix("tenantq.verdict.")
                flag = self.tags.get(f"tenantq.changed.{metric}", "?")
                lines.append(f"{metric}: {word}; changed: {flag}")
        return "\n".join(lines)

    def warnings(self) -> dict[str, str]:
        """The suite's warnings about this trial's tasks (tags `tenantq.warning.<group>`)."""
        return {
            k.removeprefix("tenantq.warning."): v
            for k, v in self.tags.items()
            if k.startswith("tenantq.warning.")
        }

    def metric_ci(self, metric: str) -> tuple[float, float | None, float | None] | None:
        if metric not in self.metrics:
            return None
        return (
            self.metrics[metric],
            self.metrics.get(f"{metric}.ci_low"),
            self.metrics.get(f"{metric}.ci_high"),
        )

    @cached_property
    def _artifacts(self) -> set[str]:
        return {a.path for a in self.client.list_artifacts(self.run_id)}

    def artifact_names(self) -> set[str]:
        return self._artifacts

    def artifact_json(self, name: str) -> Any | None:
        text = self._artifact_bytes(name)
        return None if text is None else json.loads(text)

    def artifact_table(self, name: str):
        """A Parquet artifact as a pyarrow Table, or None when the run has none."""
        import io

        import pyarrow.parquet as pq

        data = self._artifact_bytes(name)
        return None if data is None else pq.read_table(io.BytesIO(data))

    def _artifact_bytes(self, name: str) -> bytes | None:
        if name not in self.artifact_names():
            return None
        if name not in self._downloaded:
            with tempfile.TemporaryDirectory() as tmp:
                local = self.client.download_artifacts(self.run_id, name, tmp)
                self._downloaded[name] = Path(local).read_bytes()
        return self._downloaded[name]


@dataclass
class StudyRecord:
    """The parent run of one study and its trials, in trial order."""

    tracking_uri: str
    experiment: str
    name: str
    parent_run_id: str
    params: dict[str, str]
    metrics: dict[str, float]
    trials: list[TrialRecord]
    client: Any = field(repr=False, default=None)

    def __post_init__(self) -> None:
        for t in self.trials:  # every figure and table reads the capacity the study used
            t.capacity_key = self.capacity_key

    @cached_property
    def spec_text(self) -> str:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                local = self.client.download_artifacts(self.parent_run_id, "spec.toml", tmp)
            except Exception:  # an older study without the spec artifact
                return ""
            return Path(local).read_text()

    @property
    def objectives(self) -> list[tuple[str, str]]:
        """(direction, metric) in the spec's order, from the parent's `objectives` param."""
        out = []
        for part in self.params.get("objectives", "").split(","):
            words = part.split()
            if len(words) == 2:
                out.append((words[0], words[1]))
        return out

    @property
    def capacity_metric(self) -> str:
        """The capacity the study used: its capacity objective, else the parent's
        `capacity.metric` param (a study with no capacity objective), else `tenants`."""
        named = [m for _, m in self.objectives if m in (CAPACITY_METRIC, SLO_METRIC)]
        return named[0] if named else self.params.get("capacity.metric") or CAPACITY_METRIC

    @property
    def capacity_key(self) -> str:
        return f"capacity.{self.capacity_metric}"

    @property
    def capacity_label(self) -> str:
        """`tenants`, or `tenants at 20 tok/s`: the spec's slo read as a rate and written as
        `tenantq search` writes it (`CapacityObjective.label`), however the spec spelled it."""
        if self.capacity_metric == CAPACITY_METRIC:
            return "tenants"
        slo = self.params.get("deployment.slo")
        if not slo:
            return "tenants at the SLO"
        from tenantq.capacity.roofline import parse_slo

        try:
            return f"tenants at {parse_slo(slo):g} tok/s"
        except ValueError:  # a logged param the spec checks would refuse: show it as written
            return f"tenants at {slo}"

    @property
    def quality_metrics(self) -> list[str]:
        """The quality objectives, or every metric with CI bounds when the parent lacks them."""
        named = [m for _, m in self.objectives if m not in (CAPACITY_METRIC, SLO_METRIC)]
        if named:
            return named
        seen = {
            k[: -len(".ci_high")] for t in self.trials for k in t.metrics if k.endswith(".ci_high")
        }
        return sorted(m for m in seen if not m.startswith("confirmed."))

    @property
    def completed(self) -> list[TrialRecord]:
        return [t for t in self.trials if not t.failed and t.tenants is not None]

    @property
    def bf16(self) -> TrialRecord | None:
        return next((t for t in self.completed if t.is_bf16), None)

    def _completed_numbers(self) -> str:
        return ", ".join(str(t.number) for t in self.completed) or "none"

    def choose_trial(self, number: int | None = None) -> TrialRecord | None:
        """Trial `number`, else the shippable front trial with the most tenants (then the front,
        then any completed non-bf16 trial)."""
        if number is not None:
            for t in self.trials:
                if t.number == number:
                    if t.failed:
                        raise ValueError(f"--trial {number} failed; choose a completed trial")
                    if t.tenants is None:  # running or killed: no capacity figure to show
                        raise ValueError(
                            f"--trial {number} has not completed ({t.status}); choose a "
                            f"completed trial: {self._completed_numbers()}"
                        )
                    return t
            have = self._completed_numbers()
            raise ValueError(f"--trial {number} is not in study {self.name!r}; completed: {have}")
        pools = (
            [t for t in self.completed if t.on_front and t.shippable and not t.is_bf16],
            [t for t in self.completed if t.on_front and not t.is_bf16],
            [t for t in self.completed if not t.is_bf16],
            self.completed,
        )
        for pool in pools:
            if pool:
                return max(pool, key=lambda t: (t.tenants or 0, -t.number))
        return None


def experiment_names(client) -> list[str]:
    return sorted(e.name for e in client.search_experiments())


def load_study(tracking_uri: str, experiment: str, study: str | None = None) -> StudyRecord:
    """Read a study from MLflow; a missing experiment or study is a one-line ValueError naming
    the ones that exist. Without `study`, the experiment's latest study run is read."""
    from mlflow import MlflowClient

    from tenantq.tracking import check_tracking_uri

    check_tracking_uri(tracking_uri, "--tracking-uri")
    if tracking_uri.startswith("sqlite:///"):  # reading must not create an empty store
        from sqlalchemy.engine import make_url

        database = make_url(tracking_uri).database
        if database and database != ":memory:" and not Path(database).is_file():
            raise ValueError(
                f"--tracking-uri: no MLflow store at {tracking_uri} ({database} does not "
                "exist); give the tracking.uri the study ran with (default sqlite:///mlflow.db, "
                "in the folder the study ran in)"
            )
    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = ", ".join(experiment_names(client)) or "none"
        raise ValueError(
            f"no experiment {experiment!r} in {tracking_uri}; experiments there: {names}"
        )
    parents = client.search_runs(
        [exp.experiment_id],
        filter_string="tags.`tenantq.kind` = 'study'",
        order_by=["attributes.start_time DESC"],
        max_results=1000,
    )
    if study is not None:
        parents = [p for p in parents if p.data.params.get("study.name") == study]
    if not parents:
        found = client.search_runs(
            [exp.experiment_id], filter_string="tags.`tenantq.kind` = 'study'", max_results=1000
        )
        names = ", ".join(sorted({p.data.params.get("study.name", "?") for p in found})) or "none"
        what = f"study {study!r}" if study else "study run (tags.tenantq.kind = 'study')"
        raise ValueError(f"experiment {experiment!r} has no {what}; studies there: {names}")
    parent = parents[0]
    runs = client.search_runs(
        [exp.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'",
        max_results=50000,
    )
    trials = [
        TrialRecord(
            number=int(r.data.tags.get("tenantq.trial", -1)),
            run_id=r.info.run_id,
            status=r.info.status,
            params=dict(r.data.params),
            metrics=dict(r.data.metrics),
            tags=dict(r.data.tags),
            logged_ms=None if r.info.start_time is None else int(r.info.start_time),
            client=client,
        )
        for r in runs
        if r.data.tags.get("tenantq.kind") == "trial"
        # a trial the study closed unrun (the budget filled while it waited) measured
        # nothing: neither a result nor a failure to draw
        and r.data.tags.get("tenantq.failure_reason") != "not_run"
    ]
    trials.sort(key=lambda t: t.number)
    return StudyRecord(
        tracking_uri=tracking_uri,
        experiment=experiment,
        name=parent.data.params.get("study.name") or parent.info.run_name or parent.info.run_id,
        parent_run_id=parent.info.run_id,
        params=dict(parent.data.params),
        metrics=dict(parent.data.metrics),
        trials=trials,
        client=client,
    )
