"""`parse_reserve`'s three forms, their open boundaries and its one-line errors, exactly as its
docstring states them (found unpinned by `make mutation TARGETS=capacity`): a fraction
strictly inside (0, 1), a percentage strictly inside (0%, 100%), or bytes with a unit.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from tenantq.capacity.units import RESERVE_FORMS, parse_reserve


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("0.15", (Fraction(15, 100), None)),
        ("0.999", (Fraction(999, 1000), None)),  # just below 1: still a fraction
        ("15%", (Fraction(15, 100), None)),
        ("0.5%", (Fraction(5, 1000), None)),  # between 0% and 1%: inside (0%, 100%)
        ("99.5 %", (Fraction(995, 1000), None)),
        ("4GiB", (None, 4 * 1024**3)),
        ("16 GB", (None, 16 * 1000**3)),  # decimal unit: not GiB
        ("0B", (None, 0)),  # the explicit zero
    ],
)
def test_each_form_reads_exactly(text, want):
    assert parse_reserve(text) == want


# (text, the reason the message must give); the boundaries are open: 0, 1, 0%, 100% are out.
BAD = [
    ("", "is empty"),
    ("x%", "is not a percentage"),
    ("0%", "is outside (0%, 100%)"),
    ("100%", "is outside (0%, 100%)"),
    ("100.5%", "is outside (0%, 100%)"),
    ("1", "has no unit (a bare number must be a fraction below 1)"),
    ("1.5", "has no unit (a bare number must be a fraction below 1)"),
    ("4096", "has no unit (a bare number must be a fraction below 1)"),
    ("0", "is not a fraction in (0, 1)"),
    ("-0.5", "is not a fraction in (0, 1)"),
    ("1,000", "is neither a fraction, a percentage nor bytes with a unit"),  # no unit
    ("4 parsecs", "is neither a fraction, a percentage nor bytes with a unit"),
]


@pytest.mark.parametrize(("text", "reason"), BAD)
def test_bad_reserve_is_one_line_naming_the_value_and_the_forms(text, reason):
    with pytest.raises(ValueError) as err:
        parse_reserve(text)
    assert str(err.value) == f"reserve: {text!r} {reason}; write {RESERVE_FORMS}"
    with pytest.raises(ValueError) as err:
        parse_reserve(text, what="--reserve")
    assert str(err.value).startswith(f"--reserve: {text!r} {reason}; write ")
    with pytest.raises(ValueError) as err:
        parse_reserve(text, what=None)  # no prefix at all
    assert str(err.value) == f"{text!r} {reason}; write {RESERVE_FORMS}"


def test_bytes_that_are_not_whole_name_the_field_and_the_forms():
    # 1.5 B is not a whole byte: parse_bytes's message, under the caller's name (or "bytes").
    with pytest.raises(ValueError) as err:
        parse_reserve("1.5B", what="reserve")
    assert str(err.value) == (
        f"reserve: '1.5B' is not a whole number of bytes; write {RESERVE_FORMS}"
    )
    with pytest.raises(ValueError) as err:
        parse_reserve("1.5B", what=None)
    assert str(err.value) == f"bytes: '1.5B' is not a whole number of bytes; write {RESERVE_FORMS}"
