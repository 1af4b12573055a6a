"""`read_tensor`: the loader's NaN/inf check, run over cache-sized blocks of rows.

These tensors span several blocks and put the bad value in the last one: a block loop that
stopped early, skipped a block or checked the wrong rows would let it through.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tenantq.model.loader import _BLOCK_BYTES, read_tensor

ROWS, COLS = 700, 1024  # float32: 2.7 MiB, three 1 MiB blocks of 256 rows


def _source(dtype=np.float32) -> np.ndarray:
    values = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(dtype)
    values.flags.writeable = False  # the loader's sources are read-only memory maps
    return values


def test_source_spans_several_blocks():
    assert ROWS * COLS * 4 > 2 * _BLOCK_BYTES


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_a_finite_tensor_comes_back_as_itself_or_its_transpose(dtype):
    source = _source(dtype)
    assert read_tensor(source, "t") is source  # no copy: the consumer's cast is the copy
    view = read_tensor(source, "t", transpose=True)
    assert view.shape == (COLS, ROWS) and np.shares_memory(view, source)
    assert np.array_equal(np.ascontiguousarray(view).view(np.uint8), source.T.copy().view(np.uint8))


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize(("value", "kind"), [(np.nan, "1 NaN"), (-np.inf, "0 NaN, 1 inf")])
def test_bad_value_in_the_last_block_is_named_with_its_index(transpose, value, kind):
    values = np.array(_source())
    values[ROWS - 1, COLS - 3] = value  # last row: the third block
    with pytest.raises(
        ValueError,
        match=rf"^w holds 1 non-finite values \({kind}.*first at index \[{ROWS - 1}, {COLS - 3}\]",
    ):
        read_tensor(values, "w", transpose=transpose)


def test_bad_value_in_a_one_dimensional_tensor_is_found():
    norm = np.ones(3 * _BLOCK_BYTES // 2, np.float16)  # 1.5 MiB of fp16: two blocks
    norm[-1] = np.inf
    with pytest.raises(ValueError, match=r"^norm holds 1 non-finite values \(0 NaN, 1 inf"):
        read_tensor(norm, "norm")


def test_transposing_anything_but_a_matrix_is_refused():
    with pytest.raises(ValueError, match="only 2-D tensors are transposed, this one has 1"):
        read_tensor(np.zeros(8, np.float32), "norm", transpose=True)


def test_empty_tensor_reads_as_empty():
    assert read_tensor(np.zeros((0, 4), np.float32), "e", transpose=True).shape == (4, 0)
