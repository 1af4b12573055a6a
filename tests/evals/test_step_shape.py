"""The quality suite's step shape: fidelity shares the needles' KV window only up to
`SHARED_WINDOW_MAX_RATIO` times its own (the rule in `Evaluator._step_shape`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tenantq.evals.evaluator import SHARED_WINDOW_MAX_RATIO, Evaluator


def _shape(fidelity_tokens: int | None, needle_prompts: list[int], answer_tokens: int = 5):
    fake = SimpleNamespace(
        fidelity_rows=None if fidelity_tokens is None else np.zeros((32, fidelity_tokens)),
        needle_items=[
            SimpleNamespace(prompt=[0] * n, answer=np.zeros(answer_tokens)) for n in needle_prompts
        ],
    )
    return Evaluator._step_shape(fake)


def test_quick_suite_shares_one_window():
    # 1,019 + 5 - 1 = 1,023 tokens fed: window 1,024 = 4 x fidelity's own 256 (the limit).
    assert SHARED_WINDOW_MAX_RATIO == 4
    assert _shape(256, [1019]) == (256, 1024, 1024)


@pytest.mark.parametrize(
    ("fidelity_tokens", "prompts", "expected"),
    [
        (256, [1021], (None, 2048, 256)),  # 1,025 fed -> window 2,048 = 8 x 256: own windows
        (256, [4000, 100], (None, 4096, 256)),
        (1024, [1019, 3000], (1024, 4096, 4096)),  # 4 x 1,024: shared
        (1024, [5000], (None, 8192, 1024)),
        (300, [10], (300, 512, 512)),  # fidelity alone sets the window
        # 8-token windows: fidelity's own window is still 16 (the floor), so a needle
        # window of 64 is 4 x 16 and shared (an 8-token window would make it 8 x)
        (8, [60], (8, 64, 64)),
        (8, [], (8, 16, 16)),  # no needles: the 16-token floor
    ],
)
def test_long_needles_do_not_widen_fidelity(fidelity_tokens, prompts, expected):
    assert _shape(fidelity_tokens, prompts) == expected


def test_needles_without_fidelity_run_whole():
    assert _shape(None, [1019]) == (None, 1024, None)
    assert _shape(None, []) == (None, 16, None)
