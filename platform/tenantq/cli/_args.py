"""Argument types and one-line errors shared by the `tenantq` subcommands.

A user's mistake on the command line is one line on stderr and exit code 2, naming the
argument and what it accepts; argparse's usage block and Python tracebacks are kept for
`--help` and for real internal errors. Types import their domain lazily, so building the
parser stays cheap.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

REQUIRED_PREFIX = "the following arguments are required: "


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make `parser` report errors as `PROG: error: MESSAGE` (one line, exit 2).

    Missing required arguments list what each one accepts (its help text); arguments the
    subcommand does not know are reported by it, with its valid options, not by the
    top-level parser. Applying it twice changes nothing.
    """
    if getattr(parser, "_tenantq_one_line", False):
        return parser
    parser._tenantq_one_line = True  # type: ignore[attr-defined]

    def error(message: str):
        if message.startswith(REQUIRED_PREFIX):
            names = message[len(REQUIRED_PREFIX) :].split(", ")
            message = REQUIRED_PREFIX + "; ".join(_describe(parser, name) for name in names)
        missing_value = re.fullmatch(r"argument (\S+): expected one argument", message)
        if missing_value:  # also "--reserve -4GiB": argparse reads -4GiB as an option
            name = missing_value.group(1).split("/")[-1]
            message += f"; write {_describe(parser, name)}, or {name}=VALUE for a value with '-'"
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    parse_known_args = parser.parse_known_args

    def parse_known_args_strictly(args=None, namespace=None):
        namespace, extras = parse_known_args(args, namespace)
        if extras:
            options = ", ".join(_option_names(parser))
            error(f"unrecognized arguments: {' '.join(extras)}; valid options: {options}")
        return namespace, extras

    parser.error = error
    parser.parse_known_args = parse_known_args_strictly
    return parser


def _option_names(parser: argparse.ArgumentParser) -> list[str]:
    # argparse has no public accessor for its actions; _actions is stable since Python 3.2.
    return [action.option_strings[-1] for action in parser._actions if action.option_strings]


def _describe(parser: argparse.ArgumentParser, name: str) -> str:
    for action in parser._actions:
        if name in action.option_strings and action.help:
            return f"{name} ({action.help.replace('%%', '%')})"
    return name


def positive_int(what: str, *, maximum: int | None = None, example: int = 4096):
    """An argparse type: an integer >= 1 (and <= maximum), else an error naming `what`."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            value = None
        if value is None or value < 1 or (maximum is not None and value > maximum):
            bound = f" up to {maximum:,}" if maximum is not None else ""
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {what}: write a whole number from 1{bound}, e.g. {example}"
            )
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def number_format(text: str) -> str:
    """An argparse type: one of the pinned number format names."""
    from tenantq.numerics.formats import FORMATS

    if text not in FORMATS:
        raise argparse.ArgumentTypeError(
            f"unknown number format {text!r}; valid formats: {', '.join(FORMATS)}"
        )
    return text


def byte_count(what: str, *, example: str = "4GiB"):
    """An argparse type: a byte count >= 1, with a unit or without (`2GiB`, `16GB`,
    `1000000`; `tenantq.capacity.parse_bytes`), else an error naming `what`; the one
    wrapper of `parse_bytes` for every byte-size flag."""

    def parse(text: str) -> int:
        from tenantq.capacity.units import parse_bytes

        try:
            value = parse_bytes(text, what=what)
        except ValueError as err:  # argparse names the argument itself
            raise argparse.ArgumentTypeError(str(err).removeprefix(f"{what}: ")) from None
        if value < 1:
            raise argparse.ArgumentTypeError(
                f"must be at least 1 byte, got {text!r}; write e.g. {example}"
            )
        return value

    parse.__name__ = what
    return parse


def output_folder(value: str | Path, what: str) -> Path:
    """`value` as a folder the command may write into, checked before the work starts so a
    long run does not end in a traceback: an existing folder, or a path whose nearest existing
    parent is a writable folder. Nothing is created here."""
    path = Path(value)
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{what} {path} is a file; give a folder (it is created if missing)")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{what} {path}: the folder is not writable")
        return path
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{what} {path}: {parent} is a file, so the folder cannot be created")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path}: cannot create it, {parent} is not writable")
    return path


def output_file(value: str | Path, what: str, suffix: str | None = None) -> Path:
    """`value` as a file the command will write, checked before the work: not a folder, its
    folder existing and writable, and (if given) ending in `suffix`."""
    path = Path(value)
    if suffix is not None and path.suffix.lower() != suffix:
        raise ValueError(f"{what} {path}: the file name must end in {suffix}")
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder; give a file name ending in {suffix or ''}")
    folder = path.absolute().parent
    if not folder.is_dir():
        raise ValueError(f"{what} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path}: the folder {folder} is not writable")
    return path


def cache_folder(value: str | Path, what: str) -> Path:
    """`value` as a cache folder, created now (a cache may be): a path that cannot be one is
    an error before the work, naming `what`."""
    path = Path(value)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # strerror is None for some OSErrors: fall back to the message
        reason = err.strerror or str(err)
        raise ValueError(f"{what} {path}: cannot create the cache folder ({reason})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path}: the cache folder is not writable")
    return path
