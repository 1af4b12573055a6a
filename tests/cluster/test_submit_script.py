"""`cluster/submit.sh` builds the `ray job submit` command line: what it ships and records.

No Ray: `RAY_BIN` is a stand-in that prints the arguments it was given as JSON, so the
runtime_env the script builds is parsed exactly as `ray job submit` would parse it, from trees
whose paths have spaces and quotes, that are dirty, or that are not git checkouts.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FAKE_RAY = f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n"


def _tree(root: Path, *, git: bool) -> Path:
    """A minimal tree: cluster/submit.sh and platform/tenantq/__init__.py (committed if git)."""
    (root / "cluster").mkdir(parents=True)
    shutil.copy2(REPO / "cluster" / "submit.sh", root / "cluster" / "submit.sh")
    (root / "platform" / "tenantq").mkdir(parents=True)
    (root / "platform" / "tenantq" / "__init__.py").write_text("")
    if git:
        cmd = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run([*cmd, "init", "-q"], check=True)
        subprocess.run([*cmd, "add", "."], check=True)
        subprocess.run([*cmd, "commit", "-qm", "c"], check=True)
    return root


def _submit(tree: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    fake = tmp_path / "fake-ray"
    fake.write_text(FAKE_RAY)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "GIT_"))}
    env["RAY_BIN"] = str(fake)
    return subprocess.run(
        [str(tree / "cluster" / "submit.sh"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _runtime_env(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--runtime-env-json") + 1])


def test_tree_with_spaces_and_quotes_in_its_path_ships_that_package(tmp_path) -> None:
    tree = _tree(tmp_path / 'my "tq" tree', git=True)
    (tree / "platform" / "tenantq" / "edit.py").write_text("")  # untracked: dirty
    done = _submit(tree, tmp_path, "--no-wait", "--", "tenantq", "search", "a b.toml")
    assert done.returncode == 0, done.stderr
    argv = json.loads(done.stdout)
    runtime_env = _runtime_env(argv)
    assert runtime_env["py_modules"] == [str(tree / "platform" / "tenantq")]
    sha = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert runtime_env["env_vars"] == {
        "TENANTQ_SOURCE_COMMIT": sha,
        "TENANTQ_SOURCE_DIRTY": "true",
    }
    assert argv[-6:] == ["--", "python", "-m", "tenantq", "search", "a b.toml"]


def test_tree_outside_git_ships_without_a_commit_and_says_so(tmp_path) -> None:
    tree = _tree(tmp_path / "plain", git=False)
    done = _submit(tree, tmp_path, "--", "tenantq", "search", "s.toml")
    assert done.returncode == 0, done.stderr
    assert "is not a git checkout: the study records its commit as unknown" in done.stderr
    assert "env_vars" not in _runtime_env(json.loads(done.stdout))


def test_flags_that_would_replace_the_shipped_package_are_refused(tmp_path) -> None:
    # `ray job submit` keeps the last of a repeated option: a caller's runtime env or working
    # dir would silently drop the tree's tenantq (py_modules) and its commit.
    tree = _tree(tmp_path / "t", git=True)
    for flag in ("--runtime-env-json", "--runtime-env", "--working-dir"):
        for given in ([flag, "x"], [f"{flag}=x"]):
            done = _submit(tree, tmp_path, *given, "--", "tenantq", "search", "s.toml")
            assert done.returncode == 1, (given, done.stdout)
            assert done.stdout == ""
            line = done.stderr.strip()
            assert "\n" not in line and line.startswith(f"cluster/submit.sh: {flag} "), line
