"""The experiment spec (`experiments/*.toml`): everything one study needs, validated up front.

A spec names the model, the deployment the capacity objective is computed for, the search
space, objectives and constraints, the eval suite, the sampler, trials, workers, and where
Optuna and MLflow store the study. pydantic checks it before anything is written anywhere;
`load_spec` turns every mistake into one line naming the key and the valid choices.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tenantq.model.checks import validation_line
from tenantq.model.files import CACHE_DIR
from tenantq.quant.calibration_set import CalibrationData
from tenantq.quant.plan import (
    ALGORITHM_NAMES,
    FORMAT_NAMES,
    KV_AXES,
    KV_FORMAT_NAMES,
    KV_SCALE_DTYPES,
)

REFERENCE_MODEL = "reference"  # the shipped checkpoint (tenantq.reference.reference_model_path)
SAMPLERS = ("nsga2", "tpe", "gp", "random", "grid", "capacity_aware")
SPACE_KINDS = ("structured", "per_tensor", "sensitivity")
KV_BF16_LAYER_CHOICES = ("none", "first", "last", "first_last")
# The capacity objective the driver computes itself (exact, no accelerator).
CAPACITY_METRIC = "tenants"
# The capacity at a service level (`[deployment] slo`): min(tenants by memory, tenants whose
# decode rate meets the SLO by the roofline step model, tenantq.capacity.roofline).
SLO_METRIC = "tenants_at_slo"
CAPACITY_METRICS = (CAPACITY_METRIC, SLO_METRIC)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Format = Literal[FORMAT_NAMES]  # type: ignore[valid-type]
KVFormat = Literal[KV_FORMAT_NAMES]  # type: ignore[valid-type]  # int2 is KV-only


class DeploymentSpec(_Strict):
    """The deployment whose tenant count is the capacity objective (tenantq.capacity)."""

    hardware: str = Field(description="hardware profile: tpu-v6e, h100-sxm, ..., or cpu")
    memory: str | None = Field(None, description="memory per chip, cpu only (e.g. '9.6MiB')")
    chips: int = Field(1, ge=1, description="chips = tensor-parallel degree")
    context_tokens: int = Field(ge=1, description="tokens each tenant holds")
    reserve: str | float | None = Field(None, description="runtime reserve: 0.1, '10%', '4GiB'")
    page_tokens: int = Field(16, ge=1, description="tokens per KV page")
    model: str | None = Field(None, description="capacity model if not the study's model")
    slo: str | None = Field(
        None,
        description="decode rate each tenant must get, e.g. '20tok/s': logs tenants_at_slo "
        "and lets it be the capacity objective",
    )

    @field_validator("slo", mode="before")
    @classmethod
    def _slo(cls, value: Any) -> Any:
        if value is not None:
            from tenantq.capacity.roofline import parse_slo

            try:
                parse_slo(value)
            except ValueError as err:
                raise ValueError(str(err).removeprefix("slo: ")) from None
            return str(value)
        return value

    def build(self):
        """The `tenantq.capacity.Deployment` (raises ValueError naming a bad hardware/size)."""
        from tenantq.capacity import Deployment

        return Deployment.of(
            self.hardware,
            self.chips,
            memory_bytes=self.memory,
            page_tokens=self.page_tokens,
            reserve=self.reserve,
        )


class SpaceSpec(_Strict):
    """What is searched. Choice lists default to the formats the engine runs on CPU and TPU."""

    kind: Literal[SPACE_KINDS] = Field(
        "structured", description="structured|per_tensor|sensitivity"
    )  # type: ignore[valid-type]
    weight_formats: list[Format] = Field(
        default_factory=lambda: ["bf16", "fp8_e4m3", "int8", "int4"],
        description="formats a weight tensor (class) may take",
    )
    embed_formats: list[Format] | None = Field(
        None, description="formats for embed and lm_head (default: weight_formats)"
    )
    uniform_weights: bool = Field(
        False, description="structured: one format for all attention and MLP weights"
    )
    group_size: int | None = Field(128, ge=1, description="group size for int4/int8 weights")
    bf16_first_layers: list[int] = Field(default_factory=lambda: [0, 1], description="choices")
    bf16_last_layers: list[int] = Field(default_factory=lambda: [0, 1], description="choices")
    key_formats: list[KVFormat] = Field(
        default_factory=lambda: ["bf16", "fp8_e4m3", "int8", "int4"]
    )
    # "tensor"/"head" (static, calibrated scales) apply to formats with one float scale
    # (quant.plan.STATIC_KV_FORMATS); paired with another format they fall back to that
    # format's default axis (quant.plan.DEFAULT_KV_AXES), so the plan is the same.
    key_axes: list[Literal[KV_AXES]] = Field(default_factory=lambda: ["channel", "token"])  # type: ignore[valid-type]
    value_formats: list[KVFormat] = Field(
        default_factory=lambda: ["bf16", "fp8_e4m3", "int8", "int4"]
    )
    value_axes: list[Literal[KV_AXES]] = Field(default_factory=lambda: ["token"])  # type: ignore[valid-type]
    sink_tokens: list[int] = Field(default_factory=lambda: [0, 4])
    # Storage of page/token KV scales (quant.plan.KV_SCALE_DTYPES); where a choice cannot
    # apply (e8m0 with int2, MX/nvfp4, static axes) the plan keeps float32.
    kv_scale_dtypes: list[Literal[KV_SCALE_DTYPES]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: ["float32"]
    )
    kv_bf16_layers: list[Literal[KV_BF16_LAYER_CHOICES]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: ["none", "first_last"]
    )
    profile: str | None = Field(None, description="sensitivity profile (Arrow/Parquet table)")
    max_keep_bf16: int | None = Field(
        None,
        ge=0,
        description="sensitivity: largest k searched (0: no tensor kept in bf16; absent: "
        "up to every tensor of the profile)",
    )

    @field_validator(
        "weight_formats",
        "key_formats",
        "value_formats",
        "key_axes",
        "value_axes",
        "sink_tokens",
        "kv_scale_dtypes",
        "kv_bf16_layers",
        "bf16_first_layers",
        "bf16_last_layers",
    )
    @classmethod
    def _non_empty(cls, v: list) -> list:
        if not v:
            raise ValueError("needs at least one choice")
        if len(set(v)) != len(v):
            raise ValueError(f"has repeated choices {v}")
        return v

    @field_validator("sink_tokens", "bf16_first_layers", "bf16_last_layers")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(x < 0 for x in v):
            raise ValueError(f"choices must be >= 0, got {v}")
        return v

    @field_validator("max_keep_bf16", mode="before")
    @classmethod
    def _whole_count(cls, v: Any) -> Any:
        # A count of tensors: `true`, "2" or 2.0 is refused, not read as 1 or 2.
        if v is not None and (type(v) is not int or v < 0):
            raise ValueError(
                "must be a whole number >= 0 (the most tensors kept in bf16; 0: none); "
                "leave it out for no limit"
            )
        return v

    @model_validator(mode="after")
    def _profile_for_sensitivity(self) -> SpaceSpec:
        if self.kind == "sensitivity" and not self.profile:
            raise ValueError(
                "space.kind = 'sensitivity' needs space.profile: the table written by "
                "`tenantq sensitivity` (columns tensor, format, kl_mean)"
            )
        return self


class ObjectiveSpec(_Strict):
    metric: str = Field(description="'tenants' or an EvalResult.summary key")
    direction: Literal["maximize", "minimize"]


class ConstraintSpec(_Strict):
    """`metric`'s CI bound must stay within `tolerance` (constraint = bound - tolerance <= 0)."""

    metric: str
    tolerance: float = Field(
        ge=0,
        allow_inf_nan=False,
        description="how far the bound may go in the bad direction (>= 0, finite)",
    )
    bound: Literal["ci_high", "ci_low", "value"] = "ci_high"


