"""Numerics tests' shared fixture: mutmut's recording run must trace codec afresh."""

from __future__ import annotations

import os

import pytest

from tenantq.numerics import codec


@pytest.fixture(autouse=True)
def _trace_afresh():
    """In mutmut's recording run (MUTANT_UNDER_TEST=stats), clear codec's jit caches before
    each test: mutmut runs a mutant only against the tests it saw reach the mutated function
    there, and a layout an earlier test compiled is not traced again. A mutant's own run is a
    fresh process (empty caches), and plain pytest needs no retracing."""
    if os.environ.get("MUTANT_UNDER_TEST") == "stats":
        for jitted in (
            codec._quantize_jit, codec._scales_jit, codec._quantize_with_jit, codec._dequantize_jit
        ):  # fmt: skip
            jitted.clear_cache()
