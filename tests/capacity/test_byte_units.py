"""Byte quantities, reserves, hardware and preset registration, exactly as their docstrings
state them (found unpinned by `make mutation TARGETS=capacity`). `parse_reserve` takes a
fraction strictly inside (0, 1), a percentage strictly inside (0%, 100%), or bytes with a
unit; `parse_bytes` an exact whole, non-negative count in decimal or binary units.
"""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from tenantq.capacity import get_model_config, presets
from tenantq.capacity.hardware import HardwareProfile
from tenantq.capacity.units import (
    RESERVE_FORMS,
    exact_bytes,
    human_bytes,
    parse_bytes,
    parse_reserve,
)


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


def test_a_reserve_beyond_any_memory_names_the_limit_and_the_forms():
    with pytest.raises(ValueError) as err:
        parse_reserve("1e999999999GiB")
    assert str(err.value) == (
        "reserve: '1e999999999GiB' is more than 2^64 bytes (16 EiB), larger than any memory; "
        f"write {RESERVE_FORMS}"
    )


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (4096, 4096),  # an int passes as it is
        (0, 0),  # zero bytes is a valid size; only negatives are not
        ("0", 0),
        ("1", 1),
        ("1_000 B", 1000),  # separators people type are dropped
        ("1,000B", 1000),
        ("2kB", 2000),
        ("2KiB", 2048),
        ("1.5e9", 1_500_000_000),
        ("18446744073709551616", 2**64),  # the largest accepted
        ("16777216TiB", 2**64),
    ],
)
def test_parse_bytes_reads_exact_counts(text, want):
    assert parse_bytes(text) == want


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (True, "size: expected a byte count, got True"),
        ("x", "size: cannot read 'x' as bytes; write e.g. 4GiB, 512MiB, 16GB or 1000000"),
        (
            "4 parsecs",
            "size: cannot read '4 parsecs' as bytes; write e.g. 4GiB, 512MiB, 16GB or 1000000",
        ),
        ("1e999999999999999999999B", "size: cannot read '1e999999999999999999999B' as bytes"),
        ("1.5B", "size: '1.5B' is not a whole number of bytes"),
        (-5, "size: must not be negative, got -5"),
        # Above 2^64 bytes: refused before int() (which would build a billion-digit int for
        # 1e999999999GiB, or overflow Decimal's exponent range first); 2^64 itself passes.
        ("1e400GiB", "size: '1e400GiB' is more than 2^64 bytes (16 EiB), larger than any memory"),
        (
            "1e999999999GiB",
            "size: '1e999999999GiB' is more than 2^64 bytes (16 EiB), larger than any memory",
        ),
        (
            "18446744073709551617",
            "size: '18446744073709551617' is more than 2^64 bytes (16 EiB), larger than any memory",
        ),  # fmt: skip
        (
            2**64 + 1,
            "size: 18446744073709551617 is more than 2^64 bytes (16 EiB), larger than any memory",
        ),  # fmt: skip
    ],
)
def test_parse_bytes_errors_are_one_named_line(text, message):
    with pytest.raises(ValueError) as err:
        parse_bytes(text)
    assert str(err.value) == message


def test_hardware_memory_must_be_a_positive_int():
    # One byte is the smallest memory a profile may have; zero, negative or a string is not.
    assert HardwareProfile("one-byte", 1, None, "").hbm_bytes == 1
    for bad in (0, -1, "16GiB"):
        with pytest.raises(ValueError) as err:
            HardwareProfile("x", bad, None, "")
        assert str(err.value) == "hardware x: memory must be a positive byte count"


def test_registered_preset_reads_its_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(presets, "_FOLDER_PRESETS", {})
    (tmp_path / "config.json").write_text(json.dumps(presets.PRESETS["qwen2.5-7b"]))
    presets.register_preset("  My-Model ", tmp_path)  # stored stripped and lower-cased
    presets.register_preset("lazy", lambda: tmp_path)  # a callable is called when read
    for name in ("my-model", "lazy"):
        assert get_model_config(name) == get_model_config("qwen2.5-7b")
    with pytest.raises(ValueError) as err:
        presets.register_preset("Qwen2.5-7B", tmp_path)
    assert str(err.value) == "preset 'qwen2.5-7b' is built in; choose another name"


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (2 * 1024**4, "2.00 TiB"),
        (5 * 1024**2, "5.00 MiB"),
        (3 * 1024, "3.00 KiB"),
        (1_024_000, "0.98 MiB"),  # from 1000 KiB on, the larger unit (0.98 MiB, not 1000 KiB)
        (1_023_999, "1000.00 KiB"),  # one byte below that threshold
        (512, "512 B"),
        (0.5, "0.50 B"),
    ],
)
def test_human_bytes_picks_the_unit_at_1000_of_the_smaller_one(n, text):
    assert human_bytes(n) == text


def test_exact_bytes_keeps_fractions_without_trailing_zeros():
    # KV bytes per token amortise a page's scales: fractional bytes are printed as they are.
    assert exact_bytes(34_359_738_368) == "34,359,738,368"
    assert exact_bytes(1234.5) == "1,234.5"
    assert exact_bytes(0.25) == "0.25"
