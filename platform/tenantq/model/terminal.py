"""What every command prints to a terminal: plain-text tables and progress bars, set up once.

`text_table` pads columns (to given widths or the widest cell), so the capacity, formats,
front, sensitivity and bench tables are one renderer; `progress_bar` is the one tqdm setup
(stderr, the terminal's width, off when not wanted). It lives in `model` beside `files` for the
same reason: pure Python, and every package that prints imports `model` already.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Sequence
from typing import Any


def text_table(
    head: Sequence[str] | None,
    rows: Sequence[Sequence[str]],
    *,
    widths: Sequence[int] | None = None,
    right: Collection[int] | bool = (),
    sep: str = "  ",
    rule: bool = False,
    indent: str = "",
) -> list[str]:
    """The lines of a table: column i padded to `widths[i]` (default: its widest cell, head
    included), right-aligned where `right` holds i (True: every column), else left; trailing
    spaces stripped. `rule` puts a line of '-' as wide as the head under it. A cell wider than
    its width is kept whole, as an f-string pads it. No head and no rows: no lines."""
    lines = ([list(head)] if head is not None else []) + [list(r) for r in rows]
    if not lines:
        return []
    if widths is None:
        widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]

    def pad(i: int, cell: str) -> str:
        flush = right is True or (right is not False and i in right)
        return cell.rjust(widths[i]) if flush else cell.ljust(widths[i])

    out = [indent + sep.join(pad(i, c) for i, c in enumerate(line)).rstrip() for line in lines]
    if rule and head is not None:
        out.insert(1, "-" * len(out[0]))
    return out


def progress_bar(total: int, *, enabled: bool = True, initial: int = 0, **options: Any):
    """A tqdm bar on stderr that follows the terminal's width; a no-op bar when not
    `enabled`. `options` go to tqdm as they are (desc, unit, leave)."""
    from tqdm import tqdm

    return tqdm(
        total=total, initial=initial, disable=not enabled, file=sys.stderr, dynamic_ncols=True,
        **options,
    )  # fmt: skip
