"""The exhaustive ground truth of a finite space, kept in the repository as a JSON-lines table.

One row per measured plan (fingerprint, choice, tenants, quality metrics, model and dataset
hashes, commit, seconds). `measure` adds the plans the table lacks, merging each batch into the
file under a lock and rewriting it atomically, so a kill loses at most the batch in flight and
two passes keep each other's rows; a table of another model, dataset or space is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tenantq.model.files import CACHE_DIR, atomic_write_text

TRUTH_DIR = Path(__file__).resolve().parents[3] / "experiments" / "ground-truth"
BATCH_PLANS = 10  # plans per atomic rewrite of the table
BATCH_S = 300.0  # ... or seconds, whichever comes first
METRIC_PREFIXES = ("fidelity.", "examples.", "passed")  # the summary keys a row keeps
# Every plan compiles its own executables; a pass that keeps them all ran out of memory maps
# after ~326 plans (XLA "LLVM compilation error: Cannot allocate memory": each compiled
# executable holds mappings, and vm.max_map_count is 65,530 by default). So every
# RELEASE_EVERY plans the pass drops them (`release_compiled`); a plan is measured afresh.
RELEASE_EVERY = 25
MAX_FAILED_IN_A_ROW = 3  # consecutive plans that fail: a fault of the pass, not of the plans


class TruthTableError(ValueError):
    """The table cannot be used as it is (a damaged row, plans missing); the message says why."""


class StaleTruthError(TruthTableError):
    """The table was measured on another model or dataset (or space) than today's."""


def code_commit(repo: Path = TRUTH_DIR.parents[1]) -> str:
    """HEAD of the checkout that runs the measurement, '+dirty' when platform/ has changes."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                             check=True)  # fmt: skip
        return out.stdout.strip()

    try:
        head, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", "platform")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def current_keys(model_path: Path, suite) -> tuple[str, str]:
    """(model identity, dataset hash) of today's model and suite, as a measurement records."""
    from tenantq.evals import Evaluator

    evaluator = Evaluator(model_path, suite, cache_dir=CACHE_DIR / "ground-truth")
    return evaluator.identity, evaluator.dataset_hash


def read_table(
    path: str | Path, *, model: str | None = None, dataset: str | None = None
) -> dict[str, dict[str, Any]]:
    """fingerprint -> row for every row of `path` (none if the file is absent). With `model`
    and `dataset` given, a row measured on other ones raises StaleTruthError."""
    path = Path(path)
    if not path.exists():
        return {}
    rows: dict[str, dict[str, Any]] = {}
    line_of: dict[str, int] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            fingerprint = row["fingerprint"]
            missing = {"metrics", "model", "dataset"} - set(row)
            if missing:
                raise KeyError(", ".join(sorted(missing)))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise TruthTableError(
                f"{path}:{n}: not a ground-truth row ({e!r}); fix or remove it"
            ) from e
        if fingerprint in line_of:  # e.g. two tables merged: which figures hold is unknown
            raise TruthTableError(
                f"{path}:{n}: plan {fingerprint} is also on line {line_of[fingerprint]}; keep "
                f"one of the two rows"
            )
        rows[fingerprint], line_of[fingerprint] = row, n
    for key, want in (("model", model), ("dataset", dataset)):
        if want is None:
            continue
        stale = [r for r in rows.values() if r[key] != want]
        if stale:
            raise StaleTruthError(
                f"{path}: {len(stale)} of {len(rows)} rows were measured on {key} "
                f"{stale[0][key][:16]}, today's {key} is {want[:16]}; the table is stale: "
                f"move it aside and measure again (--measure)"
            )
    return rows


