"""A suite is data: which tasks, how many examples, which split, which gates and tolerances.

Suites live as TOML under `evals/suites/` (`quick` for search trials, `standard`, `long`) or
anywhere on disk; pydantic validates them, so a misspelt key is a one-line error naming the
valid ones. `split` picks one of two disjoint halves of the held-out data: the search draws
from "search", a confirmation run (`suite.with_split("confirm")`) from examples it never saw.
"""

from __future__ import annotations

import difflib
import json
import math
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tenantq.model.checks import validation_line

SUITES_DIR = Path(__file__).resolve().parent / "suites"
SPLITS = ("search", "confirm")
# Shortest needle prompt: BOS, the needle sentence, some haystack and the query (the shortest
# length the shipped suites and tests use is 64).
MIN_NEEDLE_TOKENS = 32


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FidelitySpec(_Spec):
    source: str = Field(
        "reference-test",
        description="'reference-test' (the shipped model's held-out split) or a .txt, "
        ".jsonl or .parquet file of text",
    )
    text_field: str = Field("text", description="field/column holding text in .jsonl/.parquet")
    rows: int = Field(16, gt=0, description="token windows scored")
    row_tokens: int = Field(512, ge=8, description="tokens per window, BOS included")
    exact_vocab_limit: int = Field(
        32768, gt=0, description="vocabularies up to this size get exact KL; above, top-k + tail"
    )
    top_k: int = Field(64, gt=0, description="baseline tokens kept per position above the limit")
    tail_samples: int = Field(
        64, gt=0, description="tokens sampled per position from the rest of the vocabulary"
    )


