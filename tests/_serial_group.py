"""The `serial` pytest-xdist group as a plugin (tests/conftest.py registers it): which tests
share one worker under `make test` (`-n 2 --dist loadgroup`), and the `@group` node-id suffix
that carries the group to xdist's scheduler. A module of its own so that
tests/test_serial_group.py can run it on a synthetic folder without the suite's conftest.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SERIAL_GROUP = "serial"


class SerialGroup:
    """Tests that start Ray (`ray start --head`, `ray.init`), an MLflow server, PostgreSQL or
    Chromium, or bind ports, must not run beside each other (ports, Ray's session dir, and two
    Ray clusters on 2 cores push every deadline): every test marked `e2e` and everything under
    `cluster_dir` goes into one xdist group, which one worker runs from start to end."""

    def __init__(self, cluster_dir: Path) -> None:
        self.cluster_dir = Path(cluster_dir)

    def is_serial(self, item: pytest.Item) -> bool:
        return item.get_closest_marker("e2e") is not None or self.cluster_dir in item.path.parents

    @pytest.hookimpl(tryfirst=True)  # before xdist's hook reads the groups into the node ids
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            if self.is_serial(item):
                item.add_marker(pytest.mark.xdist_group(SERIAL_GROUP))


class LoadgroupIds:
    """pytest-xdist 3.8 passes a test's group to its scheduler as a `@group` suffix of the node
    id, written to `item._nodeid` in its worker's `pytest_collection_modifyitems`; since pytest
    9.2 the id lives in `item._id` and that write is lost, so every group is silently spread
    over the workers (pytest-xdist issue 1386, fix proposed in PR 1388). After xdist's hook, a
    grouped item whose id lacks the suffix gets it here, as xdist writes it; with an xdist that
    writes it itself this does nothing. Only on xdist workers under `--dist loadgroup` (the only
    place xdist sets `config.option.loadgroup`): plain pytest, `-p no:xdist`, `-n 0` and
    `--dist load` keep their ids."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]):
        if not getattr(config.option, "loadgroup", False):
            return
        for item in items:
            names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                            for m in item.iter_markers("xdist_group")})  # fmt: skip
            suffix = "@" + "_".join(names)
            if names and not item.nodeid.endswith(suffix):
                if hasattr(item, "_id"):  # pytest >= 9.2: the structured id, parsed from text
                    item._id = type(item._id).parse(item.nodeid + suffix)
                else:
                    item._nodeid = item.nodeid + suffix


def plain_id(nodeid: str) -> str:
    """A node id without xdist's `@group` suffix (an `@` after the last `]`, as xdist reads it)."""
    head, at, group = nodeid.rpartition("@")
    return head if at and "]" not in group else nodeid


class LastFailedIds:
    """`--lf` after a `--dist loadgroup` run: pytest records the failed `x@serial`, but filters
    each file's tests by the ids they are collected with, `x`, and keeps on the second file with
    a failure only what it finds, so a failed serial test was never rerun (with or without
    xdist). Each failure is recorded under its plain id too, and a pass or skip of either id
    forgets both (pytest's own rule, `LFPlugin.pytest_runtest_logreport`, just before this)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        lf = self.config.pluginmanager.get_plugin("lfplugin")
        if lf is None:
            return
        key = getattr(report, "id", report.nodeid)  # pytest >= 9.2 keys by the structured id
        plain = plain_id(report.nodeid)
        twins = [k for k in lf.lastfailed if plain_id(str(k)) == plain]
        if key in lf.lastfailed:
            if plain != report.nodeid:
                lf.lastfailed[type(key).parse(plain) if hasattr(key, "parse") else plain] = True
        else:
            for twin in twins:
                del lf.lastfailed[twin]


def register(config: pytest.Config, cluster_dir: Path) -> None:
    # xdist declares its marker only when loaded: `-p no:xdist` with --strict-markers (our
    # addopts) would stop collection at the first serial test.
    config.addinivalue_line("markers", "xdist_group(name): pytest-xdist's group (loadgroup)")
    config.pluginmanager.register(SerialGroup(cluster_dir), "tenantq-serial-group")
    config.pluginmanager.register(LoadgroupIds(), "tenantq-loadgroup-ids")
    config.pluginmanager.register(LastFailedIds(config), "tenantq-last-failed-ids")
