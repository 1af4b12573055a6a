"""`Evaluator`: one model, one suite, many plans; `EvalResult`: what one plan scored.

The evaluator loads the checkpoint once (float32 host params; each plan quantizes its own
copy through `Engine`), draws the suite's examples once, and computes the bf16 baseline once
per (model identity, dataset hash, engine settings), cached on disk as Parquet so a second
evaluator - another worker, another day - reads it. `evaluate(plan)` builds the engine for
the plan (same layout, same compiled executables) and runs every task through it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tenantq.evals import data, fidelity, needle_grid, stats, structured, windows
from tenantq.evals.calibrated import CalibrationData, Calibrator
from tenantq.evals.generation import Generated
from tenantq.evals.identity import cache_key, model_identity
from tenantq.evals.suite import (
    Suite,
    baseline_pass_warnings,
    check_suite_for_model,
    load_suite,
    unreachable_gate_warnings,
)
from tenantq.evals.tasks import FidelityTask, PassFailTask
from tenantq.model.files import CACHE_DIR, atomic_path

# Part of every cached baseline's key: bump it whenever the suite's numerics change (version 2:
# needles teacher-forced in fidelity-width steps, all at one KV window), so baselines cached
# by older code are never paired with candidates measured by this code.
CACHE_VERSION = 2
# Fidelity reads the needles' KV window while it is at most this many times its own: at 4x
# (quick suite, 256 -> 1,024) fidelity took 2.1 s of CPU against 0.9 s, and the second body
# executable it saves compiled in 3.9-7.8 s (README "Quality suite"). The padded attention
# grows with the ratio; the saved compile does not.
SHARED_WINDOW_MAX_RATIO = 4
PHASES = ("load", "quantize", "compile", "baseline", "fidelity", "needles", "structured", "total")


@dataclasses.dataclass(frozen=True)
class Gate:
    """One gated metric: its delta, the CI, the tolerance, the non-inferiority verdict
    (`stats.VERDICTS`), the two-sided `changed` flag and Optuna's constraint."""

    metric: str
    value: float
    ci_low: float
    ci_high: float
    tolerance: float
    higher_is_better: bool
    verdict: str
    constraint: float  # <= 0: within tolerance (trial.set_constraint)
    changed: bool = False  # two-sided: exact McNemar p <= 0.05 (pass/fail), else CI excludes 0

    def as_dict(self) -> dict[str, Any]:
        """Every field as plain Python values (JSON, Ray, MLflow): what a trial's result and
        the Parquet metadata carry, `higher_is_better` included."""
        fields = dataclasses.asdict(self).items()
        return {k: v.item() if isinstance(v, np.generic) else v for k, v in fields}


@dataclasses.dataclass
class EvalResult:
    summary: dict[str, float | int | str]
    gates: dict[str, Gate]
    examples: pa.Table
    timings_s: dict[str, float]
    memory_report: dict[str, Any]

    @property
    def passed(self) -> bool:
        return all(g.constraint <= 0 for g in self.gates.values())

    def to_parquet(self, path: str | Path) -> Path:
        """The per-example table, with summary, gates and timings as JSON schema metadata."""
        path = Path(path)
        meta = {
            b"tenantq.summary": json.dumps(self.summary).encode(),
            b"tenantq.gates": json.dumps({k: g.as_dict() for k, g in self.gates.items()}).encode(),
            b"tenantq.timings_s": json.dumps(self.timings_s).encode(),
        }  # fmt: skip
        table = self.examples.replace_schema_metadata(
            {**(self.examples.schema.metadata or {}), **meta}
        )
        with atomic_path(path) as tmp:
            pq.write_table(table, tmp)
        return path


