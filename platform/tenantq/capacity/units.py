"""Byte quantities as people type them ("4GiB", "16 GB", "0.1") and as the budget prints them.

Decimal units (kB, MB, GB, TB = powers of 1000) and binary ones (KiB, MiB, GiB, TiB =
powers of 1024) are both accepted and never confused: a budget that is exact to the
byte must not turn "16GB" into 16 GiB. Printing always shows the exact integer first.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
}
_QUANTITY = re.compile(r"^\s*([0-9][0-9_,]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | int, *, what: str = "size") -> int:
    """An exact byte count from `12345`, `"4GiB"`, `"16 GB"`, `"1.5e9"` (whole bytes only)."""
    if isinstance(text, bool):
        raise ValueError(f"{what}: expected a byte count, got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _QUANTITY.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{what}: cannot read {text!r} as bytes; write e.g. 4GiB, 512MiB, 16GB or 1000000"
            )
        try:
            amount = Decimal(match.group(1).replace("_", "").replace(",", "")) * _UNITS[unit]
        except InvalidOperation:
            raise ValueError(f"{what}: cannot read {text!r} as bytes") from None
        if amount != amount.to_integral_value():
            raise ValueError(f"{what}: {text!r} is not a whole number of bytes")
        value = int(amount)
    if value < 0:
        raise ValueError(f"{what}: must not be negative, got {text!r}")
    return value


def human_bytes(n: int | float) -> str:
    """`32.00 GiB`: binary units, two decimals, for reading next to the exact figure."""
    n = float(n)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size * 1000 / 1024:  # 0.98 GiB rather than 1002.49 MiB
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B" if n == int(n) else f"{n:.2f} B"


def exact_bytes(n: int | float) -> str:
    """`34,359,738,368`: the exact count with thousands separators (fractions kept)."""
    if float(n) == int(n):
        return f"{int(n):,}"
    return f"{n:,.4f}".rstrip("0")