class NeedleSpec(_Spec):
    variant: Literal["single", "multikey", "multivalue", "vartrack"] = "single"
    lengths: tuple[int, ...] = Field(description="prompt tokens per cell row")
    per_length: int = Field(gt=0, description="needles per length, depths evenly over 0-100%")
    count: int = Field(4, ge=2, description="needles per prompt for multikey/multivalue")

    @field_validator("lengths")
    @classmethod
    def _lengths(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        # An empty list measures nothing and passes; a repeated length counts the same needles
        # twice as independent examples (its interval too narrow).
        if not v:
            raise ValueError("needs at least one prompt length (tokens), e.g. [1019]")
        if len(set(v)) != len(v):
            raise ValueError(f"lists a length twice in {list(v)}; give each length once")
        short = [n for n in v if n < MIN_NEEDLE_TOKENS]
        if short:
            raise ValueError(
                f"{short} too short: a needle prompt needs at least {MIN_NEEDLE_TOKENS} tokens"
            )
        return v


class StructuredSpec(_Spec):
    tasks: tuple[
        Literal["close_line", "close_brackets", "repeat_identifier", "indent_block"], ...
    ] = (
        "close_line",
        "repeat_identifier",
    )
    per_task: int = Field(16, gt=0, description="examples per task")

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        # No task measures nothing (its gate would pass every plan); a task named twice would
        # count its examples twice as independent ones.
        if not v:
            raise ValueError(
                'needs at least one task, e.g. ["close_line"] (leave [structured] out for none)'
            )
        twice = sorted({t for t in v if v.count(t) > 1})
        if twice:
            raise ValueError(f"names {twice[0]!r} twice in {list(v)}; give each task once")
        return v

    context_tokens: int = Field(192, ge=16, description="prompt tokens of real code before the cut")
    max_new_tokens: int = Field(12, gt=0, description="greedy tokens generated at most")


class GateSpec(_Spec):
    metric: str = Field(description="a summary delta, e.g. 'fidelity.kl_mean'")
    tolerance: float = Field(
        ge=0, allow_inf_nan=False, description="largest acceptable change in the bad direction"
    )
    higher_is_better: bool = Field(
        description="accuracy: true; KL, perplexity: false; inferred from a catalogued metric"
    )

    @model_validator(mode="before")
    @classmethod
    def _direction_from_metric(cls, data):
        # a wrong direction silently inverts the verdict (a perplexity ratio gated as if
        # higher were better passes every damaged plan), so the catalogue's one wins
        if not isinstance(data, dict):
            return data
        metric, given = data.get("metric"), data.get("higher_is_better")
        known = higher_is_better(metric) if isinstance(metric, str) else None
        if known is None or given is None:
            return data if known is None else {**data, "higher_is_better": known}
        if isinstance(given, bool) and given != known:
            raise ValueError(
                f"higher_is_better = {str(given).lower()} contradicts {metric}, where "
                f"{'higher' if known else 'lower'} is better: set {str(known).lower()} or leave "
                f"it out"
            )
        return data


class Suite(_Spec):
    name: str
    # numpy's SeedSequence takes non-negative integers only ("expected non-negative integer").
    seed: int = Field(0, ge=0, description="seeds every example draw and the bootstrap")
    split: Literal["search", "confirm"] = "search"
    resamples: int = Field(10_000, ge=100, description="bootstrap resamples per CI")
    min_baseline_pass_rate: float = Field(
        0.6,
        ge=0.0,
        le=1.0,
        description="a pass/fail task (a needle length, a structured task) whose bf16 pass "
        "rate is below this is named in a warning.* summary entry: a model that mostly fails "
        "a task leaves few passes to lose",
    )
    fidelity: FidelitySpec | None = None
    needles: tuple[NeedleSpec, ...] = ()
    structured: StructuredSpec | None = None
    gates: tuple[GateSpec, ...] = ()

    @model_validator(mode="after")
    def _measures_and_gates_once(self) -> Suite:
        if self.fidelity is None and not self.needles and self.structured is None:
            raise ValueError(
                "the suite has no task: add [fidelity], [[needles]] or [structured] (a suite "
                "that measures nothing would pass every plan)"
            )
        measured: dict[str, int] = {}  # needle summary key group -> the [[needles]] entry
        for i, n in enumerate(self.needles):
            task = NEEDLE_TASK_NAMES[n.variant]
            for length in n.lengths:
                key = f"{task}.acc_delta.len{length}"
                if key in measured:
                    raise ValueError(
                        f"needles.{i}: {n.variant!r} needles of length {length} are already "
                        f"measured by needles.{measured[key]}: both would report {key!r}; "
                        "give each (variant, length) once"
                    )
                measured[key] = i
        seen = set()
        gateable = gate_metrics(self)
        for i, g in enumerate(self.gates):
            if g.metric in seen:
                raise ValueError(
                    f"gates: {g.metric!r} is gated twice; keep one [[gates]] entry per metric "
                    "with the tolerance you mean"
                )
            seen.add(g.metric)
            if g.metric not in gateable:
                close = difflib.get_close_matches(g.metric, gateable, n=2)
                hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
                raise ValueError(
                    f"gates.{i}.metric: {g.metric!r} is not a delta this suite measures; "
                    f"{hint}its deltas: {', '.join(gateable)}"
                )
            better = higher_is_better(g.metric)
            if better is not None and g.higher_is_better != better:
                raise ValueError(
                    f"gates.{i}.higher_is_better: {g.metric!r} is better when "
                    f"{'higher' if better else 'lower'}; set higher_is_better = "
                    f"{str(better).lower()}"
                )
        return self

    def with_split(self, split: str) -> Suite:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return self.model_copy(update={"split": split})

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)


def check_suite_for_model(suite: Suite, config, where: str = "suite") -> None:
    """The suite against the model it measures (`config`: a `ModelConfig`): window and prompt
    lengths within the model's positions, top-k and tail samples within its vocabulary. One
    ValueError line naming the suite key; called by the evaluator and by `search --check`."""
    context, vocab = config.max_position_embeddings, config.vocab_size
    name = f"{where} {suite.name!r}"
    f = suite.fidelity
    if f is not None:
        if f.row_tokens > context:
            raise ValueError(
                f"{name}: fidelity.row_tokens = {f.row_tokens} exceeds the model's context "
                f"of {context} tokens; use row_tokens <= {context}"
            )
        if vocab > f.exact_vocab_limit:  # top-k + tail sampling is used: both within vocab
            for key in ("top_k", "tail_samples"):
                if getattr(f, key) >= vocab:
                    raise ValueError(
                        f"{name}: fidelity.{key} = {getattr(f, key)} is not below the model's "
                        f"vocabulary of {vocab}; use {key} < {vocab}"
                    )
    for i, n in enumerate(suite.needles):
        over = [length for length in n.lengths if length >= context]
        if over:
            raise ValueError(
                f"{name}: needles.{i}.lengths {over} reach the model's context of {context} "
                f"tokens (the answer follows the prompt); use lengths < {context}"
            )
    s = suite.structured
    if s is not None and s.context_tokens + s.max_new_tokens > context:
        raise ValueError(
            f"{name}: structured.context_tokens + max_new_tokens = "
            f"{s.context_tokens + s.max_new_tokens} exceeds the model's context of {context}"
        )


