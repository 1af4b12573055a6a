"""`input_stats.check_windows`: the one check both calibration passes (weights, KV) run first."""

from __future__ import annotations

import numpy as np
import pytest

from tenantq.quant.input_stats import check_windows
from tenantq.testing import tiny_config


def test_windows_are_int32_and_in_the_vocabulary():
    config = tiny_config()  # vocabulary 64
    ok = check_windows([[0, 63], [5, 6]], config)
    assert ok.dtype == np.int32 and ok.shape == (2, 2)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 64\), got 0\.\.64"):
        check_windows([[0, 64]], config)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 64\), got -1\.\.3"):
        check_windows([[-1, 3]], config)
    for bad in ([1, 2, 3], np.zeros((0, 4))):
        with pytest.raises(ValueError, match=r"non-empty int \[sequences, tokens\]"):
            check_windows(bad, config)
