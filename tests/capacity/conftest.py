"""Shared helpers for the capacity tests: the odd-sized tiny config and an in-process CLI runner."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from tenantq.testing import odd_config


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """Run `tenantq capacity ...` the way the lead's dispatcher does (ValueError -> exit 2)."""
    from tenantq.cli import capacity

    parser = argparse.ArgumentParser(prog="tenantq")
    sub = parser.add_subparsers(dest="command", required=True)
    capacity.add_parser(sub)
    args = parser.parse_args(["capacity", *argv])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = capacity.run(args)
        except ValueError as exc:
            print(f"tenantq capacity: error: {exc}", file=err)
            rc = 2
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def tiny():
    """`tiny(**overrides)`: the shared odd-sized config (packing pads, groups run partial)."""
    return odd_config
