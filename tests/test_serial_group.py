"""`make test` runs on pytest-xdist workers with `--dist loadgroup`; tests that start Ray,
servers or bind ports share the `serial` group (tests/_serial_group.py) and so one worker. The
group travels as a `@serial` suffix of the node id, which pytest-xdist 3.8 loses under pytest
9.2 without `LoadgroupIds` (every test then lands on any worker, silently).

A synthetic folder of eight trivial tests, run by the real plugin in this process: the xdist
controller here, its two workers as subprocesses (2-3 s of CPU together).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from pathlib import Path
from _serial_group import register

def pytest_configure(config):
    config.addinivalue_line("markers", "e2e: serial")
    register(config, Path(__file__).parent / "cluster")
"""

# Serial and plain tests interleaved in collection order: xdist hands its first work to both
# workers at once, so without the group the serial ones would land on both. Serial: everything
# under cluster/, an `e2e` function, one `e2e` parameter of three (with an `@` in its id, which
# xdist's scheduler must not read as a group), an `e2e` class.
FILES = {
    "cluster/test_c.py": "def test_cluster(): pass\n",
    "test_a.py": """
import pytest

def test_plain_1(): pass

@pytest.mark.e2e
def test_e2e(): pass

def test_plain_2(): pass

@pytest.mark.parametrize("x", ["a@b", pytest.param("c@d", marks=pytest.mark.e2e), "e"])
def test_param(x): pass

@pytest.mark.e2e
class TestE2E:
    def test_method(self): pass

def test_plain_3(): pass
""",
}
SERIAL = {
    "cluster/test_c.py::test_cluster",
    "test_a.py::test_e2e",
    "test_a.py::test_param[c@d]",
    "test_a.py::TestE2E::test_method",
}
PLAIN = {
    "test_a.py::test_plain_1",
    "test_a.py::test_plain_2",
    "test_a.py::test_plain_3",
    "test_a.py::test_param[a@b]",
    "test_a.py::test_param[e]",
}


@pytest.fixture
def folder(pytester: pytest.Pytester, monkeypatch) -> pytest.Pytester:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # see _runs
    pytester.makeconftest(CONFTEST)
    for name, text in FILES.items():
        (pytester.path / name).parent.mkdir(exist_ok=True)
        (pytester.path / name).write_text(text)
    return pytester


def _runs(folder: pytest.Pytester, *args: str) -> dict[str, str]:
    """node id as reported -> the worker that ran it ("" without xdist). Only xdist's plugin is
    loaded (in this process and in the workers, which read the same variable): the others'
    imports were most of a worker's start. `--strict-markers` as in pyproject.toml: without
    xdist nobody else declares the `xdist_group` marker the plugin adds; pytest remembers the
    markers it has checked for the whole process, so that run is a subprocess."""
    if "no:xdist" in args:
        result = folder.runpytest_subprocess(
            "-p", "no:cacheprovider", "--strict-markers", "-v", *args
        )
        result.assert_outcomes(passed=len(SERIAL) + len(PLAIN))
        return {line.split(" PASSED")[0]: "" for line in result.outlines if " PASSED" in line}
    result = folder.runpytest_inprocess(
        "-p", "xdist.plugin", "-p", "no:cacheprovider", "--strict-markers", *args
    )  # fmt: skip
    result.assert_outcomes(passed=len(SERIAL) + len(PLAIN))
    reports = result.reprec.getreports("pytest_runtest_logreport")
    return {r.nodeid: getattr(getattr(r, "node", None), "gateway", None) and r.node.gateway.id
            or "" for r in reports if r.when == "call"}  # fmt: skip


def test_the_serial_group_runs_on_one_worker_with_serial_ids(folder) -> None:
    ran = _runs(folder, "-n", "2", "--dist", "loadgroup")
    assert set(ran) == {i + "@serial" for i in SERIAL} | PLAIN, ran
    assert len({ran[i + "@serial"] for i in SERIAL}) == 1, ran  # one worker for the group
    assert len(set(ran.values())) == 2, ran  # both workers had work: the check means something


@pytest.mark.parametrize(
    "args", [(), ("-p", "no:xdist"), ("-n", "0"), ("-n", "2", "--dist", "load")]
)
def test_without_loadgroup_the_ids_are_pytests_own(folder, args) -> None:
    # `--lf`, `-k` and the docs' covering-tests check see plain ids outside `--dist loadgroup`.
    assert set(_runs(folder, *args)) == SERIAL | PLAIN


FAILING = """
import pytest

def test_plain_fails(): assert 0

@pytest.mark.e2e
def test_e2e_fails(): assert 0
"""


@pytest.mark.parametrize("rerun", [("-n", "2", "--dist", "loadgroup"), ("-p", "no:xdist")])
def test_last_failed_reruns_the_serial_groups_failures_too(folder, rerun) -> None:
    # xdist's run records `test_e2e_fails@serial` as failed; pytest's `--lf` filters a file's
    # tests by their collected ids, which have no suffix yet (and, on the second file with a
    # failure, drops every test it does not find), so the serial failure was never rerun.
    (folder.path / "test_f.py").write_text(FAILING)
    first = folder.runpytest_inprocess("-p", "xdist.plugin", "-n", "2", "--dist", "loadgroup")
    first.assert_outcomes(passed=len(SERIAL) + len(PLAIN), failed=2)
    xdist = () if "no:xdist" in rerun else ("-p", "xdist.plugin")
    again = folder.runpytest_inprocess(*xdist, "--strict-markers", "--lf", *rerun)
    again.assert_outcomes(failed=2)
    assert {r.nodeid.split("::")[-1].split("@")[0] for r in again.reprec.getfailures()} == {
        "test_plain_fails", "test_e2e_fails"}  # fmt: skip
