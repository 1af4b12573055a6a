"""The paged KV pool: formats per layer, residual pages, sinks, and error within the step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tenantq.engine import ContiguousCache, Engine
from tenantq.engine.paged import PagedLayout
from tenantq.model.decoder import attend
from tenantq.numerics import dequantize, quantize
from tenantq.quant.plan import KVPlan, LayerKV, QuantPlan
from tenantq.storage.kv import LayerKVStorage

P, H, D, PAGES, SLOTS = 16, 2, 32, 12, 3


def _layout(key_fmt, value_fmt=None, *, sinks=0, key_axis="channel", value_axis="token"):
    kv = LayerKV(key_fmt, key_axis, value_fmt or key_fmt, value_axis)
    return PagedLayout(PAGES, SLOTS, 4, (LayerKVStorage(0, kv, P, H, D, sinks),), "float32")


def _table(slot: int, end: int, blocks) -> np.ndarray:
    out = np.full((1, 6), PAGES, np.int32)
    out[0, 0], out[0, 1], out[0, 2 : 2 + len(blocks)] = slot, end, blocks
    return out


def _bf16(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))


def _write(layout, state, table, start, keys, values):
    s = keys.shape[1]
    positions = (start + np.arange(s, dtype=np.int32))[None]
    return layout.write(state, 0, table, positions, np.ones((1, s), bool), keys, values)


def _kv(seed: int, tokens: int):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, tokens, H, D)).astype(np.float32) * 3
    return k, rng.standard_normal((1, tokens, H, D)).astype(np.float32)


BLOCKS = [5, 2, 9]


def test_residual_page_is_quantized_exactly_when_full() -> None:
    # 16-bit floats are stored as their bit patterns (uint16): see paged._bits_dtype.
    layout, (k, v) = _layout("int8"), _kv(0, 32)
    state = _write(layout, layout.init_state(), _table(1, 20, BLOCKS), 0, k[:, :20], v[:, :20])
    # Page 0 (tokens 0..15) is full: quantized per channel over its tokens.
    expected = quantize(_bf16(k[0, :16]), "int8", axis=0)
    np.testing.assert_array_equal(state[0]["keys"]["pages"][5], expected.data)
    np.testing.assert_array_equal(state[0]["keys"]["scales"][5], expected.scale)
    residual = jax.lax.bitcast_convert_type(state[0]["keys"]["residual"][1, :4], jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(residual, np.float32), _bf16(k[0, 16:20]))
    for t in range(20, 32):  # decode one token at a time into the residual page
        state = _write(layout, state, _table(1, t + 1, BLOCKS), t, k[:, t : t + 1], v[:, t : t + 1])
        page = np.asarray(state[0]["keys"]["pages"][2])
        if t < 31:
            assert not page.any(), f"page quantized at {t + 1} of 32 tokens"
    expected = quantize(_bf16(k[0, 16:32]), "int8", axis=0)
    np.testing.assert_array_equal(state[0]["keys"]["pages"][2], expected.data)
    np.testing.assert_array_equal(state[0]["keys"]["scales"][2], expected.scale)
    # Values are per token: quantized at write time, whichever step wrote them.
    per_token = quantize(_bf16(v[0]), "int8", axis=-1)
    got = np.concatenate([state[0]["values"]["pages"][5], state[0]["values"]["pages"][2]])
    np.testing.assert_array_equal(got, per_token.data)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "int8", "int4", "mxfp4", "nvfp4"])
def test_read_returns_the_formats_own_dequantization(fmt: str) -> None:
    # 40 tokens: two full pages read back as numerics' dequantize(quantize(page)), and the
    # newest 8 tokens from the bf16 residual window; values per token at write time.
    layout, (k, v) = _layout(fmt), _kv(1, 40)
    state = _write(layout, layout.init_state(), _table(0, 40, BLOCKS), 0, k, v)
    keys, values, key_pos = layout.read(state, 0, _table(0, 40, BLOCKS), 48)
    pages = [dequantize(quantize(_bf16(k[0, i : i + 16]), fmt, axis=0)) for i in (0, 16)]
    np.testing.assert_array_equal(np.asarray(keys[0, :32]), np.concatenate(pages))
    np.testing.assert_array_equal(np.asarray(keys[0, 32:40]), _bf16(k[0, 32:]))
    np.testing.assert_array_equal(np.asarray(key_pos[0]), np.arange(48))
    if fmt != "nvfp4":  # nvfp4's tensor scale is per page, not per 40-token tensor
        want = dequantize(quantize(_bf16(v[0]), fmt, axis=-1))
        np.testing.assert_array_equal(np.asarray(values[0, :40]), want)
    else:
        assert np.abs(np.asarray(values[0, :40]) - _bf16(v[0])).max() <= np.abs(v).max() / 6


def test_nvfp4_token_pages_keep_their_tensor_scale_for_later_tokens() -> None:
    # A page opened by one token fixes its tensor scale (x16 headroom): a later token up to
    # 16x larger is stored within nvfp4's step (half an E2M1 step, 1/4 of the block amax,
    # times 1 + 2^-3 for the E4M3 block scale's rounding), not clipped.
    layout, (k, v) = _layout("nvfp4"), _kv(2, 2)
    v[0, 1] *= 12.0
    state = _write(layout, layout.init_state(), _table(0, 1, BLOCKS), 0, k[:, :1], v[:, :1])
    state = _write(layout, state, _table(0, 2, BLOCKS), 1, k[:, 1:], v[:, 1:])
    _, values, _ = layout.read(state, 0, _table(0, 2, BLOCKS), 16)
    blocks = _bf16(v[0, :2]).reshape(2, H, 2, 16)
    err = np.abs(np.asarray(values[0, :2]).reshape(2, H, 2, 16) - blocks)
    bound = np.abs(blocks).max(axis=-1, keepdims=True) / 4 * (1 + 2**-3)
    assert (err <= bound + 1e-6).all()


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_single_attention_layer_error_is_within_the_format_step(fmt: str) -> None:
    layout, (k, v) = _layout(fmt, key_axis="channel", value_axis="token"), _kv(3, 32)
    state = _write(layout, layout.init_state(), _table(0, 32, BLOCKS), 0, k, v)
    keys, values, key_pos = layout.read(state, 0, _table(0, 32, BLOCKS), 32)
    kb, vb = _bf16(k[0]), _bf16(v[0])
    dk, dv = np.abs(np.asarray(keys[0, :32]) - kb), np.abs(np.asarray(values[0, :32]) - vb)
    # Scales: keys per (page, head, channel) over 16 tokens, values per (token, head).
    k_amax = np.abs(kb.reshape(2, 16, H, D)).max(axis=1, keepdims=True)
    k_amax = np.broadcast_to(k_amax, (2, 16, H, D)).reshape(32, H, D)
    v_amax = np.abs(vb).max(axis=-1, keepdims=True)
    if fmt == "int8":  # round to nearest on a grid of amax/127: half a step
        k_bound, v_bound = k_amax / 127 / 2, v_amax / 127 / 2
    else:  # E4M3: 2^-4 relative (3 mantissa bits), subnormal step 2^-9 times the scale
        k_bound = 2**-4 * np.abs(kb) + 2**-9 * k_amax / 448
        v_bound = 2**-4 * np.abs(vb) + 2**-9 * v_amax / 448
    # plus float32 rounding of x / scale and q * scale: a few ulps of the group's amax
    assert (dk <= k_bound + 2**-20 * k_amax).all() and (dv <= v_bound + 2**-20 * v_amax).all()
    # Attention output: each score moves by at most eps = sum_d |q_d| |dk_d| / sqrt(D), so
    # every softmax weight by a factor within e^(+-2 eps); then |d out| <= (e^(2 eps) - 1)
    # max|v| + max|dv| (weights sum to one).
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 32, 2 * H, D)).astype(np.float32)
    pos = np.arange(32, dtype=np.int32)[None]
    exact = np.asarray(attend(q, kb[None], vb[None], pos, pos, None))
    got = np.asarray(attend(q, keys[:, :32], values[:, :32], pos, key_pos[:, :32], None))
    q_heads = np.abs(q[0]).reshape(32, H, 2, D)
    eps = (np.einsum("shgd,thd->shg", q_heads, k_bound) / np.sqrt(D)).max()
    bound = (np.exp(2 * eps) - 1) * np.abs(vb).max() + v_bound.max()
    assert np.abs(got - exact).max() <= bound


def test_sinks_and_bf16_tensors_read_back_exactly() -> None:
    layout, (k, v) = _layout("int4", "bf16", sinks=4), _kv(5, 20)
    state = _write(layout, layout.init_state(), _table(2, 20, BLOCKS), 0, k, v)
    assert "sinks" in state[0]["keys"] and "sinks" not in state[0]["values"]
    assert set(state[0]["values"]) == {"pages"}  # bf16 tensor: pages only, no scales
    keys, values, _ = layout.read(state, 0, _table(2, 20, BLOCKS), 32)
    np.testing.assert_array_equal(np.asarray(keys[0, :4]), _bf16(k[0, :4]))  # sinks
    assert np.abs(np.asarray(keys[0, 4:16]) - _bf16(k[0, 4:16])).max() > 0  # int4 page
    np.testing.assert_array_equal(np.asarray(values[0, :20]), _bf16(v[0]))


def test_padding_rows_write_nothing() -> None:
    layout, (k, v) = _layout("int8"), _kv(6, 16)
    table = np.full((1, 6), PAGES, np.int32)
    table[0, 0], table[0, 1] = SLOTS, 0
    state = _write(layout, layout.init_state(), table, 0, k, v)
    assert not any(np.asarray(a).any() for a in state[0]["keys"].values())


PROMPTS = [[5, 9, 3, 7, 11, 4, 6, 8, 10, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [8, 1]]


def test_bf16_pool_matches_the_contiguous_cache(config, params) -> None:
    # Same bf16 K/V values, same attention: logits agree to float32 summation order.
    pool = Engine(config, params, dtype="bfloat16", max_seqs=2, max_seq_tokens=64, page_tokens=4)
    contiguous = Engine(
        config, params, dtype="bfloat16", cache=ContiguousCache(config, dtype="bfloat16")
    )
    a, b = pool.logits(PROMPTS), contiguous.logits(PROMPTS)
    assert np.abs(a - b).max() <= 1e-6 * np.abs(b).max()
    assert pool.generate(PROMPTS, 12, stop_tokens=()) == contiguous.generate(
        PROMPTS, 12, stop_tokens=()
    )
    assert pool.cache.free_pages == pool.cache.num_pages  # finished sequences gave pages back


def test_memory_report_shows_each_layers_formats(config, params) -> None:
    kv = KVPlan("int8", "channel", "fp8_e4m3", "token", sink_tokens=2, bf16_layers=(-1,))
    report = Engine(config, params, QuantPlan(kv=kv), max_seqs=2).memory_report()
    first, last = report.kv_layers
    assert (first["key_format"], first["value_format"]) == ("int8", "fp8_e4m3")
    assert (last["key_format"], last["value_format"]) == ("bf16", "bf16")
    assert first["scale_bytes"] > 0 and first["residual_bytes"] > 0 and first["sink_bytes"] > 0
    assert last["scale_bytes"] == last["residual_bytes"] == last["sink_bytes"] == 0
    assert report.cache_bytes == sum(r["total_bytes"] for r in report.kv_layers)
