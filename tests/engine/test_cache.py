"""The contiguous cache behind the KVCache interface: slots, dropped writes, read-back."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from tenantq.engine import Engine
from tenantq.engine.cache import CacheFull, ContiguousCache, ContiguousLayout


def test_slots_are_allocated_freed_and_reused(config):
    cache = ContiguousCache(config, dtype="bfloat16", max_seqs=2, max_seq_tokens=8)
    a, b = cache.allocate(8), cache.allocate(1)
    assert {a, b} == {0, 1}
    with pytest.raises(CacheFull):
        cache.allocate(1)
    cache.free(a)
    assert cache.allocate(2) == a
    with pytest.raises(CacheFull, match="exceeds max_seq_tokens=8"):
        cache.allocate(9)
    with pytest.raises(ValueError, match="not allocated"):
        cache.free(a + 5)
    np.testing.assert_array_equal(cache.table([b, None]), [b, 0])


def test_write_drops_invalid_tokens_and_read_returns_positions(config):
    cache = ContiguousCache(config, dtype="float32", max_seqs=2, max_seq_tokens=8)
    layout = cache.layout
    shape = (2, 3, config.num_kv_heads, config.head_dim)
    keys = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) + 1
    positions = jnp.array([[0, 1, 2], [5, 6, 7]])
    valid = jnp.array([[True, True, False], [True, True, True]])
    table = jnp.array([1, 0])
    state = layout.write(cache.state, 1, table, positions, valid, keys, -keys)
    k, v, pos = layout.read(state, 1, table, 8)
    assert k.shape == (2, 8, config.num_kv_heads, config.head_dim)
    np.testing.assert_array_equal(pos[0], np.arange(8))
    np.testing.assert_array_equal(k[0, :2], keys[0, :2])
    assert not k[0, 2:].any()  # the invalid token was dropped
    np.testing.assert_array_equal(v[1, 5:8], -keys[1])
    assert not state[0][0].any()  # other layers untouched
    assert cache.nbytes == 2 * config.num_layers * 2 * 8 * config.num_kv_heads * config.head_dim * 4


class _HalvingLayout(ContiguousLayout):
    """A lossy cache: stores values at half their size (as a quantized pool would lose)."""

    def write(self, state, layer, table, positions, valid, keys, values):
        return super().write(state, layer, table, positions, valid, keys, values * 0.5)


def test_prefill_attends_over_what_the_cache_holds(config, params):
    # If prefill attended over fresh projections, a lossy cache could not change its logits.
    exact = Engine(config, params, dtype="float32", max_seqs=1, max_seq_tokens=16)
    lossy_cache = ContiguousCache(config, dtype="float32", max_seqs=1, max_seq_tokens=16)
    lossy_cache.layout = _HalvingLayout(**dataclasses.asdict(lossy_cache.layout))
    lossy = Engine(config, params, dtype="float32", cache=lossy_cache)
    ids = [[3, 14, 15, 9, 2, 6]]
    a, b = exact.logits(ids)[0], lossy.logits(ids)[0]
    assert np.abs(a - b).max() > 1e-2


def test_decode_past_the_reservation_is_refused(config, params):
    eng = Engine(config, params, dtype="float32", max_seqs=1, max_seq_tokens=16)
    batch, _ = eng.prefill([[1, 2, 3]], reserve_tokens=1)
    eng.decode(batch, [4])
    with pytest.raises(ValueError, match="larger reserve_tokens"):
        eng.decode(batch, [5])
    eng.release(batch)