class Evaluator:
    """Evaluate plans on one checkpoint with one suite (see the module docstring)."""

    def __init__(
        self,
        model_path: str | Path,
        suite: Suite | str,
        *,
        cache_dir: str | Path = CACHE_DIR,
        engine_options: dict[str, Any] | None = None,
        progress: bool = False,
        calibration: CalibrationData | None = None,
    ):
        from tenantq.model.config import ModelConfig
        from tenantq.model.loader import load_params
        from tenantq.model.tokenizer import require_tokenizer

        began = time.perf_counter()
        self.model_path = Path(model_path)
        self.suite = load_suite(suite) if isinstance(suite, str | Path) else suite
        self.cache_dir = Path(cache_dir)
        options = dict(engine_options or {})
        self.dtype = str(options.pop("dtype", "bfloat16"))
        self.engine_options = options
        self.progress = progress
        self.identity = model_identity(self.model_path)
        self.config = ModelConfig.from_file(self.model_path)
        self.tokenizer = require_tokenizer(self.model_path, self.config.vocab_size)
        check_suite_for_model(self.suite, self.config)
        self.params = load_params(self.model_path, self.config, dtype=jnp.float32)
        # gptq/awq/smoothquant plans: statistics on first use, once (evals.calibrated)
        self.calibrator = Calibrator(
            self.model_path, self.config, self.tokenizer, self.params, model_id=self.identity,
            data=calibration, cache_dir=self.cache_dir,
        )  # fmt: skip
        self._draw_examples()
        _check_gates(self.suite, self.expected_metrics())
        self.load_s = time.perf_counter() - began
        self._baseline: dict[str, Any] | None = None
        self._kv_scales: dict[str, Any] = {}  # by folded-params identity
        self._evaluations = 0

    # ------------------------------------------------------------------ examples
    def _draw_examples(self) -> None:
        suite, seed = self.suite, self.suite.seed
        spec = suite.fidelity
        source = spec.source if spec else data.REFERENCE_TEST
        docs = data.split_documents(
            data.load_documents(source, spec.text_field if spec else "text"), suite.split
        )
        self.docs = docs
        stream = windows.token_stream(self.tokenizer, docs)
        hashed = [stream[:0]]
        self.fidelity_rows = None
        if spec is not None:
            self.fidelity_rows = windows.bos_windows(
                stream, self.config, spec.rows, spec.row_tokens, np.random.default_rng([seed, 0])
            )
            hashed.append(self.fidelity_rows)
        self.needle_items = []
        for nspec in suite.needles:
            self.needle_items += needle_grid.build_needles(self.tokenizer, stream, nspec, seed)
        context = self.config.max_position_embeddings
        for item in self.needle_items:
            if len(item.prompt) + len(item.answer) > context:
                raise ValueError(
                    f"{item.task} at {item.length} tokens needs {len(item.answer)} more to "
                    f"answer, past the model's context of {context}; use lengths <= "
                    f"{context - len(item.answer)}"
                )
        self.step_tokens, self.kv_window_tokens, self.fidelity_kv_tokens = self._step_shape()
        self.structured_items = []
        if suite.structured is not None:
            self.structured_items = structured.build_items(
                self.tokenizer, docs, suite.structured, seed
            )
        for item in self.needle_items + self.structured_items:
            hashed.append(np.asarray(item.prompt, np.int32))
        self.dataset_hash = data.array_hash(*hashed)

    def _step_shape(self) -> tuple[int | None, int, int | None]:
        """(tokens per needle step, the needles' KV window, fidelity's KV window).

        Fidelity and needles share one shape, so one body executable (+ one head for
        all-position logits) per layout serves both: steps as wide as a fidelity window, the
        KV window the smallest power of two covering every row (capped at the cache by the
        engine). Fidelity reads the needles' longer window only while that costs less than
        the second body executable it saves (`SHARED_WINDOW_MAX_RATIO`); past it, fidelity
        keeps its own window and the needles run one prefill each, as wide as they are."""
        from tenantq.engine.steps import pow2_at_least

        longest = [len(i.prompt) + len(i.answer) - 1 for i in self.needle_items]
        if self.fidelity_rows is None:
            return None, pow2_at_least(max(longest, default=1), 16), None
        width = int(self.fidelity_rows.shape[1])
        own = pow2_at_least(width, 16)
        window = pow2_at_least(max([*longest, width]), 16)
        if window <= SHARED_WINDOW_MAX_RATIO * own:
            return width, window, window
        return None, window, own

    def expected_metrics(self) -> list[str]:
        names = []
        if self.fidelity_rows is not None:
            names += ["fidelity.kl_mean", "fidelity.top1_agree_delta", "fidelity.ppl_ratio"]
        for item in self.needle_items:
            names.append(f"{item.task}.acc_delta.len{item.length}")
        for item in self.structured_items:
            names += ["structured.acc_delta", f"structured.acc_delta.{item.task_name}"]
        return sorted(set(names))

    def _gate_examples(self) -> dict[str, int]:
        """Examples behind each pass/fail delta (`needle.acc_delta.len1019` -> 48)."""
        out: dict[str, int] = {}
        for item in self.needle_items:
            key = f"{item.task}.acc_delta.len{item.length}"
            out[key] = out.get(key, 0) + 1
        for item in self.structured_items:
            for key in ("structured.acc_delta", f"structured.acc_delta.{item.task_name}"):
                out[key] = out.get(key, 0) + 1
        return out

    # ------------------------------------------------------------------ engine + baseline
    def engine_settings(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            **{k: self.engine_options[k] for k in sorted(self.engine_options)},
        }

    def build_engine(self, plan):
        from tenantq.engine import Engine

        options = dict(self.engine_options)
        params, folded, folded_id = self.calibrator.prepared(plan)
        if plan.needs_kv_scales and "kv_scales" not in options:
            options["kv_scales"] = self.kv_scales(folded, folded_id)
        try:
            return Engine(
                self.config, params, plan, dtype=self.dtype, tokenizer=self.tokenizer, **options
            )
        except (TypeError, NotImplementedError) as err:
            raise ValueError(f"cannot build the engine for this plan: {err}") from None

    def kv_scales(self, folded: dict[str, Any], folded_id: str):
        """Static KV scales calibrated on `folded`, the params the engine runs before its
        weights are quantized (after a plan's smoothquant/awq folds, which rescale v_proj's
        output and so the cached values): once per folded identity, in memory and on disk."""
        from tenantq.engine.sharding import on_every_host
        from tenantq.quant import kv_calibration as kvc

        if folded_id not in self._kv_scales:
            rows, _ = windows.calibration_windows(  # the weights' calibration text, if given
                self.tokenizer, self.config, source=self.calibrator.data.data,
                num_sequences=kvc.DEFAULT_KV_SEQUENCES,
                seq_tokens=min(kvc.DEFAULT_KV_SEQ_TOKENS, self.config.max_position_embeddings),
            )  # fmt: skip
            self._kv_scales[folded_id] = kvc.kv_static_scales(
                self.model_path, rows, model_id=folded_id,
                data_hash=data.array_hash(rows), cache_dir=self.cache_dir / "calibration",
                params=folded, agree=on_every_host,
            )  # fmt: skip
        return self._kv_scales[folded_id]

    def baseline_key(self) -> str:
        return cache_key(
            version=CACHE_VERSION, model=self.identity, dataset=self.dataset_hash,
            engine=self.engine_settings(), steps=[self.step_tokens, self.kv_window_tokens,
            self.fidelity_kv_tokens],
            suite=self.suite.model_dump(mode="json",
            exclude={"name", "resamples", "gates", "min_baseline_pass_rate"}),
        )  # fmt: skip

    def baseline(self) -> dict[str, Any]:
        """The bf16 outputs on every example: from memory, the disk cache, or computed once."""
        if self._baseline is not None:
            return self._baseline
        from tenantq.quant.plan import QuantPlan

        key = self.baseline_key()
        fid_path = self.cache_dir / f"baseline-{key}-fidelity.parquet"
        gen_path = self.cache_dir / f"baseline-{key}-generations.parquet"
        spec = self.suite.fidelity
        exact = spec is not None and self.config.vocab_size <= spec.exact_vocab_limit
        items = self.needle_items + self.structured_items
        fid = gens = None
        try:
            if self.fidelity_rows is not None and fid_path.is_file():
                fid = fidelity.load_baseline(fid_path, self.fidelity_rows)
            if items and gen_path.is_file():
                gens = _load_generations(gen_path, items)
        except (ValueError, OSError, pa.ArrowException):
            fid = gens = None  # a stale or damaged cache is recomputed, never trusted
        if jax.process_count() > 1:  # one host of a slice: the baseline runs sharded over
            # every host, so all take the cached path or none does (else one would wait in a
            # collective the others never start)
            from tenantq.engine.sharding import on_every_host

            fid = fid if on_every_host(fid is not None) else None
            gens = gens if on_every_host(gens is not None) else None
        need_fid = self.fidelity_rows is not None and fid is None
        if need_fid or (items and gens is None):
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            engine = self.build_engine(QuantPlan())
            if need_fid:
                fid = fidelity.compute_baseline(
                    engine, self.fidelity_rows, exact=exact, top_k=spec.top_k,
                    tail_samples=spec.tail_samples, seed=self.suite.seed,
                    kv_tokens=self.fidelity_kv_tokens,
                )  # fmt: skip
                fidelity.save_baseline(fid, fid_path)
            if items and gens is None:
                gens = self._generate(engine, items)
                _save_generations(gens, items, gen_path)
        self._baseline = {"fidelity": fid, "generations": gens or []}
        return self._baseline

    def _generate(self, engine, items) -> list[Generated]:
        needle_items = [i for i in items if isinstance(i, needle_grid.NeedleItem)]
        other = [i for i in items if not isinstance(i, needle_grid.NeedleItem)]
        out = self._needles(engine, needle_items) if needle_items else []
        return out + (self._structured(engine, other) if other else [])

    def _structured(self, engine, items) -> list[Generated]:
        return structured.run_items(engine, items, self.suite.structured.max_new_tokens)

    def _needles(self, engine, items) -> list[Generated]:
        return needle_grid.run_needles(
            engine, items, chunk_tokens=self.step_tokens, kv_tokens=self.kv_window_tokens
        )

    # ------------------------------------------------------------------ evaluate
    def evaluate(self, plan) -> EvalResult:
        """Every task of the suite for `plan`; a pool too small for the suite is a ValueError."""
        from tenantq.engine import CacheFull

        try:
            return self._evaluate(plan)
        except CacheFull as err:
            raise ValueError(
                f"the suite does not fit the engine's KV pool under this plan ({err}); give "
                "the pool more bytes (engine_options pool_bytes / --pool-bytes)"
            ) from None

    def tasks(self) -> list[FidelityTask | PassFailTask]:
        """The suite's tasks over the drawn examples, in the baseline's order."""
        out: list[FidelityTask | PassFailTask] = []
        if self.fidelity_rows is not None:
            out.append(FidelityTask(
                self.fidelity_rows, self.fidelity_kv_tokens, self.suite.resamples,
                self.suite.seed,
            ))  # fmt: skip
        if self.needle_items:
            out.append(PassFailTask(
                "needles", self.needle_items, "len", self._needles, needle_grid.score,
                steps=len(self.suite.needles),
            ))  # fmt: skip
        if self.structured_items:
            out.append(PassFailTask(
                "structured", self.structured_items, "task",
                self._structured,
                lambda item, gen: structured.score(item, gen, self.tokenizer),
                offset=len(self.needle_items),
            ))  # fmt: skip
        return out

    def _evaluate(self, plan) -> EvalResult:
        began = time.perf_counter()
        timings = dict.fromkeys(PHASES, 0.0)
        timings["load"] = self.load_s if self._evaluations == 0 else 0.0
        self._evaluations += 1
        with _phase(timings, "baseline"):
            base = self.baseline()
        with _phase(timings, "quantize"):
            engine = self.build_engine(plan)
        self._baseline_passes: dict[str, tuple[int, int]] = {}
        rows: list[dict[str, Any]] = []
        summary: dict[str, float | int | str] = {}
        todo = self.tasks()
        items = len(self.needle_items) + len(self.structured_items)
        if len(base["generations"]) > items:  # each task takes its slice: a missing record
            # fails its pairing, one too many would be left over unseen
            raise ValueError(
                f"the baseline holds {len(base['generations'])} generations for {items} "
                "needle and structured items: it was drawn for other examples"
            )
        bar = _progress(self.progress, sum(t.steps for t in todo))
        try:
            for task in todo:
                bar.set_description(task.phase)
                task_base = task.baseline_of(base)
                with _phase(timings, task.phase, engine):
                    measured = task.run(engine, task_base)
                summary.update(task.summarize(task_base, measured, rows))
                self._baseline_passes.update(getattr(task, "baseline_passes", {}))
                bar.update(task.steps)
        finally:
            bar.close()
        timings["compile"] = engine.stats.compile_s
        timings["total"] = time.perf_counter() - began + timings["load"]
        gates = gates_for(self.suite, summary)
        summary.update(decision_words(gates))
        summary.update(baseline_pass_warnings(self.suite, self._baseline_passes))
        summary.update(unreachable_gate_warnings(self.suite, self._gate_examples()))
        summary.update({
            "suite.name": self.suite.name, "suite.split": self.suite.split,
            "identity.model": self.identity[:16], "identity.dataset": self.dataset_hash[:16],
            "identity.plan": plan.fingerprint(), "examples.n": len(rows),
            "passed": int(all(g.constraint <= 0 for g in gates.values())),
        })  # fmt: skip
        memory = engine.memory_report().as_dict()
        if engine.mesh is not None and jax.process_count() > 1:  # one host of a slice
            memory["host"] = engine.host_memory()
        return EvalResult(
            summary=summary, gates=gates, examples=_examples_table(rows),
            timings_s={k: round(v, 4) for k, v in timings.items()},
            memory_report=memory,
        )  # fmt: skip


