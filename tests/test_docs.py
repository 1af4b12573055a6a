"""The docs cannot drift: the site builds strictly and every command they show runs.

`mkdocs build --strict` (mkdocs.yml, docs/, the API reference from the docstrings) must finish
without one warning. Every ```console block of README.md and docs/**/*.md is run: its `$ `
lines (with their `\\` continuations) in bash (`set -eo pipefail`), in a fresh folder per page;
the block must exit 0 and each line it shows as output must appear in what the commands
printed. A block too slow for the suite is marked `<!-- not-run: REASON; covered by
tests/PATH.py::TEST -->` and skipped; each test it names must be one pytest collects, and its
`tenantq ...` commands must still parse with the CLI's own parser. `<!-- file: NAME -->` before
a block writes it to NAME in the page's folder first. The README's links (and their anchors)
and the API pages (one per package) are checked too. docs/developer.md ("The docs") describes
the conventions.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from _serial_group import plain_id

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
# Anything that looks like the start of a marker: it must be a whole `_MARKER` line with only
# blank lines between it and a fence, or it would silently stop applying (a block run that
# was meant to be skipped, a file not written).
_MARKER_START = re.compile(r"^\s*<!--\s*(not-run|file)\b")
# A covering test as written in a not-run marker; the name is checked against what pytest
# collects, so anything after `::` up to a space, `;`, `,` or `)` is taken whole.
_COVERED = re.compile(r"(tests/[\w/.-]+\.py)::([^\s;,)]+)")
# Packages of platform/tenantq/ with no page under docs/api/, on purpose: the CLI is documented
# by its --help and the guide pages, the benchmarks by docs/results/, and `testing` holds the
# test suite's tiny model, not a user API.
API_EXCLUDED = {"cli", "bench", "testing"}


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


def misplaced_markers(text: str, page: str) -> list[str]:
    """Marker lines that are malformed or not followed (blank lines aside) by a fence."""
    lines = text.split("\n")
    problems = []
    for i, line in enumerate(lines):
        if not _MARKER_START.match(line):
            continue
        where = f"{page}:{i + 1}"
        if not _MARKER.match(line.strip()):
            problems.append(f"{where}: a marker is one line `<!-- not-run|file: TEXT -->`")
            continue
        after = i + 1
        while after < len(lines) and not lines[after].strip():
            after += 1
        if after >= len(lines) or not _FENCE.match(lines[after]):
            problems.append(f"{where}: the marker is not right above a fence (blank lines only)")
    return problems


def cli_words(command: str) -> list[str] | None:
    """The arguments after `tenantq` of a `$ tenantq ...` command (or of one run after `--`,
    as `ray job submit ... -- tenantq ...`), up to its first shell operator (pipe,
    redirection, `;`, `&&`) or comment; None for any other command."""
    lexer = shlex.shlex(command.replace("\\\n", " "), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words = []
    for word in lexer:
        if word and set(word) <= set("|&;<>()"):
            break
        words.append(word)
    if words[:1] == ["tenantq"]:
        return words[1:]
    for i in range(len(words) - 1):
        if words[i : i + 2] == ["--", "tenantq"]:
            return words[i + 2 :]
    return None


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
        script = "set -eo pipefail\n" + "\n".join(block.commands) + "\n"
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


def _covering_tests() -> dict[str, list[str]]:
    """Each `tests/PATH.py::NAME` the not-run markers name -> the blocks naming it."""
    named: dict[str, list[str]] = {}
    for block in _all_blocks():
        for path, name in _COVERED.findall(block.not_run or ""):
            named.setdefault(f"{path}::{name}", []).append(f"{block.page}:{block.line}")
    return named


def test_every_skipped_block_names_a_test_function() -> None:
    # Fast and static: each named test is a module-level `def test_...` of an existing file
    # (the slow test below asks pytest itself).
    skipped = [b for b in _all_blocks() if b.not_run is not None]
    assert skipped, "no block is marked not-run: the marker parser is broken"
    problems = [
        f"{b.page}:{b.line}: names no covering test (tests/PATH.py::test_NAME)"
        for b in skipped
        if not _COVERED.search(b.not_run)
    ]
    for test_id, where in _covering_tests().items():
        path, name = test_id.split("::")
        name = name.split("[")[0]  # a parametrized case: its function
        source = ROOT / path
        defined = source.is_file() and any(
            isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name
            for node in ast.parse(source.read_text()).body
        )
        if not (name.startswith("test_") and defined):
            problems.append(f"{', '.join(where)}: {test_id} is no test function of that file")
    listing = "\n".join(f"  {b.page}:{b.line}: {b.not_run}" for b in skipped)
    print(f"console blocks not run ({len(skipped)}):\n{listing}")
    assert not problems, "\n".join(problems)


@pytest.mark.slow  # run alone: collects the named test files, 36-140 s at load 17-32
def test_every_test_a_skipped_block_names_is_collected_by_pytest(request) -> None:
    # A test defined but not collected (a helper named test_*, a file pytest does not pick up,
    # a typo in the path) covers nothing; pytest's own collection is the judge. In `make test`
    # this session (each xdist worker alike) has already collected the whole suite: its items
    # are that verdict at no cost. Run alone, or with -k/-m, what they lack is collected anew.
    named = _covering_tests()

    def ids(nodeids) -> set[str]:
        plain = [plain_id(i) for i in nodeids]  # xdist's `@serial` off
        return {*plain, *(i.split("[")[0] for i in plain)}

    collected, log = ids(item.nodeid for item in request.session.items), ""
    rest = sorted(set(named) - collected)
    if rest:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
             "--continue-on-collection-errors", *rest],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )  # fmt: skip
        collected |= ids(line.strip() for line in proc.stdout.splitlines() if "::" in line)
        log = proc.stdout[-2000:] + proc.stderr
    missing = {test_id: where for test_id, where in named.items() if test_id not in collected}
    assert not missing, f"not collected by pytest: {missing}\n{log}"


def test_skipped_tenantq_commands_parse_with_the_cli_parser() -> None:
    # A block that is not run can still drift: a renamed or missing flag. Its `tenantq ...`
    # commands go through the real parser (exit 2 on a wrong or missing argument).
    import contextlib
    import io

    from tenantq.cli import build_parser

    parser = build_parser()
    checked, problems = 0, []
    for block in _all_blocks():
        if block.lang != "console" or block.not_run is None:
            continue
        for command in block.commands:
            words = cli_words(command)
            if words is None:
                continue
            checked += 1
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    parser.parse_args(words)
            except SystemExit as exit_:
                if exit_.code not in (0, None):  # 0: --help
                    problems.append(f"{block.page}:{block.line}: {command}\n  {err.getvalue()}")
    # Bound: the skipped blocks show at least the study, report and sensitivity commands.
    assert checked >= 5, checked
    assert not problems, "\n".join(problems)


def test_markers_sit_right_above_their_fence() -> None:
    problems = [p for page in PAGES for p in misplaced_markers(page.read_text(), page.name)]
    assert not problems, "\n".join(problems)


def test_every_console_block_shows_a_command_or_is_marked() -> None:
    # A ```console block without a `$ ` line would run nothing and check nothing.
    empty = [
        f"{b.page}:{b.line}"
        for b in _all_blocks()
        if b.lang == "console" and not b.commands and b.not_run is None
    ]
    assert not empty, f"console blocks with no `$ ` line (mark them not-run or add one): {empty}"


def test_the_docs_show_commands_that_run() -> None:
    # A bound against a parser that silently finds nothing: the guide shows at least the
    # formats, capacity, --check and --help commands (17 on 2026-12-02).
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
    for command in ("formats", "capacity", "eval", "sensitivity", "search", "report"):
        assert f"tenantq {command}" in readme, command


def _slugs(markdown_text: str) -> set[str]:
    """The anchors mkdocs gives a page's headings (the toc extension's own slugify)."""
    from markdown.extensions.toc import slugify

    slugs = set()
    in_fence = False
    for line in markdown_text.split("\n"):
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)):
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).replace("`", "")
            slugs.add(slugify(text, "-"))
    return slugs


def test_the_readmes_links_reach_a_page_and_heading() -> None:
    # The README is not part of the mkdocs build, so --strict does not check its links.
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(((?:docs/|#)[^)\s]*)\)", readme)
    assert len(links) >= 10, links  # the README's table and "where next" list link the guide
    problems = []
    for link in links:
        path, _, anchor = link.partition("#")
        page = ROOT / path if path else ROOT / "README.md"
        if not page.is_file():
            problems.append(f"{link}: no such file")
        elif anchor and page.suffix == ".md" and anchor not in _slugs(page.read_text()):
            problems.append(f"{link}: {path or 'README.md'} has no heading with anchor #{anchor}")
    assert not problems, "\n".join(problems)


def test_the_slugs_are_the_ones_mkdocs_makes() -> None:
    assert _slugs("## The quickstart study (`make demo`)\n```\n# not a heading\n```\n") == {
        "the-quickstart-study-make-demo"
    }


def test_every_package_has_an_api_page() -> None:
    # One docs/api/NAME.md per package of platform/tenantq/ (API_EXCLUDED aside, on purpose),
    # each rendering that package with mkdocstrings, and listed in mkdocs.yml's nav.
    packages = {p.parent.name for p in (ROOT / "platform" / "tenantq").glob("*/__init__.py")}
    pages = {p.stem for p in (ROOT / "docs" / "api").glob("*.md")} - {"index"}
    assert packages >= API_EXCLUDED, API_EXCLUDED - packages  # an exclusion names a package
    assert pages == packages - API_EXCLUDED, (
        f"packages without a page: {sorted(packages - API_EXCLUDED - pages)}; "
        f"pages without a package: {sorted(pages - packages)}"
    )
    nav = (ROOT / "mkdocs.yml").read_text()
    for name in pages:
        assert f"::: tenantq.{name}\n" in (ROOT / "docs" / "api" / f"{name}.md").read_text()
        assert f"api/{name}.md" in nav, name


@pytest.mark.slow  # a 2-trial study, Ray started by the CLI: 95-187 s at load 17-33; not timed idle
@pytest.mark.e2e
def test_getting_started_study_runs_through_the_cli(tmp_path) -> None:
    # The newcomer's path of docs/getting-started.md, section 6, which is too slow to run as
    # shown: the page's own my-study.toml on `my-checkpoint`, run by the page's own
    # `tenantq search my-study.toml` line in a fresh folder, with two changes only: 2 trials
    # instead of 20, and the e2e tests' tiny suite (tests/search/tiny_suite.toml, copied
    # beside the spec: a path in the spec is relative to the working folder) for "quick".
    page = "docs/getting-started.md"
    work, env = _page_folder(tmp_path)
    blocks = parse_blocks((ROOT / page).read_text(), page)
    spec = next(b for b in blocks if b.file_name == "my-study.toml").text
    # The section-6 block (not run by the page test: it is marked not-run).
    study = [c for b in blocks if b.not_run for c in b.commands if "search my-study" in c]
    assert study, f"{page}: no skipped `tenantq search my-study.toml` line; update this test"
    shutil.copy(ROOT / "tests" / "search" / "tiny_suite.toml", work / "tiny_suite.toml")
    small = {"trials = 20": "trials = 2", 'suite = "quick"': 'suite = "tiny_suite.toml"'}
    for old, new in small.items():
        assert old in spec, f"{page}: my-study.toml no longer has {old!r}; update this test"
        spec = spec.replace(old, new)
    (work / "my-study.toml").write_text(spec)
    command = study[0]
    proc = subprocess.run(
        ["bash", "-c", "set -eo pipefail\n" + command],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S * 2,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{out[-3000:]}"
    # What the page says the study does: it prints its front, re-measures it on the held-out
    # split and writes the front's plans to runs/my-study/front/, next to the sqlite stores.
    assert "confirmed fidelity.kl_mean" in out, out[-3000:]
    plans = sorted((work / "runs" / "my-study" / "front").glob("*.json"))
    assert plans, out[-3000:]
    assert (work / "optuna.db").is_file() and (work / "mlflow.db").is_file()
