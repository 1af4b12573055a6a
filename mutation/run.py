"""Mutation testing of the modules where a silent error costs most (`make mutation`).

Runs mutmut (3.x) over one target of mutation/targets.toml at a time, against that
target's own test files, and prints the score and every surviving mutant. mutmut expects
its sources under `src/`; ours live under `platform/`, so each target runs in a staging
copy (.tenantq-cache/mutation/NAME: src/ = platform/, tests/, experiments/,
pyproject.toml): the working tree is
never mutated. Survivors listed in mutation/EQUIVALENT.md (each argued there) are left out
of the score. Exit status 1 when a target scores below --min-score.

mutmut runs the mutants whose tests it estimates fastest first, so in a run stopped early
the functions every test reaches come last: `--mutants PATTERN...` runs only the named
mutants (mutmut's fnmatch names) in the existing staging copy, keeping earlier results, and
mutants never run ("not checked") are counted apart, not as survivors.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "mutation"
STATUS_LINE = re.compile(r"^\s+(\S+__mutmut_\d+): (.+)$")
DETECTED = {"killed", "timeout", "segfault", "caught by type check"}


def equivalent_mutants() -> set[str]:
    """Mutant names listed in EQUIVALENT.md as '- `name`: why'."""
    text = (HERE / "EQUIVALENT.md").read_text()
    return set(re.findall(r"^- `([^`]+__mutmut_\d+)`", text, flags=re.M))


def _sources(target: dict) -> list[str]:
    """A target's `source`: one glob or a list of them."""
    source = target["source"]
    return [source] if isinstance(source, str) else list(source)


def stage(
    name: str,
    target: dict,
    jobs: int,
    keep: bool = False,
    timeout: tuple[float, float] = (15.0, 10.0),
) -> Path:
    """A fresh staging copy for one target; with `keep`, the existing one (its results and
    test-to-function stats stand) with today's tests copied over it."""
    where = ROOT / ".tenantq-cache" / "mutation" / name
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    if keep and (where / "mutants").is_dir():
        for dest in (where / "tests", where / "mutants" / "tests"):
            shutil.copytree(ROOT / "tests", dest, ignore=skip, dirs_exist_ok=True)
        # The target's test files may have grown since: mutmut runs the new tests' stats.
        (where / "setup.cfg").write_text(_setup_cfg(target, timeout))
        return where
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    shutil.copytree(ROOT / "platform", where / "src", ignore=skip)
    shutil.copytree(ROOT / "tests", where / "tests", ignore=skip)
    # Some tests read the shipped plans and specs (tests/test_experiment_plans.py).
    shutil.copytree(ROOT / "experiments", where / "experiments", ignore=skip)
    shutil.copy2(ROOT / "pyproject.toml", where / "pyproject.toml")
    (where / "setup.cfg").write_text(_setup_cfg(target, timeout))
    return where


def _setup_cfg(target: dict, timeout: tuple[float, float] = (15.0, 10.0)) -> str:
    """mutmut's configuration for one target: what to mutate, which tests judge it, and
    `timeout` = (timeout_multiplier, timeout_constant)."""
    lines = [
        "[mutmut]",
        "source_paths = src",
        "only_mutate =",
        *[f"    src/{s}" for s in _sources(target)],
        "pytest_add_cli_args_test_selection =",
        *[f"    {t}" for t in target["tests"]],
        # Services and multi-minute runs stay out: a mutant is judged by its unit tests.
        "pytest_add_cli_args =",
        "    -p",
        "    no:cacheprovider",
        "    -m",
        "    not e2e",
        # JAX starts threads once it runs: fork each mutant from a server that has only
        # imported and collected the tests (no JAX backend started yet).
        "also_copy =",
        "    experiments",
        "process_isolation = forkserver",
        "forkserver_warmup = collect",
        # mutmut stops a mutant's tests after (recorded time + constant) * multiplier seconds
        # of wall time (twice that of CPU) and counts it a "timeout", i.e. killed. Its
        # constant of 1 s lets a correct but slow run on a loaded machine pass for a kill.
        f"timeout_multiplier = {timeout[0]}",
        f"timeout_constant = {timeout[1]}",
    ]
    return "\n".join(lines) + "\n"


