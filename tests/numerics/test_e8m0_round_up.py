"""`e8m0_code_at_least`: a float32 scale rounded *up* to a power of two, as an E8M0 code.

E8M0 (OCP Microscaling v1.0, sec. 5.4.1) stores 2^(code - 127) for codes 0..254, 255 = NaN.
Rounding up (never down) is what keeps every element of a group within range when the KV pool
stores its scales as E8M0, so the bound checked is: 2^(code-127) >= x and < 2x.
"""

from __future__ import annotations

import numpy as np

from tenantq.numerics.elements import E8M0_NAN, e8m0_code_at_least


def _value(code) -> np.ndarray:
    return np.ldexp(1.0, np.asarray(code).astype(np.int32) - 127)


def test_powers_of_two_keep_their_exponent_and_others_round_up():
    x = np.array([1.0, 0.5, 2.0**-20, 3.0, 1.0000001, 0.75, 448.0, 2.0**126], np.float32)
    codes = np.asarray(e8m0_code_at_least(x))
    assert codes.dtype == np.uint8
    # exact: 1 -> 127, 0.5 -> 126, 2^-20 -> 107, 3 -> 4 (129), 1 + ulp -> 2 (128),
    # 0.75 -> 1 (127), 448 -> 512 (136), 2^126 -> 253
    assert codes.tolist() == [127, 126, 107, 129, 128, 127, 136, 253]


def test_random_scales_are_bounded_by_one_binade():
    rng = np.random.default_rng(0)
    x = np.exp(rng.uniform(-80, 80, 10_000)).astype(np.float32)  # 2^-115 .. 2^115
    stored = _value(e8m0_code_at_least(x))
    assert np.all(stored >= x) and np.all(stored < 2 * x.astype(np.float64))


def test_non_finite_scales_are_the_nan_code_and_huge_ones_clamp():
    x = np.array([np.inf, np.nan, 3e38], np.float32)
    assert np.asarray(e8m0_code_at_least(x)).tolist() == [E8M0_NAN, E8M0_NAN, 254]
