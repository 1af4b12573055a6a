"""The guard in tests/_cwd_guard.py fails a test that leaves something new in the folder
pytest runs in, or inside a cache folder already there (a checkout that ran `tenantq` before
has `.tenantq-cache/`), and lets a test that writes under tmp_path pass. Run in this process on
a synthetic folder (well under a second)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent


def test_a_write_into_the_current_folder_fails_naming_it(
    pytester: pytest.Pytester, monkeypatch
) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # no other plugin: faster
    pytester.makeconftest(f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from _cwd_guard import nothing_written_to_the_current_folder
""")  # fmt: skip
    (pytester.path / ".tenantq-cache" / "calibration").mkdir(parents=True)  # there before
    pytester.makepyfile(
        test_w="""
from pathlib import Path

def test_new_cache_entry():
    Path(".tenantq-cache/calibration/key").mkdir()

def test_new_top_level_file():
    Path("optuna.db").write_text("")

def test_under_tmp_path(tmp_path):
    (tmp_path / ".tenantq-cache").mkdir()
"""
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_new_cache_entry*",
        "written into *, the folder pytest runs in, by this test: .tenantq-cache/calibration/key;*",
        "*ERROR at teardown of test_new_top_level_file*",
        "written into *: optuna.db; write under tmp_path instead",
    ])  # fmt: skip
