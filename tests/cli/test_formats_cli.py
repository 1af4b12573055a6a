"""`tenantq formats`: the figures it prints are measured bytes that equal the formulas.

Runs `run` on a parsed namespace with a 256x256 weight (the CLI's default 4096 is too
large for the test budget; the formula is the same function of N).
"""

from __future__ import annotations

import argparse
import json

import pytest

from tenantq.cli import formats as formats_cli

N = 256


def parse(argv):
    parser = argparse.ArgumentParser(prog="tenantq")
    formats_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def expected_bits(n):
    """Bits per element of an n x n weight along axis 0 (scales per column)."""
    numel = n * n
    return {
        "bf16": 16.0,
        "fp16": 16.0,
        "fp8_e4m3": (numel + 4 * n) * 8 / numel,  # one float32 scale per output channel
        "fp8_e5m2": (numel + 4 * n) * 8 / numel,
        "int8": (numel + 4 * n) * 8 / numel,
        "int4": (numel / 2 + 4 * n * (n // 128)) * 8 / numel,  # 4 + 32/128 = 4.25
        "mxfp8": (numel + n * n // 32) * 8 / numel,  # 8 + 8/32 = 8.25
        "mxfp4": (numel / 2 + n * n // 32) * 8 / numel,  # 4.25
        "nvfp4": (numel / 2 + n * n // 16 + 4) * 8 / numel,  # 4.5 + 32/numel
        "int2": (numel / 4 + 8 * n * (n // 32)) * 8 / numel,  # 2 + 64/32 = 4 (KIVI's G=32)
    }


def test_json_figures_equal_the_formulas(capsys):
    assert formats_cli.run(parse(["formats", "--json", "--size", str(N)])) == 0
    rows = json.loads(capsys.readouterr().out)
    got = {row["format"]: row["effective_bits"] for row in rows}
    assert got == pytest.approx(expected_bits(N), rel=1e-12)
    assert got["int4"] == 4.25 and got["mxfp8"] == 8.25 and got["mxfp4"] == 4.25
    by_name = {row["format"]: row for row in rows}
    assert by_name["int4"]["group_size"] == 128
    assert by_name["nvfp4"]["scale_dtype"] == "e4m3" and by_name["nvfp4"]["tensor_scale"]
    assert by_name["int8"]["weight_nbytes"] == N * N + 4 * N


def test_expected_formula_at_the_default_4096():
    # The brief's example: int8 per-channel 4096x4096 -> (4096^2 + 4096*4) * 8 / 4096^2.
    assert expected_bits(4096)["int8"] == (4096 * 4096 + 4096 * 4) * 8 / (4096 * 4096)
    assert expected_bits(4096)["nvfp4"] == 4.5 + 32 / 4096**2


def test_table_is_aligned_and_lists_every_format(capsys):
    assert formats_cli.run(parse(["formats", "--size", "64"])) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[1:]
    assert [line.split()[0] for line in table[1:]] == list(expected_bits(64))
    column = table[0].index("bits/elem") + len("bits/elem")  # right-aligned numbers end here
    assert all(len(line) >= column and line[column - 1] != " " for line in table[1:])


def test_bad_size_is_a_value_error_from_python():
    # The CLI rejects --size 0 while parsing (tests/cli/test_cli_bad_inputs.py); the
    # function itself says the same to a Python caller.
    with pytest.raises(ValueError, match="--size must be an integer from 1 to 16384, got 0"):
        formats_cli.format_rows(0)
