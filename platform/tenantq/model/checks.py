"""Checks of plain values that every package makes: one wording, one place.

A count (`page_tokens`, `tp`, `batch`, tenants) is an int >= 1 and never a bool (`True` is an
int to Python, not a count). It lives in `model` (pure Python, no JAX) because quant, engine
and capacity all check counts and all import `model`.
"""

from __future__ import annotations

import numbers
from typing import Any


def check_positive_int(name: str, value: Any, *, numpy_ints: bool = False) -> None:
    """Raise `ValueError("{name} must be a positive integer, got {value!r}")` unless `value` is
    an int >= 1 (a numpy integer too with `numpy_ints`); a bool is never a count."""
    kinds = numbers.Integral if numpy_ints else int  # numpy registers its ints as Integral
    if isinstance(value, bool) or not isinstance(value, kinds) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
