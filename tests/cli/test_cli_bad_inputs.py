"""Bad command lines for `tenantq formats` and `tenantq capacity`, table-driven.

Each case runs the real dispatcher (`tenantq.cli.main`) in-process and asserts what issue 14
asks of the CLI boundary: exit code 2, exactly one line on stderr and nothing on stdout, no
traceback, and a message that names the argument and what it accepts (the fragments listed
with each case). Then `--reserve`'s three accepted forms, checked against hand arithmetic.
"""

from __future__ import annotations

import contextlib
import io
import json
from fractions import Fraction
from pathlib import Path

import pytest

from tenantq.capacity.units import GiB, parse_reserve
from tenantq.cli import main

CAP = ["capacity", "--model", "llama-3.1-8b", "--hardware", "h200", "--context", "4096"]
RESERVE_FORMS = ("--reserve", "0.15", "15%", "4GiB")
REPO = Path(__file__).resolve().parents[2]
A_FILE, A_FOLDER = str(REPO / "README.md"), str(REPO / "tests")  # exist, but are no plan/model
FORMATS = "bf16, fp16, fp8_e4m3, fp8_e5m2, int8, int4, mxfp8, mxfp4, nvfp4, int2"


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exit_:  # argparse's errors end the process with exit(2)
            rc = exit_.code
    return rc, out.getvalue(), err.getvalue()


# (id, argv, fragments the one-line message must contain: the argument, then valid forms)
CASES = [
    # --reserve: a fraction in (0, 1), a percentage in (0%, 100%), or bytes with a unit.
    ("reserve-1", [*CAP, "--reserve", "1"], RESERVE_FORMS),
    ("reserve-1.0", [*CAP, "--reserve", "1.0"], RESERVE_FORMS),
    ("reserve-100%", [*CAP, "--reserve", "100%"], RESERVE_FORMS),
    ("reserve-0", [*CAP, "--reserve", "0"], RESERVE_FORMS),
    ("reserve-0%", [*CAP, "--reserve", "0%"], RESERVE_FORMS),
    ("reserve-negative", [*CAP, "--reserve", "-0.1"], RESERVE_FORMS),
    ("reserve-negative-bytes", [*CAP, "--reserve=-4GiB"], RESERVE_FORMS),
    ("reserve-dash-value", [*CAP, "--reserve", "-4GiB"], (*RESERVE_FORMS, "--reserve=VALUE")),
    ("reserve-abc", [*CAP, "--reserve", "abc"], RESERVE_FORMS),
    ("reserve-bare-bytes", [*CAP, "--reserve", "4096"], RESERVE_FORMS),
    ("reserve-half-byte", [*CAP, "--reserve", "0.5B"], RESERVE_FORMS),
    ("reserve-unknown-unit", [*CAP, "--reserve", "4 parsecs"], RESERVE_FORMS),
    # counts and sizes
    ("context-word", [*CAP[:-1], "abc"], ("--context", "whole number from 1")),
    ("context-zero", [*CAP[:-1], "0"], ("--context", "whole number from 1")),
    ("context-negative", [*CAP[:-1], "-5"], ("--context", "whole number from 1")),
    ("context-float", [*CAP[:-1], "4096.5"], ("--context", "whole number from 1")),
    ("chips-zero", [*CAP, "--chips", "0"], ("--chips", "whole number from 1")),
    ("chips-word", [*CAP, "--chips", "two"], ("--chips", "whole number from 1")),
    ("page-tokens-zero", [*CAP, "--page-tokens", "0"], ("--page-tokens", "whole number")),
    ("tenants-negative", [*CAP, "--tenants", "-1"], ("--tenants", "whole number from 1")),
    (
        "memory-word",
        [*CAP[:3], "--hardware", "cpu", "--memory", "lots", *CAP[5:]],
        ("--memory", "4GiB"),
    ),  # fmt: skip
    (
        "memory-zero",
        [*CAP[:3], "--hardware", "cpu", "--memory", "0GiB", *CAP[5:]],
        ("--memory", "at least 1 byte", "64GiB"),
    ),  # fmt: skip
    ("cpu-without-memory", [*CAP[:3], "--hardware", "cpu", *CAP[5:]], ("--memory", "64GiB")),
    # names from a closed set list the set
    (
        "hardware-unknown",
        [*CAP[:3], "--hardware", "tpu-v99", *CAP[5:]],
        ("--hardware", "tpu-v6e", "h100-sxm"),
    ),  # fmt: skip
    ("weights-unknown", [*CAP, "--weights", "fp3"], ("--weights", FORMATS)),
    ("kv-unknown", [*CAP, "--kv", "int3"], ("--kv", FORMATS)),
    ("model-unknown", ["capacity", "--model", "gpt-9", *CAP[3:]], ("--model", "llama-3.1-8b")),
    ("model-not-json", ["capacity", "--model", A_FILE, *CAP[3:]], ("--model", "JSON")),
    ("pairs-shape", [*CAP, "--compare", "--pairs", "int4"], ("--pairs", "int4:fp8_e4m3")),
    ("pairs-format", [*CAP, "--compare", "--pairs", "int4:fp7"], ("--pairs", FORMATS)),
    # files
    ("plan-missing", [*CAP, "--plan", "no-such-plan.json"], ("--plan", ".json or .toml")),
    ("plan-directory", [*CAP, "--plan", A_FOLDER], ("--plan", "is a directory", ".json")),
    ("plan-wrong-suffix", [*CAP, "--plan", A_FILE], ("--plan", ".json or .toml")),
    # combinations and the argument list itself
    ("plan-and-weights", [*CAP, "--plan", A_FILE, "--weights", "int4"], ("--plan",)),
    ("pairs-without-compare", [*CAP, "--pairs", "int4:int4"], ("--pairs", "--compare")),
    ("compare-with-weights", [*CAP, "--compare", "--weights", "int4"], ("--compare", "--pairs")),
    ("per-tensor-with-compare", [*CAP, "--compare", "--per-tensor"], ("--per-tensor", "--compare")),
    ("missing-context", CAP[:-2], ("--context", "tokens per tenant")),
    ("unknown-option", [*CAP, "--contxt", "5"], ("--contxt", "--context", "--reserve")),
    # tenantq formats
    ("formats-size-zero", ["formats", "--size", "0"], ("--size", "from 1 up to 16,384")),
    ("formats-size-word", ["formats", "--size", "big"], ("--size", "from 1 up to 16,384")),
    ("formats-size-huge", ["formats", "--size", "100000"], ("--size", "from 1 up to 16,384")),
    ("formats-unknown-option", ["formats", "--sise", "64"], ("--sise", "--size", "--json")),
]


