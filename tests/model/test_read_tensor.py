"""`read_tensor`: the loader's block-wise copy with the NaN/inf check inside it.

The check runs per ~1 MiB block of source rows, so these tensors span several blocks and
put the bad value in the last one: a block loop that stopped early, skipped a block or
checked the wrong rows would let it through.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tenantq.model.loader import _BLOCK_BYTES, read_tensor, to_device

ROWS, COLS = 700, 1024  # float32: 2.7 MiB, three 1 MiB blocks of 256 rows


def _source(dtype=np.float32) -> np.ndarray:
    values = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(dtype)
    values.flags.writeable = False  # the loader's sources are read-only memory maps
    return values


def test_source_spans_several_blocks():
    assert ROWS * COLS * 4 > 2 * _BLOCK_BYTES


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_untransposed_copy_is_exact_aligned_and_read_only(dtype):
    source = _source(dtype)
    out = read_tensor(source, "t")
    assert out.dtype == source.dtype and out.shape == source.shape
    assert np.array_equal(out.view(np.uint8), source.view(np.uint8))  # bit for bit
    assert out.ctypes.data % 64 == 0 and out.flags.c_contiguous and not out.flags.writeable
    assert not np.shares_memory(out, source)


def test_cast_on_copy_is_the_exact_widening():
    # bf16 -> float32 is exact (every bf16 is a float32), so the cast must equal numpy's.
    source = _source(ml_dtypes.bfloat16)
    out = read_tensor(source, "t", dtype=np.float32)
    assert out.dtype == np.float32
    assert np.array_equal(out, source.astype(np.float32))


def test_transposed_is_the_checked_view_and_to_device_transposes_and_casts():
    source = _source(ml_dtypes.bfloat16)
    view = read_tensor(source, "t", transpose=True)
    assert view.shape == (COLS, ROWS) and np.shares_memory(view, source)
    device = to_device(view, "float32")
    assert device.dtype == np.float32
    assert np.array_equal(np.asarray(device), source.T.astype(np.float32))


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize(("value", "kind"), [(np.nan, "1 NaN"), (-np.inf, "0 NaN, 1 inf")])
def test_bad_value_in_the_last_block_is_named_with_its_index(transpose, value, kind):
    values = np.array(_source())
    values[ROWS - 1, COLS - 3] = value  # last row: the third block
    with pytest.raises(
        ValueError,
        match=rf"^w holds 1 non-finite values \({kind}.*"
        rf"first at index \[{ROWS - 1}, {COLS - 3}\]",
    ):
        read_tensor(values, "w", transpose=transpose)


def test_transposing_anything_but_a_matrix_is_refused():
    with pytest.raises(ValueError, match="only 2-D tensors are transposed, this one has 1"):
        read_tensor(np.zeros(8, np.float32), "norm", transpose=True)


def test_empty_tensor_reads_as_empty():
    out = read_tensor(np.zeros((0, 4), np.float32), "e", transpose=True)
    assert out.shape == (4, 0)