# Needle variant -> the task name its summary keys and example ids carry.
NEEDLE_TASK_NAMES = {
    "single": "needle",
    "multikey": "needle_multikey",
    "multivalue": "needle_multivalue",
    "vartrack": "needle_vartrack",
}
# The numeric summary keys `Evaluator.evaluate` reports, by family. The fidelity ones are
# fixed; each pass/fail group (a needle length, the structured tasks together and each one)
# reports every figure of PASS_FAIL_FIGURES, named by `pass_fail_key`.
FIDELITY_METRICS = (
    "fidelity.kl_mean", "fidelity.kl_mean.ci_low", "fidelity.kl_mean.ci_high",
    "fidelity.kl_p99", "fidelity.kl_max", "fidelity.top1_agree",
    "fidelity.top1_agree_delta", "fidelity.top1_agree_delta.ci_low",
    "fidelity.top1_agree_delta.ci_high", "fidelity.ppl_base", "fidelity.ppl_cand",
    "fidelity.ppl_ratio", "fidelity.ppl_ratio.ci_low", "fidelity.ppl_ratio.ci_high",
    "fidelity.tokens", "fidelity.exact",
)  # fmt: skip
PASS_FAIL_FIGURES = (
    "acc_base", "acc_cand", "acc_delta", "acc_delta.ci_low", "acc_delta.ci_high",
    "flips.correct_to_wrong", "flips.wrong_to_correct", "mcnemar_p", "n",
)  # fmt: skip
OVERALL_METRICS = ("examples.n", "passed")


def pass_fail_key(task: str, figure: str, group: str) -> str:
    """`needle` + `acc_delta.ci_low` + `.len1019` -> `needle.acc_delta.len1019.ci_low`: the
    group sits after the figure's first part, so each CI bound follows its delta's name."""
    head, _, tail = figure.partition(".")
    return f"{task}.{head}{group}" + (f".{tail}" if tail else "")


def baseline_pass_warnings(suite: Suite, passes: dict[str, tuple[int, int]]) -> dict[str, str]:
    """`warning.<group>` entries for the pass/fail groups (`needle.len1019`,
    `structured.close_brackets`, from (bf16 passes, examples)) whose bf16 pass rate is below
    the suite's `min_baseline_pass_rate`. The rate is only known once the baseline ran, so
    the evaluator applies this rule to every result; the warning travels with the summary
    (MLflow tag `tenantq.warning.<group>`, the report, the CLI)."""
    out = {}
    for group, (passed, n) in sorted(passes.items()):
        if n > 0 and passed / n < suite.min_baseline_pass_rate:
            out[f"warning.{group}"] = (
                f"bf16 pass rate {passed / n:.0%} ({passed} of {n}) is below the suite's "
                f"{suite.min_baseline_pass_rate:.0%}"
            )
    return out


def unreachable_gate_warnings(suite: Suite, examples: dict[str, int]) -> dict[str, str]:
    """`warning.gate.<metric>` for each pass/fail gate (`examples`: its metric -> n) whose
    tolerance is tighter than the lower bound Tango's interval gives when nothing flips at
    all (+-z^2 / (n + z^2): 0.107 at n = 32): such a gate cannot show non-inferiority unless
    the candidate gains more than it loses (`stats.gains_needed` gives the exact rule)."""
    from tenantq.evals.stats import tango_interval

    out = {}
    for gate in suite.gates:
        n = examples.get(gate.metric)
        if not n or not gate.higher_is_better:
            continue
        bound = -float(tango_interval(0, 0, n)[0])
        if gate.tolerance < bound:
            out[f"warning.gate.{gate.metric}"] = (
                f"tolerance {gate.tolerance:g} is below {bound:.3f}, the 95% bound of {n} "
                f"examples with no flip at all: this gate cannot show non-inferiority unless "
                f"the candidate gains more than it loses (no flips -> lower bound -{bound:.3f}); "
                f"use a tolerance >= {math.ceil(bound * 1000) / 1000:g} or more examples"
            )
    return out


