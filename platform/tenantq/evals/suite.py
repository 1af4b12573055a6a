"""A suite is data: which tasks, how many examples, which split, which gates and tolerances.

Suites live as TOML under `evals/suites/` (`quick` for search trials, `standard`, `long`) or
anywhere on disk; pydantic validates them, so a misspelt key is a one-line error naming the
valid ones. `split` picks one of two disjoint halves of the held-out data: the search draws
from "search", a confirmation run (`suite.with_split("confirm")`) from examples it never saw.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SUITES_DIR = Path(__file__).resolve().parent / "suites"
SPLITS = ("search", "confirm")


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


class StructuredSpec(_Spec):
    tasks: tuple[
        Literal["close_line", "close_brackets", "repeat_identifier", "indent_block"], ...
    ] = (
        "close_line",
        "repeat_identifier",
    )
    per_task: int = Field(16, gt=0, description="examples per task")
    context_tokens: int = Field(192, ge=16, description="prompt tokens of real code before the cut")
    max_new_tokens: int = Field(12, gt=0, description="greedy tokens generated at most")


class GateSpec(_Spec):
    metric: str = Field(description="a summary delta, e.g. 'fidelity.kl_mean'")
    tolerance: float = Field(ge=0, description="largest acceptable change in the bad direction")
    higher_is_better: bool = Field(description="accuracy: true; KL, perplexity: false")


class Suite(_Spec):
    name: str
    seed: int = Field(0, description="seeds every example draw and the bootstrap")
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

    def with_split(self, split: str) -> Suite:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return self.model_copy(update={"split": split})

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)


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
    all (+-z^2 / (n + z^2): 0.107 at n = 32): such a gate can never say `non-inferior`."""
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
                f"examples with no flip at all: this gate cannot show non-inferiority; use a "
                f"tolerance >= {math.ceil(bound * 1000) / 1000:g} or more examples"
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
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"suite file {path}: cannot parse ({err})") from None
    raw.setdefault("name", path.stem)
    try:
        return Suite.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"suite file {path}: {where}: {first['msg']}") from None
