"""The packing helpers' bad-input errors, word for word (found unpinned by `make mutation
TARGETS=numerics-packing`): each names what was wrong and what is allowed (DESIGN.md: int4
values in [-8, 7], E2M1 codes in 0..15, two values per packed uint8 byte along the last axis).
"""

from __future__ import annotations

import numpy as np
import pytest

from tenantq.numerics import pack_int4, unpack_int4
from tenantq.numerics.packing import pack_fp4, pack_nibbles, unpack_nibbles


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: pack_int4([-9, 7]), "int4 values must lie in [-8, 7]; got min -9, max 7"),
        (lambda: pack_fp4([0, 16]), "fp4 codes must lie in [0, 15]; got min 0, max 16"),
        (lambda: pack_nibbles(np.uint8(3)), "packing needs at least one axis; got a 0-d array"),
        (
            lambda: unpack_nibbles(np.zeros(2, np.int8), 4),
            "packed data must be uint8, got int8",
        ),
        (  # 5 values need ceil(5 / 2) = 3 bytes
            lambda: unpack_int4(np.zeros(2, np.uint8), 5),
            "n=5 values need a last axis of 3 packed bytes; got last axis 2",
        ),
        (
            lambda: unpack_nibbles(np.uint8(7), 2),
            "n=2 values need a last axis of 1 packed bytes; got a 0-d array",
        ),
    ],
)
def test_bad_packing_input_is_one_exact_line(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert str(err.value) == message
