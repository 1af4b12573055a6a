"""The one positive-count check (model.checks) that quant, engine and capacity share."""

from __future__ import annotations

import numpy as np
import pytest

from tenantq.model.checks import check_positive_int


@pytest.mark.parametrize("value", [0, -3, True, 2.0, "4", None])
def test_a_count_that_is_not_a_positive_int_is_named_with_its_value(value) -> None:
    # True is an int to Python but never a count; 2.0 and "4" are not ints at all.
    with pytest.raises(
        ValueError, match=rf"^page_tokens must be a positive integer, got {value!r}$"
    ):
        check_positive_int("page_tokens", value)


def test_numpy_integers_count_only_where_the_caller_allows_them() -> None:
    check_positive_int("num_pages", np.int64(3), numpy_ints=True)
    check_positive_int("num_pages", 1)
    with pytest.raises(ValueError, match="num_pages must be a positive integer, got np.int64"):
        check_positive_int("num_pages", np.int64(3))
    with pytest.raises(ValueError, match="num_pages must be a positive integer"):
        check_positive_int("num_pages", np.bool_(True), numpy_ints=True)