def suite_metrics(suite: Suite) -> list[str]:
    """Every numeric summary key an evaluation of `suite` reports, read from the suite alone
    (no model, no examples drawn): the names a search objective or constraint may use."""
    names = set(OVERALL_METRICS)
    if suite.fidelity is not None:
        names.update(FIDELITY_METRICS)
    for spec in suite.needles:
        task = NEEDLE_TASK_NAMES[spec.variant]
        for length in spec.lengths:
            names.update(pass_fail_key(task, f, f".len{length}") for f in PASS_FAIL_FIGURES)
    if suite.structured is not None:
        for group in ("", *(f".{t}" for t in suite.structured.tasks)):
            names.update(pass_fail_key("structured", f, group) for f in PASS_FAIL_FIGURES)
    return sorted(names)


def gate_metrics(suite: Suite) -> list[str]:
    """The deltas a gate, objective or constraint compares against its tolerance: the
    headline fidelity deltas and each pass/fail group's `acc_delta` (the evaluator's
    `expected_metrics`, read from the suite alone)."""
    names = []
    if suite.fidelity is not None:
        names += ["fidelity.kl_mean", "fidelity.top1_agree_delta", "fidelity.ppl_ratio"]
    for spec in suite.needles:
        task = NEEDLE_TASK_NAMES[spec.variant]
        names += [f"{task}.acc_delta.len{length}" for length in spec.lengths]
    if suite.structured is not None:
        names.append("structured.acc_delta")
        names += [f"structured.acc_delta.{t}" for t in suite.structured.tasks]
    return sorted(set(names))


# Summary figures a quality change makes larger (True) or smaller (False); a bound of one
# (.ci_low/.ci_high) goes the same way. Counts and baselines have no better direction.
_LOWER_IS_BETTER = ("fidelity.kl_mean", "fidelity.kl_p99", "fidelity.kl_max", "fidelity.ppl_ratio")
_HIGHER_IS_BETTER = ("fidelity.top1_agree", "fidelity.top1_agree_delta")
_PASS_FAIL_HIGHER = ("acc_cand", "acc_delta")


def higher_is_better(metric: str) -> bool | None:
    """True when a larger value of summary key `metric` means better quality, False when a
    smaller does, None when the key has no such direction (counts, baselines, p-values)."""
    base = metric.removesuffix(".ci_low").removesuffix(".ci_high")
    if base in _LOWER_IS_BETTER:
        return False
    if base in _HIGHER_IS_BETTER:
        return True
    parts = base.split(".")
    pass_fail = parts[0] in (*NEEDLE_TASK_NAMES.values(), "structured")
    if len(parts) >= 2 and pass_fail and parts[1] in _PASS_FAIL_HIGHER:
        return True
    return None


def builtin_suites() -> list[str]:
    return sorted(p.stem for p in SUITES_DIR.glob("*.toml"))


def load_suite(name_or_path: str | Path) -> Suite:
    """A built-in suite by name (`quick`, `standard`, `long`) or a suite TOML file."""
    path = Path(name_or_path)
    if not path.suffix and (SUITES_DIR / f"{name_or_path}.toml").is_file():
        path = SUITES_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise ValueError(
            f"suite {str(name_or_path)!r} not found: use one of {', '.join(builtin_suites())} "
            "or the path of a suite .toml file"
        )
    try:
        # A byte order mark (some Windows editors write one) is not TOML; it is skipped.
        raw = tomllib.loads(path.read_text(encoding="utf-8-sig"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"suite file {path}: cannot parse ({err})") from None
    raw.setdefault("name", path.stem)
    return parse_suite(raw, f"suite file {path}")


def parse_suite(raw: dict, source: str = "suite") -> Suite:
    """Validate a suite's table; a mistake is one ValueError line naming `source` and the key."""
    try:
        return Suite.model_validate(raw)
    except ValidationError as err:
        raise ValueError(validation_line(err, Suite, source=source)) from None