def gates_for(suite: Suite, summary: dict[str, Any]) -> dict[str, Gate]:
    """The suite's gates decided on a summary's deltas and CIs: verdict (non-inferiority
    against the tolerance), constraint, and the two-sided `changed` flag (exact McNemar for a
    pass/fail delta, whose p sits under the delta's name with mcnemar_p for acc_delta; the
    CI excluding no change for a continuous one)."""
    gates = {}
    for g in suite.gates:
        value = float(summary[g.metric])
        low = float(summary.get(f"{g.metric}.ci_low", value))
        high = float(summary.get(f"{g.metric}.ci_high", value))
        ref = 1.0 if g.metric.endswith("ppl_ratio") else 0.0  # a ratio's "no change" is 1
        lo, hi = low - ref, high - ref
        p_value = None
        if ".acc_delta" in g.metric:
            p_value = float(summary[g.metric.replace(".acc_delta", ".mcnemar_p", 1)])
        gates[g.metric] = Gate(
            g.metric, value, low, high, g.tolerance, g.higher_is_better,
            stats.verdict(lo, hi, g.tolerance, higher_is_better=g.higher_is_better),
            stats.constraint(lo, hi, g.tolerance, higher_is_better=g.higher_is_better),
            changed=stats.changed(lo, hi, p_value=p_value),
        )  # fmt: skip
    return gates