class EvalSpec(_Strict):
    suite: str = Field("quick", description="suite name or TOML path (tenantq.evals.load_suite)")
    confirm_suite: str | None = Field(
        None, description="larger suite with held-out examples the front is re-evaluated on"
    )
    cache_dir: str = Field(str(CACHE_DIR), description="where bf16 baselines are cached")


class CalibrationSpec(CalibrationData):
    """The algorithm quantized tensors use (gptq, awq, smoothquant, static activation scales
    need calibration), beside the calibration set it runs on: its fields are those of
    `tenantq.quant.calibration_set.CalibrationData`, the one description of that set."""

    algorithm: Literal[ALGORITHM_NAMES] = "rtn"  # type: ignore[valid-type]

    def worker_args(self) -> dict[str, Any]:
        """What a HostWorker needs to build its Evaluator's `CalibrationData`: its fields."""
        return self.model_dump(include=set(CalibrationData.model_fields))


class SamplerSpec(_Strict):
    """capacity_aware: solves the capacity side exactly (a knapsack over weight bytes) and
    measures the plan predicted to improve the front most (tenantq.search.capacity_aware).
    Absent kind: capacity_aware when the study has a quality objective, else nsga2."""

    kind: Literal[SAMPLERS] | None = None  # type: ignore[valid-type]
    # Optuna's samplers seed numpy, which takes 0 .. 2^32 - 1 ("Seed must be between ...").
    seed: int = Field(0, ge=0, le=2**32 - 1)
    population_size: int | None = Field(None, ge=2, description="NSGA-II population")


