"""The docs cannot drift: the site builds strictly and every command they show runs.

`mkdocs build --strict` (mkdocs.yml, docs/, the API reference from the docstrings) must finish
without one warning. Every ```console block of README.md and docs/**/*.md is run: its `$ `
lines (with their `\\` continuations) in bash, in a fresh folder per page; the block must exit 0
and each line it shows as output must appear in what the commands printed. A block too slow
for the suite is marked `<!-- not-run: REASON; covered by tests/PATH.py::TEST -->` and skipped,
and each test it names must exist. `<!-- file: NAME -->` before a block writes it to NAME in
the page's folder first. docs/developer.md ("The docs") describes the conventions.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
# The README shows `make demo` and `make test`; a front page is about 150 lines (issue 27).
README_MAX_LINES = 200
README_IMAGE_MAX_BYTES = 300 * 1024
# Pages whose runnable blocks take more than ~5 s on a loaded 2-core machine: `tenantq formats`
# quantizes a 4096x4096 weight in every format; getting started runs a capacity-only study;
# search and capacity run several commands that import Optuna/MLflow or the planner.
SLOW_PAGES = {
    "docs/getting-started.md",
    "docs/guide/formats.md",
    "docs/guide/search.md",
    "docs/guide/capacity.md",
}
BLOCK_TIMEOUT_S = 300

_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
_MARKER = re.compile(r"^<!--\s*(not-run|file):\s*(.*?)\s*-->$")
_COVERED = re.compile(r"(tests/[\w/.-]+\.py)::(\w+)")


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    not_run: str | None = None  # the marker's text
    file_name: str | None = None
    commands: list[str] = field(default_factory=list)
    shown_output: list[str] = field(default_factory=list)


def parse_blocks(text: str, page: str) -> list[Block]:
    """Fenced code blocks with the marker on the nearest non-blank line above each."""
    lines = text.split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        start = i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line)
            i += 1
        i += 1  # the closing fence
        block = Block(page, start + 1, lang, "\n".join(body) + "\n")
        above = start - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        marker = _MARKER.match(lines[above].strip()) if above >= 0 else None
        if marker:
            kind, value = marker.groups()
            if kind == "not-run":
                block.not_run = value
            else:
                block.file_name = value
        if lang == "console":
            block.commands, block.shown_output = parse_console(block.text)
        blocks.append(block)
    return blocks


def parse_console(text: str) -> tuple[list[str], list[str]]:
    """`$ ` lines (joined with their `\\` continuations) and the output lines shown."""
    commands: list[str] = []
    shown: list[str] = []
    continuing = False
    for line in text.split("\n"):
        if continuing:
            commands[-1] += "\n" + line
            continuing = line.rstrip().endswith("\\")
        elif line.startswith("$ "):
            commands.append(line[2:])
            continuing = line.rstrip().endswith("\\")
        elif line.strip() and not line.strip().startswith("#") and line.strip() != "...":
            shown.append(line)
    return commands, shown


def _collapse(text: str) -> str:
    return " ".join(text.split())


def _all_blocks() -> list[Block]:
    return [
        block
        for page in PAGES
        for block in parse_blocks(page.read_text(), str(page.relative_to(ROOT)))
    ]


def _runnable_pages() -> list:
    pages = sorted(
        {b.page for b in _all_blocks() if b.lang == "console" and b.commands and not b.not_run}
    )
    return [
        pytest.param(page, marks=pytest.mark.slow) if page in SLOW_PAGES else page for page in pages
    ]


def _page_folder(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A fresh folder with what the docs' commands name, and an environment to run them."""
    from tenantq.reference import reference_model_path

    work = tmp_path / "work"
    work.mkdir()
    (work / "experiments").symlink_to(ROOT / "experiments", target_is_directory=True)
    (work / "my-checkpoint").symlink_to(reference_model_path(), target_is_directory=True)
    shutil.copy(ROOT / "experiments" / "plans" / "w8-fp8-kv-fp8.json", work / "plan.json")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, exec_line in {
        "tenantq": f'exec "{sys.executable}" -m tenantq "$@"',
        "python": f'exec "{sys.executable}" "$@"',
    }.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{exec_line}\n")
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env["PATH"]])
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "platform"), env.get("PYTHONPATH")) if p
    )
    env["JAX_PLATFORMS"] = "cpu"
    return work, env


@pytest.mark.slow  # 2 s on an idle machine, 8 s at load average 7
def test_the_site_builds_strictly_without_warnings(tmp_path) -> None:
    # --strict turns every warning (a broken link or anchor, a page missing from the nav, a
    # docstring griffe cannot read) into a failed build; the second check catches a plugin
    # that logs a warning without counting it.
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log[-4000:]}"
    assert "WARNING" not in log, log[-4000:]
    assert (tmp_path / "api" / "numerics" / "index.html").is_file()
    api = (tmp_path / "api" / "numerics" / "index.html").read_text()
    assert 'id="tenantq.numerics.codec.quantize"' in api  # the API came from the docstrings


