"""The source version's finer rules: how the submitter's environment is read (blank values,
case, padding), that the dirty flag looks only at the tenantq tree's own folder, and the
code version string each case gives (`git describe`-like: the sha, "+dirty" when edited).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import tenantq
from tenantq.tracking import code_version
from tenantq.tracking.runs import SOURCE_COMMIT_ENV, SOURCE_DIRTY_ENV, source_version


def _git(path, *args):
    base = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t"]
    return subprocess.run([*base, *args], check=True, capture_output=True, text=True).stdout


def test_the_submitted_commit_and_flag_are_trimmed_and_lower_cased(monkeypatch, tmp_path):
    monkeypatch.setenv(SOURCE_COMMIT_ENV, "  abc123\n")
    monkeypatch.setenv(SOURCE_DIRTY_ENV, " FALSE ")
    assert source_version(tmp_path) == {"commit": "abc123", "dirty": "false", "origin": "submitted"}
    assert code_version(tmp_path) == "abc123"


def test_a_submitted_commit_without_a_dirty_flag_is_of_unknown_dirtiness(monkeypatch, tmp_path):
    monkeypatch.setenv(SOURCE_COMMIT_ENV, "abc123")
    monkeypatch.delenv(SOURCE_DIRTY_ENV, raising=False)
    assert source_version(tmp_path)["dirty"] == "unknown"
    monkeypatch.setenv(SOURCE_DIRTY_ENV, "   ")
    assert source_version(tmp_path)["dirty"] == "unknown"
    assert code_version(tmp_path) == "abc123"  # only a known "true" adds +dirty


def test_a_blank_submitted_commit_is_no_commit(monkeypatch, tmp_path):
    monkeypatch.setenv(SOURCE_COMMIT_ENV, "  ")
    monkeypatch.setenv(SOURCE_DIRTY_ENV, "true")
    found = source_version(tmp_path)  # no .git above tmp_path either
    assert found["commit"] == "" and found["dirty"] == "unknown"
    assert found["origin"] == (
        f"unknown: no .git above {tmp_path} and no {SOURCE_COMMIT_ENV} "
        "(submit with cluster/submit.sh)"
    )
    assert code_version(tmp_path) == f"tenantq-{tenantq.__version__}"


def test_a_checkout_is_dirty_only_for_edits_inside_the_source_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(SOURCE_COMMIT_ENV, raising=False)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x = 1\n")
    (tmp_path / "notes.txt").write_text("one\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "one")
    sha = _git(tmp_path, "rev-parse", "HEAD").strip()
    (tmp_path / "notes.txt").write_text("two\n")  # an edit outside the source folder
    assert source_version(tmp_path / "src") == {"commit": sha, "dirty": "false", "origin": "git"}
    assert code_version(tmp_path / "src") == sha
    (tmp_path / "src" / "b.py").write_text("y = 1\n")  # an untracked file inside it
    assert source_version(tmp_path / "src")["dirty"] == "true"
    assert code_version(tmp_path / "src") == sha + "+dirty"


def test_without_a_root_the_tenantq_package_folder_is_asked(monkeypatch):
    monkeypatch.delenv(SOURCE_COMMIT_ENV, raising=False)
    where = Path(tenantq.__file__).resolve().parent
    asked = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True
    )  # the reference: git asked directly in the package's folder
    found = source_version()
    if asked.returncode == 0:
        assert found["commit"] == asked.stdout.strip() and found["origin"] == "git"
    else:  # an installed copy outside any checkout
        assert found["commit"] == "" and found["origin"].startswith(
            f"unknown: no .git above {where}"
        )


def test_a_tenantq_without_a_version_says_unknown(monkeypatch, tmp_path):
    monkeypatch.delenv(SOURCE_COMMIT_ENV, raising=False)
    monkeypatch.delattr(tenantq, "__version__", raising=False)
    assert code_version(tmp_path) == "tenantq-unknown"