class WorkersSpec(_Strict):
    count: int = Field(2, ge=1, description="HostWorker actors (one per host); slice kinds: slices")
    kind: Literal["cpu", "gpu", "tpu", "tpu_slice", "cpu_slice"] = Field(
        "cpu",
        description="tpu: one worker per TPU host; tpu_slice: one trial across every host of "
        "a multi-host slice (tenantq.workers.slice); cpu_slice: the same on CPU processes",
    )
    cpus_per_worker: int = Field(
        1, ge=1, description="CPU cores a CPU worker owns (cpu_slice: per host process)"
    )
    gpus_per_worker: int = Field(1, ge=1)
    tpu_topology: str | None = Field(
        None, description="e.g. '2x4' (tpu: one host), '4x4' (tpu_slice: 4 v6e hosts)"
    )
    tpu_accelerator_type: str | None = Field(
        None, description="Ray's accelerator type, e.g. 'TPU-V6E' (tpu, tpu_slice)"
    )
    tpu_chips_per_host: int | None = Field(
        None,
        ge=1,
        description="tpu_slice: chips per TPU VM where a topology has two shapes (v6e 2x4 is "
        "one 8-chip VM, or two 4-chip VMs with 4); absent: Ray's default for the topology",
    )
    cpu_slice_hosts: int = Field(2, ge=1, description="cpu_slice: JAX processes per slice")
    cpu_devices_per_host: int = Field(
        2, ge=1, description="cpu_slice: forced CPU devices per process"
    )
    max_restarts: int = Field(2, ge=0, description="Ray actor restarts per worker")
    max_task_retries: int = Field(
        0,
        ge=0,
        description="Ray retries of a trial on a restart; 0: the study's ledger owns retries "
        "(study.max_trial_retries), so a plan that kills its worker is not run again by Ray",
    )

    @model_validator(mode="after")
    def _tpu_fields(self) -> WorkersSpec:
        if self.kind not in ("tpu", "tpu_slice"):
            return self
        if not (self.tpu_topology and self.tpu_accelerator_type):
            raise ValueError(
                f"workers.kind = {self.kind!r} needs tpu_topology (e.g. '2x4') and "
                "tpu_accelerator_type (e.g. 'TPU-V6E')"
            )
        from ray.util.tpu import get_tpu_worker_resources

        try:
            hosts, _ = get_tpu_worker_resources(
                self.tpu_topology, self.tpu_accelerator_type, chips_per_vm=self.tpu_chips_per_host
            )
        except ValueError as err:
            raise ValueError(f"workers.tpu_topology / tpu_accelerator_type: {err}") from None
        if self.kind == "tpu" and hosts > 1:
            raise ValueError(
                f"workers.tpu_topology = {self.tpu_topology!r} on {self.tpu_accelerator_type} "
                f"spans {hosts} hosts, but kind = 'tpu' runs one host per worker: use "
                "kind = 'tpu_slice' to run each trial across the slice's hosts"
            )
        return self


# A study name is also a folder name (runs/NAME, the front's plans) and the default MLflow
# experiment: one path component, no separators, no leading dot.
STUDY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}")


MAX_TRIAL_TIMEOUT_S = 30 * 24 * 3600  # a larger deadline is none: leave trial_timeout out


class StudySpec(_Strict):
    name: str = Field(description="Optuna study name")

    @field_validator("name")
    @classmethod
    def _folder_safe(cls, v: str) -> str:
        if not STUDY_NAME.fullmatch(v):
            raise ValueError(
                "is not a study name: use 1-128 letters, digits and - _ . +, starting with a "
                "letter or digit (it names the runs/ folder of the front's plans)"
            )
        return v

    trials: int = Field(ge=1, description="trials to complete (baselines included)")
    storage: str = Field("sqlite:///optuna.db", description="Optuna RDB URL")
    baselines: bool | None = Field(
        None,
        description="enqueue bf16, fp8+fp8 KV, int4 g128 first (absent: yes, for every "
        "sampler; false: the sampler chooses every trial)",
    )
    max_trial_retries: int = Field(
        1,
        ge=0,
        description="retries of a plan whose worker died, ran past its deadline or "
        "whose driver died (a plan fails at most 1 + this many times)",
    )
    trial_timeout: float | None = Field(
        None,
        gt=0,
        le=MAX_TRIAL_TIMEOUT_S,
        strict=True,  # a number of seconds: `true` or "90" is refused, not read as 1 or 90
        allow_inf_nan=False,  # no deadline is said by leaving the key out
        description="seconds a trial may run on a worker before its worker is "
        "killed and replaced and the trial failed with reason 'timeout' (absent: no deadline; "
        "at most 30 days)",
    )