@pytest.mark.parametrize("page", _runnable_pages())
def test_console_blocks_of_the_page_run(page: str, tmp_path) -> None:
    work, env = _page_folder(tmp_path)
    blocks = parse_blocks((ROOT / page).read_text(), page)
    for block in blocks:
        if block.file_name:
            (work / block.file_name).write_text(block.text)
    for block in blocks:
        if block.lang != "console" or block.not_run or not block.commands:
            continue
        script = "set -e\n" + "\n".join(block.commands) + "\n"
        proc = subprocess.run(
            ["bash", "-c", script],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
        where = f"{page}:{block.line}"
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{where}: exit {proc.returncode}\n{script}\n{out[-3000:]}"
        printed = _collapse(out)
        for line in block.shown_output:
            assert _collapse(line) in printed, f"{where}: shown output not printed: {line!r}"


def test_every_skipped_block_names_a_test_that_exists() -> None:
    skipped = [b for b in _all_blocks() if b.not_run is not None]
    assert skipped, "no block is marked not-run: the marker parser is broken"
    problems = []
    for block in skipped:
        where = f"{block.page}:{block.line}"
        covered = _COVERED.findall(block.not_run)
        if not covered:
            problems.append(f"{where}: names no covering test (tests/PATH.py::TEST)")
        for path, name in covered:
            source = ROOT / path
            if not source.is_file() or not re.search(
                rf"^\s*def {name}\(", source.read_text(), re.M
            ):
                problems.append(f"{where}: {path}::{name} does not exist")
    listing = "\n".join(f"  {b.page}:{b.line}: {b.not_run}" for b in skipped)
    print(f"console blocks not run ({len(skipped)}):\n{listing}")
    assert not problems, "\n".join(problems)


def test_the_docs_show_commands_that_run() -> None:
    # A bound against a parser that silently finds nothing: the guide shows at least the
    # formats, capacity, --check and --help commands (counted when this test was written: 19).
    runnable = [
        c for b in _all_blocks() if b.lang == "console" and not b.not_run for c in b.commands
    ]
    assert len(runnable) >= 15, runnable
    assert any(c.startswith("tenantq search") and "--check" in c for c in runnable)


@pytest.mark.slow  # imports jax and most of tenantq: 3 s idle, 10 s at load average 12
def test_python_examples_parse_and_import_names_that_exist() -> None:
    # The ```python examples need a checkpoint or a plan to run, so they are not run; but a
    # renamed or moved function is the drift they suffer first: each must parse, and every
    # `from tenantq... import NAME` / `import tenantq...` in it must resolve now.
    import importlib

    problems = []
    for block in _all_blocks():
        if block.lang != "python":
            continue
        where = f"{block.page}:{block.line}"
        try:
            tree = ast.parse(block.text)
        except SyntaxError as e:
            problems.append(f"{where}: not Python: {e}")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tenantq"):
                try:
                    module = importlib.import_module(node.module)
                except ImportError:
                    problems.append(f"{where}: no module {node.module}")
                    continue
                for alias in node.names:
                    if not hasattr(module, alias.name):
                        try:
                            importlib.import_module(f"{node.module}.{alias.name}")
                        except ImportError:
                            problems.append(f"{where}: {node.module} has no {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("tenantq"):
                        try:
                            importlib.import_module(alias.name)
                        except ImportError:
                            problems.append(f"{where}: no module {alias.name}")
    assert not problems, "\n".join(problems)


def test_commands_are_shown_only_in_console_blocks() -> None:
    # A ```sh or ```bash block would be neither run nor marked: the drift this file prevents.
    shell = [f"{b.page}:{b.line}" for b in _all_blocks() if b.lang in {"sh", "bash", "shell"}]
    assert not shell, f"show commands in ```console blocks ($ lines): {shell}"


def test_the_parser_reads_continuations_output_and_markers() -> None:
    text = (
        "<!-- not-run: slow; covered by tests/x.py::test_y -->\n"
        "```console\n$ tenantq capacity --model a \\\n    --context 8   # comment\n"
        "tenants  3\n# a comment line\n...\n$ tenantq formats\n```\n\n"
        "<!-- file: spec.toml -->\n\n```toml\nmodel = 'x'\n```\n"
    )
    console, toml = parse_blocks(text, "p.md")
    assert console.not_run == "slow; covered by tests/x.py::test_y"
    assert console.commands == [
        "tenantq capacity --model a \\\n    --context 8   # comment",
        "tenantq formats",
    ]
    assert console.shown_output == ["tenants  3"]
    assert (toml.file_name, toml.text, toml.not_run) == ("spec.toml", "model = 'x'\n", None)


def test_ci_installs_the_docs_extra_and_runs_make_test() -> None:
    # CI runs `.ci/run` -> `make test`; the Makefile's install line must bring the docs extra,
    # or the build test above could not run there. The extra's versions are pinned (==).
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(), re.M)
    install = re.search(r"pip install .*-e '\.\[([\w,]+)\]'", (ROOT / "Makefile").read_text())
    assert install and "docs" in install.group(1).split(","), "Makefile installs no docs extra"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = {re.split(r"[=<>\[]", r)[0].lower() for r in extras["docs"]}
    assert {"mkdocs", "mkdocs-material", "mkdocstrings", "mkdocstrings-python"} <= names
    assert all("==" in r for r in extras["docs"]), extras["docs"]


def test_the_readme_is_a_front_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    assert "make demo" in readme and "make test" in readme
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", readme)
    assert images, "the README shows no picture of a study's front"
    for image in images:
        path = ROOT / image
        assert path.is_file(), image
        assert path.stat().st_size < README_IMAGE_MAX_BYTES, (image, path.stat().st_size)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{image} is not a PNG"
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), f"README links to a missing page: {link}"
    for command in ("formats", "capacity", "eval", "sensitivity", "search", "report"):
        assert f"tenantq {command}" in readme, command