def run_target(
    name: str,
    target: dict,
    jobs: int,
    mutmut: str,
    patterns: list[str] | None = None,
    timeout: tuple[float, float] = (15.0, 10.0),
) -> tuple[int, int, list[str], Path, int]:
    where = stage(name, target, jobs, keep=bool(patterns), timeout=timeout)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # Mutants re-run the same jitted functions: share compiled code across processes.
    env.update(
        JAX_COMPILATION_CACHE_DIR=str(ROOT / ".tenantq-cache" / "mutation" / "jax-cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    print(f"== {name}: mutating {' '.join(_sources(target))} against {' '.join(target['tests'])}")
    cmd = ["nice", "-n", "15", mutmut, "run", "--max-children", str(jobs), *(patterns or [])]
    done = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True)
    (where / "mutmut-run.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
        raise SystemExit(f"mutmut run failed for {name} (exit {done.returncode})")
    listed = subprocess.run(
        [mutmut, "results", "--all", "true"], cwd=where, env=env, capture_output=True, text=True
    ).stdout
    statuses = dict(m.groups() for line in listed.splitlines() if (m := STATUS_LINE.match(line)))
    equivalent = equivalent_mutants()
    unrun = {"skipped", "not checked"}
    judged = {k: v for k, v in statuses.items() if k not in equivalent and v not in unrun}
    killed = sum(v in DETECTED for v in judged.values())
    survivors = sorted(k for k, v in judged.items() if v not in DETECTED)
    not_checked = sum(v == "not checked" for v in statuses.values())
    return killed, len(judged), [f"{k} ({judged[k]})" for k in survivors], where, not_checked


def main(argv: list[str] | None = None) -> int:
    targets = tomllib.loads((HERE / "targets.toml").read_text())["targets"]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", help=f"any of {', '.join(targets)} (default all)")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once (default 2)")
    parser.add_argument("--min-score", type=float, default=90.0, help="percent (default 90)")
    parser.add_argument(
        "--tests", nargs="+", help="run these test files instead of the target's own (one target)"
    )
    parser.add_argument(
        "--mutants",
        nargs="+",
        metavar="PATTERN",
        help="run only these mutants (fnmatch on mutmut's names; one target), keeping the "
        "staging copy's earlier results",
    )
    parser.add_argument(
        "--timeout-multiplier",
        type=float,
        default=15.0,
        help="mutmut's timeout_multiplier: a mutant's tests may take this many times their "
        "recorded time (plus the constant) before it counts as a timeout (default 15)",
    )
    parser.add_argument(
        "--timeout-constant",
        type=float,
        default=10.0,
        help="mutmut's timeout_constant, seconds added to the recorded time (default 10; "
        "mutmut's own 1 s counts slow, correct runs on a loaded machine as kills)",
    )
    args = parser.parse_args(argv)
    if args.timeout_multiplier <= 0 or args.timeout_constant < 0:
        parser.error("--timeout-multiplier must be > 0 and --timeout-constant >= 0")
    unknown = [t for t in args.targets if t not in targets]
    if unknown:
        parser.error(f"unknown target(s) {unknown}; known: {', '.join(targets)}")
    if args.tests:
        if len(args.targets) != 1:
            parser.error("--tests needs exactly one target")
        targets[args.targets[0]]["tests"] = args.tests
    if args.mutants and len(args.targets) != 1:
        parser.error("--mutants needs exactly one target")
    mutmut = str(Path(sys.executable).with_name("mutmut"))
    if not Path(mutmut).exists():
        parser.error("mutmut is not installed: pip install -e '.[mutation]' (make mutation does)")
    rows, failed = [], False
    for name in args.targets or list(targets):
        killed, total, survivors, where, not_checked = run_target(
            name,
            targets[name],
            args.jobs,
            mutmut,
            args.mutants,
            (args.timeout_multiplier, args.timeout_constant),
        )
        score = 100.0 * killed / total if total else 100.0
        failed |= score < args.min_score
        rows.append((name, killed, total, score))
        print(f"   {name}: {killed}/{total} killed = {score:.1f}%  (survivors: {len(survivors)})")
        if not_checked:
            print(f"   {name}: {not_checked} mutants not run yet (not in the score)")
        for s in survivors:
            print(f"      {s}")
        if survivors:
            print(f"   diff of one: cd {where} && mutmut show NAME")
    print("\ntarget          killed/judged  score")
    for name, killed, total, score in rows:
        print(f"{name:<15} {killed:>6}/{total:<6}  {score:5.1f}%")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