def default_sampler_kind(spec: ExperimentSpec) -> str:
    """The sampler of a spec that names none: capacity_aware wherever a quality objective
    exists (issue 25), NSGA-II for a capacity-only study."""
    return "capacity_aware" if spec.quality_objectives() else "nsga2"


def wants_baselines(spec: ExperimentSpec) -> bool:
    """Whether the study enqueues the three baselines (see StudySpec.baselines): yes unless
    the spec says `baselines = false`, whatever the sampler (the report draws them; the
    168-plan figures count them, docs/results/search-efficiency.md)."""
    return spec.study.baselines is not False


def resumed_sampler(spec: ExperimentSpec, stored: dict | None) -> SamplerSpec | None:
    """The sampler a resumed study goes on with when the spec names no sampler.kind: the
    stored one (a study begun under an older default keeps its sampler), its fields that the
    spec sets taking the spec's values. None when the spec names a kind or nothing differs."""
    if "kind" in spec.sampler.model_fields_set or not isinstance(stored, dict):
        return None
    try:
        old = SamplerSpec.model_validate(stored)
    except ValueError:
        return None  # a stored kind this version lacks: the comparison names the change
    now = spec.sampler
    merged = old.model_copy(update={k: getattr(now, k) for k in now.model_fields_set})
    return None if merged == now else merged


class TrackingSpec(_Strict):
    uri: str = Field("sqlite:///mlflow.db", description="MLflow tracking URI")
    experiment: str | None = Field(None, description="MLflow experiment (default: study name)")