def write_table(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    """The whole table, one JSON row per line sorted by fingerprint, written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = sorted(rows, key=lambda r: r["fingerprint"])
    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in ordered))


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on the table's folder (no lock file left beside the table): two passes
    on one table take turns at re-reading and rewriting it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def merge_into_table(
    path: str | Path, new: dict[str, dict[str, Any]], *, model: str, dataset: str
) -> dict[str, dict[str, Any]]:
    """Re-read `path` under a lock and rewrite it with `new` added: rows another pass wrote
    since this one read the table are kept, not overwritten, and a failed row of `new` never
    replaces a measured one (another pass measured that plan meanwhile). Returns the table as
    written."""
    path = Path(path)
    with _locked(path):
        rows = read_table(path, model=model, dataset=dataset)
        for fp, row in new.items():
            if "error" not in row or fp not in rows or "error" in rows[fp]:
                rows[fp] = row
        write_table(path, rows.values())
    return rows


def quality_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The numeric quality figures of an evaluation summary (KL with its interval, top-1,
    perplexity ratio, token and example counts)."""
    return {k: v for k, v in summary.items()
            if k.startswith(METRIC_PREFIXES) and isinstance(v, int | float)}  # fmt: skip


def row_for(point, summary: dict[str, Any], model: str, dataset: str, commit: str,
            seconds: float) -> dict[str, Any]:  # fmt: skip
    return {
        "fingerprint": point.fingerprint, "choice": list(point.choice), "tenants": point.tenants,
        "metrics": quality_metrics(summary), "model": model, "dataset": dataset,
        "commit": commit, "seconds": round(seconds, 3),
    }  # fmt: skip


def rows_from_cache(cache: dict[str, dict[str, Any]], points) -> list[dict[str, Any]]:
    """Rows for the per-plan JSON cache of `efficiency.exhaustive_pass` (the format before this
    table), for the plans of `points` it holds; commit 'unknown' (the cache did not record it)."""
    out = []
    for p in points:
        rec = cache.get(p.fingerprint)
        if rec and "model" in rec and "dataset_hash" in rec:
            seconds = rec.get("timings_s", {}).get("total", 0.0)
            out.append(row_for(p, rec["summary"], rec["model"], rec["dataset_hash"],
                               rec.get("commit", "unknown"), seconds))  # fmt: skip
    return out


def release_compiled() -> int:
    """Drop every compiled executable this process holds (`engine.steps.release_compiled`:
    the engine's LRU and JAX's caches). Returns how many engine executables were dropped."""
    from tenantq.engine import steps

    return steps.release_compiled()


def failed_row(point, error: BaseException, model: str, dataset: str, commit: str,
               seconds: float) -> dict[str, Any]:  # fmt: skip
    """A plan whose evaluation raised: no metrics, the error's first line (a later pass
    measures it again; `efficiency.Landscape` refuses it by name until then)."""
    row = row_for(point, {}, model, dataset, commit, seconds)
    first_line = (str(error).strip().splitlines() or [""])[0]
    row["error"] = f"{type(error).__name__}: {first_line}"
    return row


def measure(
    points,
    model_path: Path,
    path: str | Path,
    *,
    suite,
    limit: int | None = None,
    batch_plans: int = BATCH_PLANS,
    batch_s: float = BATCH_S,
    release_every: int = RELEASE_EVERY,
    shuffle_seed: int | None = None,
    log: Callable[[str], None] = print,
    evaluator=None,
) -> dict[str, dict[str, Any]]:
    """Measure the distinct plans of `points` that `path` lacks (at most `limit` of them; in a
    seeded random order with `shuffle_seed`, so a partial table samples the whole space),
    rewriting the table after every `batch_plans` plans or `batch_s` seconds, and dropping the
    compiled executables every `release_every` plans (`release_compiled`). A plan whose
    evaluation raises (its compile failing, say) is tried once more after a release, then
    written as a failed row (`failed_row`) and the pass goes on; a later pass measures it
    again; MAX_FAILED_IN_A_ROW plans failing in a row stop the pass (after writing what it has).
    Refuses a table measured on another model or dataset before measuring anything."""
    from tenantq.quant.plan import QuantPlan

    if evaluator is None:
        from tenantq.evals import Evaluator

        evaluator = Evaluator(model_path, suite, cache_dir=CACHE_DIR / "ground-truth")
    model, dataset = evaluator.identity, evaluator.dataset_hash
    rows = read_table(path, model=model, dataset=dataset)
    space = {p.fingerprint for p in points}
    foreign = [fp for fp in rows if fp not in space]
    if foreign:
        raise StaleTruthError(
            f"{path}: {len(foreign)} of {len(rows)} rows are plans outside this space (first "
            f"{foreign[0]}); the table belongs to another space: give this space's table"
        )
    todo: dict[str, Any] = {}
    for p in points:
        if p.fingerprint not in rows or "error" in rows[p.fingerprint]:
            todo.setdefault(p.fingerprint, p)
    todo_list = list(todo.values())
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(todo_list)
    todo_list = todo_list[:limit]
    log(f"{path}: {len(rows)} plans measured, {len(todo)} to measure, {len(todo_list)} now")
    commit = code_commit()
    pending: dict[str, dict[str, Any]] = {}
    last_write = began_all = time.perf_counter()
    failed_in_a_row = 0
    for i, p in enumerate(todo_list, 1):
        if release_every and i > 1 and (i - 1) % release_every == 0:
            log(f"released {release_compiled()} compiled executables after {i - 1} plans")
        began = time.perf_counter()
        plan = QuantPlan.from_json(p.plan_json)
        try:
            try:
                result = evaluator.evaluate(plan)
            except Exception as first:  # e.g. XLA out of memory maps: release, try once more
                log(f"[{i}/{len(todo_list)}] {'/'.join(p.choice)} failed ({first!r}); "
                    f"released {release_compiled()} executables, trying once more")  # fmt: skip
                result = evaluator.evaluate(plan)
        except Exception as e:
            seconds = time.perf_counter() - began
            pending[p.fingerprint] = failed_row(p, e, model, dataset, commit, seconds)
            failed_in_a_row += 1
            why = pending[p.fingerprint]["error"]
            log(f"[{i}/{len(todo_list)}] {'/'.join(p.choice)} FAILED: {why}")
            if failed_in_a_row >= MAX_FAILED_IN_A_ROW:
                merge_into_table(path, pending, model=model, dataset=dataset)
                raise TruthTableError(
                    f"{path}: {failed_in_a_row} plans failed in a row (last: "
                    f"{pending[p.fingerprint]['error']}); the pass stopped, their rows written"
                ) from e
            continue
        failed_in_a_row = 0
        seconds = time.perf_counter() - began
        pending[p.fingerprint] = row_for(p, result.summary, model, dataset, commit, seconds)
        kl = result.summary.get("fidelity.kl_mean", float("nan"))
        log(f"[{i}/{len(todo_list)}] {'/'.join(p.choice)} tenants={p.tenants} kl={kl:.5f} "
            f"{seconds:.1f}s")  # fmt: skip
        if len(pending) >= batch_plans or time.perf_counter() - last_write >= batch_s:
            rows = merge_into_table(path, pending, model=model, dataset=dataset)
            pending, last_write = {}, time.perf_counter()
            elapsed = time.perf_counter() - began_all
            log(f"table written: {len(rows)} rows; {60 * i / elapsed:.2f} plans/min this run")
    if pending:
        rows = merge_into_table(path, pending, model=model, dataset=dataset)
    return rows
