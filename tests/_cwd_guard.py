"""Every test's guard against writing into the folder pytest runs in (tests/conftest.py
imports the fixture). A module of its own so that tests/test_cwd_guard.py can run it on a
synthetic folder without the suite's conftest.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# A test writes only under tmp_path: a relative default (.tenantq-cache, mlruns, optuna.db,
# reports/) resolved against the folder pytest runs in lands in the checkout, where two xdist
# workers share it. Each test's teardown compares the folder (and those caches, two levels
# down) with what it held before; anything new fails the test, named. Under xdist the other
# worker's test runs meanwhile, so the message says so. Generated caches of Python and pytest
# and the tools' own folders are not the tests' doing.
_CWD_CACHES = (".tenantq-cache", "mlruns", "mlartifacts", "runs", "reports")
_CWD_TOOL_FILES = {"__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache", ".coverage"}


def _cwd_entries(cwd: Path) -> set[str]:
    names = {n for n in os.listdir(cwd) if n not in _CWD_TOOL_FILES}
    for cache in _CWD_CACHES:
        top = cwd / cache
        if top.is_dir():
            for child in os.scandir(top):
                names.add(f"{cache}/{child.name}")
                if child.is_dir(follow_symlinks=False):
                    names.update(f"{cache}/{child.name}/{n}" for n in os.listdir(child.path))
    return names


@pytest.fixture(autouse=True)
def nothing_written_to_the_current_folder(request) -> Iterator[None]:
    cwd = Path.cwd()
    before = _cwd_entries(cwd)
    yield
    new = sorted(_cwd_entries(cwd) - before)
    if new:
        beside = (
            " (or by the test beside it on the other xdist worker)"
            if hasattr(request.config, "workerinput")
            else ""
        )
        pytest.fail(
            f"written into {cwd}, the folder pytest runs in, by this test{beside}: "
            f"{', '.join(new)}; write under tmp_path instead",
            pytrace=False,
        )