class ExperimentSpec(_Strict):
    """One experiment. Paths are relative to the working directory the study runs in."""

    model: str = Field(description="checkpoint folder (HF layout) or 'reference'")
    requires: list[str] = Field(
        default_factory=list, description="what the spec needs to run (hardware, checkpoint)"
    )
    deployment: DeploymentSpec
    space: SpaceSpec = Field(default_factory=SpaceSpec)
    objectives: Annotated[list[ObjectiveSpec], Field(min_length=1)] = Field(
        default_factory=lambda: [
            ObjectiveSpec(metric=CAPACITY_METRIC, direction="maximize"),
            ObjectiveSpec(metric="fidelity.kl_mean", direction="minimize"),
        ]
    )
    constraints: list[ConstraintSpec] | None = Field(
        None, description="absent: the suite's own gates; [] : none"
    )
    eval: EvalSpec = Field(default_factory=EvalSpec)
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)
    sampler: SamplerSpec = Field(default_factory=SamplerSpec)
    study: StudySpec
    workers: WorkersSpec = Field(default_factory=WorkersSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)

    @model_validator(mode="after")
    def _slice_chips(self) -> ExperimentSpec:
        """A slice runs the engine at tp = every device of the slice; the capacity side must
        budget that layout (deployment.chips), or planner and engine count different bytes."""
        if self.workers.kind not in ("tpu_slice", "cpu_slice"):
            return self
        from tenantq.workers.slice import slice_shape

        devices = slice_shape(self.workers).devices
        if self.deployment.chips != devices:
            raise ValueError(
                f"deployment.chips = {self.deployment.chips}, but each trial runs on a "
                f"{self.workers.kind} of {devices} devices (tensor parallel over all of them): "
                f"set deployment.chips = {devices}"
            )
        return self

    @model_validator(mode="after")
    def _objectives(self) -> ExperimentSpec:
        from tenantq.evals.suite import higher_is_better

        names = [o.metric for o in self.objectives]
        if len(set(names)) != len(names):
            raise ValueError(f"objectives: metric listed twice in {names}")
        bounds = [(c.metric, c.bound) for c in self.constraints or []]
        for i, b in enumerate(bounds):
            if b in bounds[:i]:  # two tolerances on one bound: one of them is meaningless
                raise ValueError(
                    f"constraints.{i}: {b[0]!r} ({b[1]}) is constrained twice (also "
                    f"constraints.{bounds.index(b)}); keep one with the tolerance you mean"
                )
        capacity = [o.metric for o in self.objectives if o.metric in CAPACITY_METRICS]
        if len(capacity) > 1:
            raise ValueError(
                f"objectives: give one capacity objective, {CAPACITY_METRIC!r} (by memory) or "
                f"{SLO_METRIC!r} (at [deployment] slo), not both"
            )
        for i, o in enumerate(self.objectives):
            if o.metric in CAPACITY_METRICS and o.direction != "maximize":
                raise ValueError(
                    f"objectives.{i}: {o.metric!r} must be maximized (more tenants per "
                    "chip is the point of the study); write direction = 'maximize'"
                )
            if o.metric == SLO_METRIC and self.deployment.slo is None:
                raise ValueError(
                    f"objectives.{i}: {SLO_METRIC!r} needs a service level: add "
                    "[deployment] slo = '20tok/s' (the decode rate each tenant must get)"
                )
            if o.metric in CAPACITY_METRICS:
                continue
            better = higher_is_better(o.metric)
            want = {True: "maximize", False: "minimize", None: o.direction}[better]
            if o.direction != want:
                raise ValueError(
                    f"objectives.{i}: {o.metric!r} is better when "
                    f"{'higher' if better else 'lower'}, so direction = {o.direction!r} would "
                    f"search for worse plans; write direction = {want!r}"
                )
        return self

    @model_validator(mode="after")
    def _slo_needs_rates(self) -> ExperimentSpec:
        if self.deployment.slo is not None and self.deployment.hardware.lower().startswith("cpu"):
            raise ValueError(
                "deployment.slo: hardware cpu has no bandwidth and peak figures for the step "
                "model; give an accelerator (tpu-v6e, h100-sxm, ...) or drop slo"
            )
        return self

    @model_validator(mode="after")
    def _default_sampler(self) -> ExperimentSpec:
        if self.sampler.kind is None:  # frozen model: set once, while validating
            kind = default_sampler_kind(self)
            sampler = self.sampler.model_copy(update={"kind": kind})
            # Still unset for `model_fields_set`: a resume keeps the kind the study began with
            # (`resumed_sampler`), e.g. nsga2, the default before capacity_aware.
            sampler.__pydantic_fields_set__.discard("kind")
            object.__setattr__(self, "sampler", sampler)
        return self

    @model_validator(mode="after")
    def _sinks_within_the_context(self) -> ExperimentSpec:
        # Sink tokens are part of each tenant's context: more sinks than context tokens would
        # have the capacity objective reserve bf16 sink pages for tokens that never exist.
        context = self.deployment.context_tokens
        over = [n for n in self.space.sink_tokens if n > context]
        if over:
            raise ValueError(
                f"space.sink_tokens: choices {over} exceed deployment.context_tokens = "
                f"{context}; sink tokens are the first tokens of a tenant's context"
            )
        return self

    @property
    def experiment_name(self) -> str:
        return self.tracking.experiment or self.study.name

    def model_path(self) -> Path:
        if self.model == REFERENCE_MODEL:
            from tenantq.reference import reference_model_path

            return reference_model_path()
        return Path(self.model).expanduser()

    def quality_objectives(self) -> list[ObjectiveSpec]:
        return [o for o in self.objectives if o.metric not in CAPACITY_METRICS]

    @property
    def capacity_metric(self) -> str:
        """The study's capacity: its capacity objective, else (none among the objectives)
        `tenants_at_slo` with an slo, else `tenants` (what the front and report show)."""
        named = [o.metric for o in self.objectives if o.metric in CAPACITY_METRICS]
        if named:
            return named[0]
        return SLO_METRIC if self.deployment.slo is not None else CAPACITY_METRIC


def parse_spec(raw: dict[str, Any], source: str = "spec") -> ExperimentSpec:
    """Validate a spec dict; a mistake is a ValueError of one line naming the key."""
    try:
        spec = ExperimentSpec.model_validate(raw)
    except ValidationError as err:
        raise ValueError(validation_line(err, ExperimentSpec, source=source)) from None
    try:
        spec.deployment.build()
    except ValueError as err:
        raise ValueError(f"{source}: deployment: {err}") from None
    return spec


def load_spec(path: str | Path) -> ExperimentSpec:
    """Read and validate a spec TOML file."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"spec file {p} does not exist")
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{p}: not valid TOML ({err})") from None
    return parse_spec(raw, str(p))
