"""Which code a study ran: the tree's git commit, or what `cluster/submit.sh` passed along.

A Ray job's upload and an image carry no .git; the submitter's commit arrives in the job's
environment, and when nothing is known the record says so instead of guessing.
"""

from __future__ import annotations

import subprocess

from tenantq.tracking import code_version, source_tags
from tenantq.tracking.runs import SOURCE_COMMIT_ENV, SOURCE_DIRTY_ENV


def test_submitted_commit_is_recorded_as_mlflows_git_commit(monkeypatch) -> None:
    monkeypatch.setenv(SOURCE_COMMIT_ENV, "a" * 40)
    monkeypatch.setenv(SOURCE_DIRTY_ENV, "true")
    assert source_tags() == {
        "mlflow.source.git.commit": "a" * 40,
        "tenantq.source.dirty": "true",
        "tenantq.source.origin": "submitted",
    }
    assert code_version() == "a" * 40 + "+dirty"


def test_tree_without_git_records_that_the_commit_is_unknown(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(SOURCE_COMMIT_ENV, raising=False)
    tags = source_tags(tmp_path)  # no .git above a fresh tmp folder
    assert "mlflow.source.git.commit" not in tags
    assert tags["tenantq.source.dirty"] == "unknown"
    assert tags["tenantq.source.origin"].startswith("unknown: no .git above")
    assert SOURCE_COMMIT_ENV in tags["tenantq.source.origin"]
    assert code_version(tmp_path).startswith("tenantq-")


def test_git_checkout_records_its_commit_and_dirty_flag(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(SOURCE_COMMIT_ENV, raising=False)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    sha = subprocess.run(
        [*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert source_tags(tmp_path) == {
        "mlflow.source.git.commit": sha,
        "tenantq.source.dirty": "false",
        "tenantq.source.origin": "git",
    }
    (tmp_path / "a.py").write_text("x = 2\n")
    assert source_tags(tmp_path)["tenantq.source.dirty"] == "true"
