"""Byte quantities as people type them ("4GiB", "16 GB", "15%") and as the budget prints them.

Decimal units (kB, MB, GB, TB = powers of 1000) and binary ones (KiB, MiB, GiB, TiB =
powers of 1024) are both accepted and never confused: a budget that is exact to the
byte must not turn "16GB" into 16 GiB. A memory share is a fraction below 1, a percentage
or bytes with a unit, never a bare number that could be either. Printing shows the exact
integer first.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation, Overflow
from fractions import Fraction

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
# No memory a budget describes comes near 2^64 bytes (16 EiB); a larger figure is a typo,
# and refusing it before `int()` keeps "1e999999999GiB" from building a billion-digit int.
MAX_BYTES = 2**64
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
        except Overflow:  # beyond Decimal's exponent range, e.g. 1e999999999GiB
            raise _too_large(what, text) from None
        if amount > MAX_BYTES:
            raise _too_large(what, text)
        if amount != amount.to_integral_value():
            raise ValueError(f"{what}: {text!r} is not a whole number of bytes")
        value = int(amount)
    if value < 0:
        raise ValueError(f"{what}: must not be negative, got {text!r}")
    if value > MAX_BYTES:
        raise _too_large(what, text)
    return value


def _too_large(what: str, text: object) -> ValueError:
    return ValueError(f"{what}: {text!r} is more than 2^64 bytes (16 EiB), larger than any memory")


RESERVE_FORMS = (
    "a fraction of memory in (0, 1) like 0.15, a percentage in (0%, 100%) like 15%, "
    "or bytes with a unit like 4GiB (B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)"
)


def parse_reserve(text: str, *, what: str | None = "reserve") -> tuple[Fraction | None, int | None]:
    """A share of memory as (fraction, None) or (None, bytes), from exactly one of three forms.

    `0.15` (a fraction strictly between 0 and 1), `15%` (a percentage strictly between 0%
    and 100%), or `4GiB` (bytes with a unit; `0B` is an explicit zero). A bare number of 1
    or more (`1`, `4096`: bytes or everything?) and anything else is a ValueError that
    shows the three forms (prefixed by `what:` unless `what` is None).
    """
    given = text
    text = str(text).strip()
    prefix = "" if what is None else f"{what}: "

    def bad(reason: str) -> ValueError:
        return ValueError(f"{prefix}{given!r} {reason}; write {RESERVE_FORMS}")

    if not text:
        raise bad("is empty")
    if text.endswith("%"):
        try:
            percent = Fraction(text[:-1].strip())
        except (ValueError, ZeroDivisionError):
            raise bad("is not a percentage") from None
        if not 0 < percent < 100:
            raise bad("is outside (0%, 100%)")
        return percent / 100, None
    try:
        number = Fraction(text)
    except (ValueError, ZeroDivisionError):
        number = None
    if number is not None:  # a bare number: only a fraction below 1 is unambiguous
        if 0 < number < 1:
            return number, None
        if number >= 1:
            raise bad("has no unit (a bare number must be a fraction below 1)")
        raise bad("is not a fraction in (0, 1)")
    match = _QUANTITY.match(text)
    if match is None or not match.group(2) or match.group(2).lower() not in _UNITS:
        raise bad("is neither a fraction, a percentage nor bytes with a unit")
    try:
        return None, parse_bytes(text, what=what or "bytes")
    except ValueError as err:
        raise ValueError(f"{err}; write {RESERVE_FORMS}") from None


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
