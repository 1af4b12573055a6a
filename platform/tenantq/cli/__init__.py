"""The `tenantq` command: one subcommand per room (formats, capacity, eval, search, ...).

Each subcommand lives in its own module exposing `add_parser(subparsers)` and `run(args)`;
modules are imported lazily so `tenantq formats` does not pay for Ray or MLflow.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from tenantq.cli._args import one_line_errors

# Every module under tenantq.cli with `add_parser`/`run` is a subcommand; this is the order shown
# in --help (modules not named here follow, alphabetically). A new room adds a module, nothing else.
_HELP_ORDER = ["formats", "capacity", "eval", "sensitivity", "search", "report"]


def _subcommands() -> list[str]:
    here = Path(__file__).parent
    found = {p.stem for p in here.glob("*.py") if not p.stem.startswith("_")}
    return [n for n in _HELP_ORDER if n in found] + sorted(found - set(_HELP_ORDER))


SUBCOMMANDS = _subcommands()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tenantq",
        description="How many tenants fit on an accelerator host, and what quantization costs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"tenantq.cli.{name}")
        # Every subcommand's argument mistakes are one line naming the argument (exit 2),
        # not argparse's usage block: the same for all, whatever the module does itself.
        one_line_errors(module.add_parser(sub))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module = importlib.import_module(f"tenantq.cli.{args.command}")
    try:
        return int(module.run(args) or 0)
    except ValueError as err:
        # Bad input is reported as one clear line, not a traceback.
        print(f"tenantq {args.command}: error: {err}", file=sys.stderr)
        return 2
