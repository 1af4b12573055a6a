"""Static KV statistics without a checkpoint: `compute_kv_statistics` against order statistics
taken here, in numpy, of the keys and values a recording KV access saw in one bf16 forward of
the same model (the scales and the cache: test_kv_scales_cache.py).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from tenantq.quant.kv_calibration import compute_kv_statistics
from tenantq.testing import tiny_config

BF16_STEP = 2.0**-8  # bf16's relative rounding step


class _Recorder:
    """A KV access that keeps what each layer writes and reads it back (a full prefill)."""

    def __init__(self, positions):
        self.positions, self.kv = positions, {}

    def write(self, layer, keys, values):
        self.kv[layer] = (keys, values)

    def read(self, layer):
        return (*self.kv[layer], self.positions)


def _kth_largest(mag, percentile):
    """The k-th largest of each row, k = ceil(n (100 - p) / 100) (at least 1)."""
    k = max(1, math.ceil(round(mag.shape[-1] * (100 - percentile) / 100, 6)))
    return np.sort(mag, axis=-1)[..., -k]


@pytest.mark.slow  # two jitted bf16 forwards of the tiny model: ~5 s quiet
def test_statistics_are_order_statistics_of_what_the_cache_receives():
    from tenantq.model.decoder import Decoder, init_params

    config = tiny_config()
    params = init_params(config, seed=3)
    # 9 windows: one batch of 8 and one of 1, so the percentiles are averaged over 2 batches.
    windows = np.random.default_rng(0).integers(3, config.vocab_size, (9, 12)).astype(np.int32)
    stats, tokens = compute_kv_statistics(config, params, windows, percentile=90.0)
    assert tokens == 9 * 12
    model = Decoder(config, {p: jnp.asarray(v, jnp.bfloat16) for p, v in params.items()},
                    dtype=jnp.bfloat16)  # fmt: skip
    batches = []
    for part in (windows[:8], windows[8:]):
        rec = _Recorder(jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), part.shape))
        model(jnp.asarray(part), rec.positions, rec)
        batches.append(rec.kv)
    for layer in range(config.num_layers):
        for t, name in enumerate(("keys", "values")):
            per_batch = [np.asarray(kv[layer][t], np.float32) for kv in batches]  # [B,S,H,d]
            heads = [np.moveaxis(x, 2, 0).reshape(config.num_kv_heads, -1) for x in per_batch]
            every = np.concatenate(heads, axis=1)
            got = stats[name]
            tol = dict(rtol=2 * BF16_STEP, atol=1e-6)
            np.testing.assert_allclose(got["absmax"][layer], np.abs(every).max(1), **tol)
            np.testing.assert_allclose(got["min"][layer], every.min(1), **tol)
            np.testing.assert_allclose(got["max"][layer], every.max(1), **tol)
            pct = np.mean([_kth_largest(np.abs(h), 90.0) for h in heads], axis=0)
            np.testing.assert_allclose(got["percentile"][layer], pct, **tol)
            layer_pct = np.mean([_kth_largest(np.abs(h).ravel(), 90.0) for h in heads])
            np.testing.assert_allclose(got["layer_percentile"][layer], layer_pct, **tol)
            assert got["min"][layer].min() < 0 < got["max"][layer].max()
            assert all(v.dtype == np.float32 for v in got.values())


@pytest.mark.slow  # four jitted bf16 forwards of the tiny model: ~6 s quiet
def test_float_params_of_any_dtype_are_measured_as_their_bf16_cast_biases_included():
    # The statistics are those of the bf16 model a server runs: params cast to bf16 first.
    # The Decoder casts linear weights, norms and embeddings to its compute dtype itself, but
    # adds a bias in float32 as given (`Linear`), so a float32 or float16 checkpoint's k/v
    # biases would shift every cached key and value by their un-rounded part without the cast.
    # Exact equality: the same bf16 forward on the same bf16 values.
    from tenantq.model.decoder import init_params

    config = tiny_config(attention_bias=True)
    params = init_params(config, seed=4)
    windows = np.random.default_rng(1).integers(3, config.vocab_size, (2, 8)).astype(np.int32)
    for dtype in (jnp.float32, jnp.float16):
        given = {p: jnp.asarray(v, dtype) for p, v in params.items()}
        cast = {p: jnp.asarray(v, jnp.bfloat16) for p, v in given.items()}
        got, _ = compute_kv_statistics(config, given, windows, percentile=90.0)
        want, _ = compute_kv_statistics(config, cast, windows, percentile=90.0)
        for tensor in ("keys", "values"):
            for name, value in want[tensor].items():
                np.testing.assert_array_equal(got[tensor][name], value, err_msg=f"{tensor} {name}")


def test_extremes_are_values_a_bf16_cache_holds():
    # The model runs in bf16, so every key and value the cache receives is a bf16 number and
    # so are their max |x|, min and max. A forward in float32 (a wrong compute dtype) gives
    # extremes off bf16's grid, within the tolerance of the order-statistics test above.
    from tenantq.model.decoder import init_params

    config = tiny_config()
    params = init_params(config, seed=5)
    windows = np.random.default_rng(2).integers(3, config.vocab_size, (2, 8)).astype(np.int32)
    stats, _ = compute_kv_statistics(config, params, windows, percentile=90.0)
    for tensor in ("keys", "values"):
        for name in ("absmax", "min", "max"):
            got = stats[tensor][name]
            on_grid = np.asarray(jnp.asarray(got, jnp.bfloat16), np.float32)
            np.testing.assert_array_equal(got, on_grid, err_msg=f"{tensor} {name}")