@pytest.mark.parametrize(("argv", "fragments"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_naming_the_argument_and_valid_forms(argv, fragments):
    rc, out, err = run(argv)
    assert rc == 2, (rc, err)
    assert out == "" and "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(f"tenantq {argv[0]}: error: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


@pytest.mark.parametrize(
    ("text", "fraction", "fixed_bytes"),
    [
        ("0.15", Fraction(15, 100), None),
        ("15%", Fraction(15, 100), None),
        (" 12.5 % ", Fraction(1, 8), None),
        ("1e-1", Fraction(1, 10), None),
        ("4GiB", None, 4 * GiB),
        ("16GB", None, 16 * 10**9),  # decimal units stay decimal
        ("0B", None, 0),  # an explicit zero reserve has a unit
    ],
)
def test_reserve_accepts_exactly_three_forms(text, fraction, fixed_bytes):
    assert parse_reserve(text) == (fraction, fixed_bytes)


@pytest.mark.parametrize(
    ("reserve", "expected_bytes"),
    [
        # h200: 150,754,820,096 B per chip (nvidia-smi memory.total; capacity/hardware.py)
        ("15%", 150_754_820_096 * 15 // 100),
        ("0.15", 150_754_820_096 * 15 // 100),
        ("4GiB", 4 * GiB),
    ],
)
def test_reserve_forms_reach_the_budget(reserve, expected_bytes):
    rc, out, err = run([*CAP, "--reserve", reserve, "--json"])
    assert rc == 0, err
    budget = json.loads(out)
    assert budget["hbm_bytes_per_chip"] == 150_754_820_096
    assert budget["reserve_bytes_per_chip"] == expected_bytes