def decision_words(gates: dict[str, Gate]) -> dict[str, str]:
    """`verdict.<metric>` and `changed.<metric>` summary entries (MLflow tags, report, CLI)."""
    out = {f"verdict.{k}": g.verdict for k, g in gates.items()}
    out.update({f"changed.{k}": stats.CHANGED_WORDS[g.changed] for k, g in gates.items()})
    return out


# ---------------------------------------------------------------------- helpers
@contextmanager
def _phase(timings: dict[str, float], name: str, engine=None):
    """Wall seconds of a phase, less the compile seconds the engine counted inside it."""
    began = time.perf_counter()
    compiled = engine.stats.compile_s if engine is not None else 0.0
    yield
    spent = time.perf_counter() - began
    if engine is not None:
        spent -= engine.stats.compile_s - compiled
    timings[name] += spent


def _progress(enabled: bool, total: int):
    from tenantq.model.terminal import progress_bar

    return progress_bar(total, enabled=enabled, unit="task", leave=False)


def _check_gates(suite: Suite, metrics: list[str]) -> None:
    for g in suite.gates:
        if g.metric not in metrics:
            raise ValueError(
                f"suite {suite.name!r} gates {g.metric!r}, which it does not measure; "
                f"measured deltas: {', '.join(metrics)}"
            )


