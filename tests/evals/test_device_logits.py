"""`Engine.device_logits` (the fidelity path) and the engine's shared step shapes, tiny model.

Bounds: device logits must equal `engine.logits` of the same rows exactly (the same body and
head executables on the same inputs, float32 engine), and `next_logp` the float64
log-softmax of those logits at the next token to 1e-5 (float32 log-softmax rounding on
logits of magnitude ~10). Decode steps of any batch size up to `max_seqs` and any length up
to the window share one executable (`steps.DECODE_MIN_KV_TOKENS`), so a second generation
with another batch size compiles nothing.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tenantq.engine import Engine
from tenantq.quant.plan import KVPlan, QuantPlan
from tenantq.testing import tiny_config, tiny_params

ROWS = [[5, 9, 13, 1], [7, 3], [11, 12, 60, 4, 30, 8], [1, 2, 3], [9] * 7, [4, 4]]


@pytest.fixture(scope="module")
def engine():
    config = tiny_config()
    return Engine(config, tiny_params(config, seed=0), dtype="float32", max_seqs=4,
                  max_seq_tokens=64)  # fmt: skip


def _log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_device_logits_equal_host_logits_and_next_token_logp(engine) -> None:
    host = engine.logits(ROWS)
    seen = []
    for start, logits, next_logp in engine.device_logits(ROWS):
        assert isinstance(logits, jax.Array) and isinstance(next_logp, jax.Array)
        logits, next_logp = np.asarray(logits), np.asarray(next_logp)
        assert logits.shape[0] <= engine.cache.max_seqs  # chunked by the cache's limit
        for i in range(min(logits.shape[0], len(ROWS) - start)):
            row = ROWS[start + i]
            n = len(row)
            np.testing.assert_array_equal(logits[i, :n], host[start + i, :n])
            want = _log_softmax64(logits[i, : n - 1])[np.arange(n - 1), row[1:]]
            np.testing.assert_allclose(next_logp[i, : n - 1], want, atol=1e-5)
            seen.append(start + i)
    assert seen == list(range(len(ROWS)))  # every row exactly once, in order (4 + 2)


def test_device_logits_through_a_quantized_pool_match_host_logits() -> None:
    config = tiny_config()
    plan = QuantPlan(kv=KVPlan(key_format="int4", key_axis="token", value_format="int4"))
    eng = Engine(config, tiny_params(config, seed=0), plan, max_seqs=4, max_seq_tokens=64)
    host = eng.logits(ROWS[:3])
    ((start, logits, _),) = list(eng.device_logits(ROWS[:3]))
    assert start == 0
    for i, row in enumerate(ROWS[:3]):
        np.testing.assert_array_equal(np.asarray(logits)[i, : len(row)], host[i, : len(row)])


def test_device_logits_refuses_bad_ids(engine) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        list(engine.device_logits([[1, engine.config.vocab_size]]))


def test_decode_steps_share_one_executable_across_batch_sizes(monkeypatch) -> None:
    # A fresh executable cache: an earlier test in the process may have compiled the same
    # tiny-model shapes, which would make the counts below depend on test order.
    from collections import OrderedDict

    from tenantq.engine import steps

    monkeypatch.setattr(steps, "_EXECUTABLES", OrderedDict())
    config = tiny_config()
    eng = Engine(config, tiny_params(config, seed=3), dtype="float32", max_seqs=4,
                 max_seq_tokens=64)  # fmt: skip
    eng.generate([[1, 2, 3], [4, 5, 6], [7, 8, 9], [3, 3, 3]], 6, stop_tokens=())
    compiled = eng.stats.compiles
    # one prompt instead of four, 20 new tokens instead of 6 (windows 16 -> 32 before):
    # the prefill shape [1, 16] is new, every decode step reuses the [4, 1] executable
    eng.generate([[2, 7, 1]], 20, stop_tokens=())
    assert eng.stats.compiles == compiled + 1