_EXAMPLE_SCHEMA = pa.schema([
    ("task", pa.string()), ("example_id", pa.string()), ("length", pa.int32()),
    ("depth", pa.float32()), ("baseline_score", pa.float64()), ("candidate_score", pa.float64()),
    ("kl", pa.float64()), ("top1_agree", pa.float64()), ("margin", pa.float64()),
    ("candidate_margin", pa.float64()), ("flip", pa.string()),
    ("baseline_tokens", pa.list_(pa.int32())), ("candidate_tokens", pa.list_(pa.int32())),
    ("baseline_margins", pa.list_(pa.float64())),
])  # fmt: skip


def _examples_table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=_EXAMPLE_SCHEMA)


def _save_generations(gens: list[Generated], items, path: Path) -> None:
    table = pa.table({
        "example_id": [i.example_id for i in items],
        "tokens": pa.array([g.tokens for g in gens], pa.list_(pa.int32())),
        "margins": pa.array([g.margins for g in gens], pa.list_(pa.float64())),
    })  # fmt: skip
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def _load_generations(path: Path, items) -> list[Generated]:
    table = pq.read_table(path)
    if table.column("example_id").to_pylist() != [i.example_id for i in items]:
        raise ValueError(f"baseline cache {path} holds other examples")
    return [
        Generated(list(t), list(m))
        for t, m in zip(
            table.column("tokens").to_pylist(), table.column("margins").to_pylist(), strict=True
        )
    ]
