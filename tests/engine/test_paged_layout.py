"""The device half of the paged pool, called directly and eagerly (`make mutation
TARGETS=paged`): where each write lands (page, offset, slot, layer), what `read` returns for
every kind of tensor (unquantized, per token, per channel with its residual page, static
scales, sinks), what static scales clip, nvfp4's per-page tensor scale, and the bytes.

Expectations are built from numerics alone: a per-token tensor reads back as
`dequantize(quantize(x, fmt, axis=-1))`, a full per-channel page as
`dequantize(quantize(page, fmt, axis=0))`, a static one as the codec with the given scale;
the store is float32, so unquantized tokens (residual, sinks, bf16 pages) read back exactly.
Tiny layouts: pages of 4 tokens x 2 KV heads x 8 channels, 2 layers, 2 slots.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tenantq.engine.paged import NVFP4_TOKEN_HEADROOM, PagedLayout, layout_nbytes
from tenantq.numerics import (
    compute_scale_zero_point,
    dequantize,
    nvfp4_tensor_scale,
    quantize,
    quantize_with_scale_zero_point,
)
from tenantq.quant.plan import LayerKV
from tenantq.storage.kv import LayerKVStorage

P, H, D = 4, 2, 8
NUM_PAGES, MAX_SEQS, MAX_PAGES = 6, 2, 4


# As the runner calls them: inside jit, the layout and the layer static (also ~4x faster
# than eager dispatch here).
_write_jit = jax.jit(PagedLayout.write, static_argnums=(0, 2))
_read_jit = jax.jit(PagedLayout.read, static_argnums=(0, 2, 4))


def _layout(kv: LayerKV, *, sinks: int = 0, store: str = "float32", dtype="float32"):
    layers = tuple(LayerKVStorage(i, kv, P, H, D, sinks, store) for i in range(2))
    return PagedLayout(NUM_PAGES, MAX_SEQS, MAX_PAGES, layers, dtype)


def _table(slot: int, end: int, blocks) -> np.ndarray:
    row = [slot, end, *blocks] + [NUM_PAGES] * (MAX_PAGES - len(blocks))
    return np.asarray([row], np.int32)


def _tokens(n: int, seed: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((1, n, H, D)) * scale).astype(np.float32)


def _write(layout, state, layer, table, start, keys, values, valid=None):
    s = keys.shape[1]
    positions = (start + np.arange(s, dtype=np.int32))[None]
    valid = np.ones((1, s), bool) if valid is None else valid
    return _write_jit(layout, state, layer, table, positions, valid, keys, values)


def _read(layout, state, layer, table, kv_tokens):
    return _read_jit(layout, state, layer, table, kv_tokens)


def _codec(x, fmt, axis=-1):
    return np.asarray(dequantize(quantize(x, fmt, axis=axis)))


def _unchanged(before, after) -> bool:
    return all(np.array_equal(np.asarray(before[k]), np.asarray(after[k])) for k in before) and set(
        before
    ) == set(after)


# ----------------------------------------------------------------------- geometry and state
def test_layers_share_one_geometry():
    a = LayerKVStorage(0, LayerKV("bf16", "channel", "bf16", "token"), P, H, D, 0, "float32")
    b = LayerKVStorage(1, LayerKV("bf16", "channel", "bf16", "token"), P, H, D, 1, "float32")
    with pytest.raises(ValueError, match=r"^every layer of one pool shares its page geometry"):
        PagedLayout(NUM_PAGES, MAX_SEQS, MAX_PAGES, (a, b), "float32")
    layout = _layout(LayerKV("int8", "channel", "int8", "token"), sinks=3, store="bfloat16")
    assert (layout.page_tokens, layout.kv_heads, layout.head_dim) == (P, H, D)
    assert (layout.sink_tokens, layout.store_dtype) == (3, "bfloat16")


def test_state_arrays_shapes_dtypes_and_fills():
    # Per page arrays lead with num_pages, per slot with max_seqs, per layer with nothing.
    # 8/16-bit floats are held as their bit patterns (bf16 -> uint16, fp8/e4m3 -> uint8).
    # Tensor and static scales start at 1, everything else at 0.
    layout = _layout(LayerKV("fp8_e4m3", "channel", "nvfp4", "token"), sinks=2, store="bfloat16")
    keys, values = layout.init_state()[1]["keys"], layout.init_state()[1]["values"]
    got = {k: (a.shape, str(a.dtype)) for k, a in keys.items()}
    assert got == {
        "pages": ((6, 4, 2, 8), "uint8"), "scales": ((6, 1, 2, 8), "float32"),
        "residual": ((2, 4, 2, 8), "uint16"), "sinks": ((2, 2, 2, 8), "uint16"),
    }  # fmt: skip
    got = {k: (a.shape, str(a.dtype)) for k, a in values.items()}
    assert got == {
        "pages": ((6, 4, 2, 4), "uint8"), "scales": ((6, 4, 2, 1), "uint8"),
        "tensor_scale": ((6,), "float32"), "sinks": ((2, 2, 2, 8), "uint16"),
    }  # fmt: skip
    assert np.all(np.asarray(values["tensor_scale"]) == 1.0)
    assert all(not np.asarray(a).any() for k, a in values.items() if k != "tensor_scale")
    static = _layout(LayerKV("int8", "tensor", "int2", "head")).init_state()[0]
    assert static["keys"]["static_scale"].shape == (1,)
    assert static["values"]["static_scale"].shape == (1, 1, 2, 1)
    assert np.all(np.asarray(static["values"]["static_scale"]) == 1.0)
    assert not np.asarray(static["values"]["static_zero_point"]).any()
    assert static["keys"]["clip_counts"].shape == (2,)
    assert str(static["keys"]["pages"].dtype) == "int8"
    bf16 = _layout(LayerKV("bf16", "channel", "bf16", "token")).init_state()[0]["keys"]
    assert {k: (a.shape, str(a.dtype)) for k, a in bf16.items()} == {
        "pages": ((6, 4, 2, 8), "float32")
    }


def test_layout_nbytes_by_hand():
    # Per layer: keys fp8 pages 6*64 B + float32 per-channel scales 6*16*4 B; values nvfp4
    # pages 6*32 B + e4m3 block scales 6*8 B (one partial 16-block of 8 channels per token and
    # head) + tensor scales 6*4 B; keys residual 2*64*2 B;
    # sinks 2 tensors * 2 slots * 2 tokens * 16 * 2 B. int8/int2 static: 4 + 8 + 8 + 2*8.
    layout = _layout(LayerKV("fp8_e4m3", "channel", "nvfp4", "token"), sinks=2, store="bfloat16")
    row = {"data_bytes": 6 * 64 + 6 * 32, "scale_bytes": 6 * 64 + 6 * 8 + 6 * 4,
           "residual_bytes": 256, "sink_bytes": 256, "static_bytes": 0}  # fmt: skip
    assert layout_nbytes(layout.init_state()) == [row, row]
    # int2 keys per token: 6 pages * 16 B of codes (4 per byte), scales and zero points one
    # float32 each per (token, head): 6 * 32 B + 6 * 32 B; int8 values per channel: 6 * 64 B
    # + 6 * 16 float32 scales; their float32 residual 2 slots * 64 * 4 B.
    kivi = _layout(LayerKV("int2", "token", "int8", "channel"))
    assert layout_nbytes(kivi.init_state())[0] == {
        "data_bytes": 6 * 16 + 6 * 64, "scale_bytes": 6 * 32 + 6 * 32 + 6 * 64,
        "residual_bytes": 512, "sink_bytes": 0, "static_bytes": 0,
    }  # fmt: skip
    static = _layout(LayerKV("int8", "tensor", "int2", "head"))
    assert layout_nbytes(static.init_state())[1] == {
        "data_bytes": 6 * 64 + 6 * 16, "scale_bytes": 0, "residual_bytes": 0, "sink_bytes": 0,
        "static_bytes": 4 + 8 + 8 + 8 + 8,
    }  # fmt: skip


# ----------------------------------------------------------------------- writes and reads
def test_per_token_tensors_land_in_their_pages_and_read_back_quantized():
    # Slot 1, block table [3, 0]: tokens 0..3 go to page 3, tokens 4..5 to page 0 at offsets
    # 0 and 1. Layer 1 only: layer 0's state is untouched.
    layout = _layout(LayerKV("int8", "token", "int2", "token"))
    state = layout.init_state()
    k, v = _tokens(6, 1, 3.0), _tokens(6, 2)
    table = _table(1, 6, [3, 0])
    new = _write(layout, state, 1, table, 0, k, v)
    assert _unchanged(state[0]["keys"], new[0]["keys"])
    assert _unchanged(state[0]["values"], new[0]["values"])
    qk = quantize(k[0], "int8", axis=-1)
    np.testing.assert_array_equal(np.asarray(new[1]["keys"]["pages"][3]), np.asarray(qk.data[:4]))
    np.testing.assert_array_equal(
        np.asarray(new[1]["keys"]["pages"][0, :2]), np.asarray(qk.data[4:])
    )
    np.testing.assert_array_equal(
        np.asarray(new[1]["keys"]["scales"][0, :2]), np.asarray(qk.scale[4:])
    )
    assert not np.asarray(new[1]["keys"]["pages"][0, 2:]).any()  # offsets 2, 3: not written
    qv = quantize(v[0], "int2", axis=-1)
    np.testing.assert_array_equal(
        np.asarray(new[1]["values"]["zero_points"][3]), np.asarray(qv.zero_point[:4])
    )
    keys, values, key_pos = _read(layout, new, 1, table, 6)
    # 6 tokens read as ceil(6 / 4) = 2 whole pages: 8 positions.
    assert keys.shape == values.shape == (1, 8, H, D) and keys.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(key_pos), [np.arange(8)])
    np.testing.assert_array_equal(np.asarray(keys[0, :6]), _codec(k[0], "int8"))
    np.testing.assert_array_equal(np.asarray(values[0, :6]), _codec(v[0], "int2"))


def test_unquantized_pages_and_the_compute_dtype():
    # bf16-format tensors in a bf16 store read back as bf16(x); the compute dtype is bf16.
    layout = _layout(
        LayerKV("bf16", "channel", "bf16", "token"), store="bfloat16", dtype="bfloat16"
    )
    k, v = _tokens(5, 3), _tokens(5, 4)
    table = _table(0, 5, [2, 5])
    new = _write(layout, layout.init_state(), 0, table, 0, k, v)
    keys, values, _ = _read(layout, new, 0, table, 5)
    assert keys.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(keys[0, :5]), np.asarray(jnp.asarray(k[0], jnp.bfloat16))
    )
    np.testing.assert_array_equal(
        np.asarray(values[0, :5]), np.asarray(jnp.asarray(v[0], jnp.bfloat16))
    )
    raw = np.asarray(new[0]["keys"]["pages"][5, 0])  # token 4 at page 5, offset 0 (bits)
    assert raw.dtype == np.uint16
    np.testing.assert_array_equal(
        raw, np.asarray(jnp.asarray(k[0, 4], jnp.bfloat16)).view(np.uint16)
    )


# int8 keys per channel (no zero point, no tensor scale) are test_paged_writes.py's case.
def test_a_bf16_store_keeps_the_residual_window_in_bf16():
    # A serving engine stores unquantized KV in bf16: 3 tokens of a per-channel int8 tensor
    # wait in the residual page, read back as bf16(x) exactly (bits in a uint16 array).
    layout = _layout(LayerKV("int8", "channel", "bf16", "token"), store="bfloat16")
    k = _tokens(3, 13)
    table = _table(1, 3, [0])
    state = _write(layout, layout.init_state(), 0, table, 0, k, k)
    assert state[0]["keys"]["residual"].dtype == jnp.uint16
    keys, _, _ = _read(layout, state, 0, table, 3)
    np.testing.assert_array_equal(
        np.asarray(keys[0, :3]), np.asarray(jnp.asarray(k[0], jnp.bfloat16), np.float32)
    )


@pytest.mark.parametrize(("keys_fmt", "values_fmt"), [("int2", "nvfp4")])
def test_per_channel_pages_quantize_when_full_and_wait_in_the_residual(keys_fmt, values_fmt):
    # 6 tokens from position 0, then 3 more from 6 (starting mid-page, crossing into page 2):
    # full pages are quantized over their tokens (axis 0), page 1 from the residual tokens
    # 4, 5 kept by the first write and 6, 7 of the second; token 8 is the residual, exact.
    # int2 adds zero points, nvfp4 a tensor scale per page.
    layout = _layout(LayerKV(keys_fmt, "channel", values_fmt, "channel"))
    k, v = _tokens(9, 5, 2.0), _tokens(9, 6)
    state = layout.init_state()
    state = _write(layout, state, 0, _table(1, 6, [4, 1]), 0, k[:, :6], v[:, :6])
    # Tokens 4, 5 wait in the residual: their pool page (1) is not written yet.
    assert not np.asarray(state[0]["keys"]["pages"][1]).any()
    assert not np.asarray(state[0]["values"]["scales"][1]).any()
    table = _table(1, 9, [4, 1, 2])
    state = _write(layout, state, 0, table, 6, k[:, 6:], v[:, 6:])
    keys, values, _ = _read(layout, state, 0, table, 9)
    assert keys.shape == (1, 12, H, D)
    np.testing.assert_array_equal(np.asarray(keys[0, :4]), _codec(k[0, :4], keys_fmt, axis=0))
    np.testing.assert_array_equal(np.asarray(values[0, :4]), _codec(v[0, :4], values_fmt, axis=0))
    np.testing.assert_array_equal(np.asarray(keys[0, 4:8]), _codec(k[0, 4:8], keys_fmt, axis=0))
    np.testing.assert_array_equal(np.asarray(keys[0, 8]), k[0, 8])
    np.testing.assert_array_equal(np.asarray(values[0, 4:8]), _codec(v[0, 4:8], values_fmt, axis=0))
    np.testing.assert_array_equal(np.asarray(values[0, 8]), v[0, 8])
    # The pages landed where the block table says: page 1 holds tokens 4..7.
    q = quantize(k[0, 4:8], keys_fmt, axis=0)
    np.testing.assert_array_equal(np.asarray(state[0]["keys"]["pages"][1]), np.asarray(q.data))
    if q.zero_point is not None:
        np.testing.assert_array_equal(
            np.asarray(state[0]["keys"]["zero_points"][1]), np.asarray(q.zero_point)
        )
    qv = quantize(v[0, 4:8], values_fmt, axis=0)
    if qv.tensor_scale is not None:  # nvfp4: page 1's own tensor scale; page 5 never written
        assert float(state[0]["values"]["tensor_scale"][1]) == float(qv.tensor_scale)
        assert float(state[0]["values"]["tensor_scale"][5]) == 1.0


def test_two_rows_fill_their_own_pages_up_to_the_last_table_column():
    # Row 0 (slot 0) writes 16 tokens: 4 full pages, blocks [3, 2, 1, 0], the last one in the
    # table's last column (max_pages = 4). Row 1 (slot 1) writes 4 of its 16 positions: one
    # full page, block 5. Every full page is the codec's per-channel page, where the table says;
    # the unquantized values land token by token in the same pages (the per-token page index
    # reaches the table's last column: positions 12..15 -> column 3 -> page 0).
    layout = _layout(LayerKV("int8", "channel", "bf16", "token"))
    k = _tokens(32, 14).reshape(2, 16, H, D)
    table = np.concatenate([_table(0, 16, [3, 2, 1, 0]), _table(1, 4, [5])])
    positions = np.tile(np.arange(16, dtype=np.int32), (2, 1))
    valid = np.asarray([[True] * 16, [True] * 4 + [False] * 12])
    state = _write_jit(layout, layout.init_state(), 0, table, positions, valid, k, k)
    pages = np.asarray(state[0]["keys"]["pages"])
    for block, row, first in ((3, 0, 0), (2, 0, 4), (1, 0, 8), (0, 0, 12), (5, 1, 0)):
        want = quantize(k[row, first : first + 4], "int8", axis=0).data
        np.testing.assert_array_equal(pages[block], np.asarray(want))
    assert not pages[4].any()
    values = np.asarray(state[0]["values"]["pages"])  # float32 store: the tokens exactly
    for block, row, first in ((3, 0, 0), (2, 0, 4), (1, 0, 8), (0, 0, 12), (5, 1, 0)):
        np.testing.assert_array_equal(values[block], k[row, first : first + 4])
    assert not values[4].any()


def test_a_row_without_tokens_keeps_its_slots_residual():
    # Slot 1 holds 6 tokens (page 2 full, tokens 4, 5 in its residual). Next step, row 0 is
    # slot 1 with no valid token (its positions 0, 1 are padding) and row 1 is slot 0
    # writing 2 tokens. Each slot's residual is its own: slot 1 still reads tokens 4, 5.
    layout = _layout(LayerKV("int8", "channel", "int8", "token"))
    k = _tokens(6, 7)
    state = _write(layout, layout.init_state(), 0, _table(1, 6, [2, 0]), 0, k, k)
    table = np.concatenate([_table(1, 6, [2, 0]), _table(0, 2, [1])])
    positions = np.asarray([[0, 1], [0, 1]], np.int32)
    valid = np.asarray([[False, False], [True, True]])
    fresh = np.concatenate([_tokens(2, 8), _tokens(2, 9)])
    state = _write_jit(layout, state, 0, table, positions, valid, fresh, fresh)
    keys, _, _ = _read(layout, state, 0, table, 6)
    np.testing.assert_array_equal(np.asarray(keys[0, 4:6]), k[0, 4:6])
    np.testing.assert_array_equal(np.asarray(keys[1, :2]), fresh[1])


def test_invalid_tokens_write_nothing():
    for kv in (
        LayerKV("int8", "token", "bf16", "token"),
        LayerKV("nvfp4", "token", "int2", "token"),
        LayerKV("int8", "tensor", "int2", "head"),
    ):
        layout = _layout(kv, sinks=2)
        state = layout.init_state()
        k = _tokens(3, 10)
        new = _write(layout, state, 0, _table(0, 3, [0]), 0, k, k, valid=np.zeros((1, 3), bool))
        for name in ("keys", "values"):
            assert _unchanged(state[0][name], new[0][name])


def test_sinks_keep_the_first_tokens_unquantized():
    # int4 keys per token with 2 sink tokens: tokens 0, 1 read back exactly (float32 store),
    # later ones quantized; a second write (tokens 2..4) leaves the sinks as they were.
    # bf16 values have no sink copy (nothing to keep).
    layout = _layout(LayerKV("int4", "token", "bf16", "token"), sinks=2)
    k = _tokens(5, 11, 4.0)
    state = _write(layout, layout.init_state(), 1, _table(1, 2, [2]), 0, k[:, :2], k[:, :2])
    table = _table(1, 5, [2, 3])
    state = _write(layout, state, 1, table, 2, k[:, 2:], k[:, 2:])
    assert "sinks" not in state[1]["values"]
    np.testing.assert_array_equal(np.asarray(state[1]["keys"]["sinks"][1]), k[0, :2])
    keys, values, _ = _read(layout, state, 1, table, 5)
    np.testing.assert_array_equal(np.asarray(keys[0, :2]), k[0, :2])
    np.testing.assert_array_equal(np.asarray(keys[0, 2:5]), _codec(k[0, 2:5], "int4"))
    assert not np.array_equal(_codec(k[0, :2], "int4"), k[0, :2])  # the sinks did matter
    np.testing.assert_array_equal(np.asarray(values[0, :5]), k[0])


def test_static_scales_quantize_clip_and_count():
    # Keys int8 per tensor at scale 0.02 (range +-2.54); values int2 per head with scales
    # [1, 0.5] and zero points [1, 2]: head 0 holds [-1, 2], head 1 [-1, 0.5]. Clipped:
    # keys 3.0 and -2.6 (2); values head 0 at 2.5 and -1.5, head 1 at 0.75 and -2.0 (4); the
    # boundaries 2.54, -1, 2 and 0.5 are inside. 3 tokens of 16 elements written.
    layout = _layout(LayerKV("int8", "tensor", "int2", "head"))
    state = list(layout.init_state())
    layer = {n: dict(a) for n, a in state[1].items()}
    layer["keys"]["static_scale"] = jnp.asarray([0.02], jnp.float32)
    layer["values"]["static_scale"] = jnp.asarray([1.0, 0.5], jnp.float32).reshape(1, 1, 2, 1)
    layer["values"]["static_zero_point"] = jnp.asarray([1.0, 2.0], jnp.float32).reshape(1, 1, 2, 1)
    state[1] = layer
    state = tuple(state)
    k = np.zeros((1, 3, H, D), np.float32)
    k[0, 0, 0, 0], k[0, 1, 1, 3], k[0, 2, 0, 7] = 3.0, -2.6, 2.54
    v = np.zeros((1, 3, H, D), np.float32)
    v[0, 0, 0, 0], v[0, 0, 0, 1], v[0, 1, 1, 2], v[0, 1, 1, 3] = 2.5, -1.5, 0.75, -2.0
    v[0, 2, 0, :4] = [-1.0, 2.0, 1.0, 0.0]
    v[0, 2, 1, :2] = [0.5, -1.0]
    table = _table(0, 3, [5])
    new = _write(layout, state, 1, table, 0, k, v)
    np.testing.assert_array_equal(np.asarray(new[1]["keys"]["clip_counts"]), [2, 3])
    np.testing.assert_array_equal(np.asarray(new[1]["values"]["clip_counts"]), [4, 3])
    # Counters add up over steps: the same write again doubles them.
    again = _write(layout, new, 1, table, 0, k, v)
    np.testing.assert_array_equal(np.asarray(again[1]["values"]["clip_counts"]), [8, 6])
    keys, values, _ = _read(layout, new, 1, table, 3)
    want_k = quantize_with_scale_zero_point(k[0], "int8", 0.02, axis=-1, group_size=D)
    np.testing.assert_array_equal(np.asarray(keys[0, :3]), np.asarray(dequantize(want_k)))
    scale = np.asarray([1.0, 0.5], np.float32).reshape(1, 2, 1)
    zp = np.asarray([1.0, 2.0], np.float32).reshape(1, 2, 1)
    want_v = quantize_with_scale_zero_point(v[0], "int2", scale, zp, axis=-1, group_size=D)
    np.testing.assert_array_equal(np.asarray(values[0, :3]), np.asarray(dequantize(want_v)))
    np.testing.assert_array_equal(np.asarray(values[0, 0, 0, :2]), [2.0, -1.0])  # clipped


def test_nvfp4_token_pages_fix_their_tensor_scale_when_opened():
    # The first write to a page (offset 0) sets G = nvfp4_tensor_scale(16 * amax of the
    # tokens written); a later write into the same page keeps it; untouched pages keep 1.
    assert NVFP4_TOKEN_HEADROOM == 16.0
    layout = _layout(LayerKV("nvfp4", "token", "bf16", "token"))
    k = _tokens(6, 12, 2.0)
    # Page 5 is the pool's last: its tokens must read their own page's scale.
    table = _table(0, 6, [2, 5])
    state = _write(layout, layout.init_state(), 0, _table(0, 2, [2]), 0, k[:, :2], k[:, :2])
    g2 = float(nvfp4_tensor_scale(16.0 * np.abs(k[0, :2]).max()))
    state = _write(layout, state, 0, table, 2, k[:, 2:], k[:, 2:])
    ts = np.asarray(state[0]["keys"]["tensor_scale"])
    g5 = float(nvfp4_tensor_scale(16.0 * np.abs(k[0, 4:6]).max()))
    np.testing.assert_array_equal(ts, np.asarray([1, 1, g2, 1, 1, g5], np.float32))
    keys, _, _ = _read(layout, state, 0, table, 6)
    # Each element within half of its block's E2M1 step: |x| <= 6 * s per block, the widest
    # step (4 -> 6) is 2 * s, so the error is at most s = block scale = amax_block / 6 or
    # one E4M3 step above it (2^-3 relative): bound max|x| / 6 * (1 + 2^-3) per block.
    # head_dim 8 is one (partial) 16-wide block per (token, head).
    err = np.abs(np.asarray(keys[0, :6]) - k[0])
    bound = np.abs(k[0]).max(axis=-1, keepdims=True) / 6 * (1 + 2**-3)
    assert np.all(err <= bound + 1e-7)


# ----------------------------------------------------------------------- stored scale dtypes
# kv.scale_dtype bf16 / e8m0: a write rounds each page/token scale to the stored dtype and
# quantizes with the rounded scale s'; `read` multiplies the codes by s'. Expectations: s and
# the int2 zero point from `compute_scale_zero_point` (numerics), s' by hand with ml_dtypes
# (bf16: round to nearest) or frexp (E8M0: the smallest power of two >= s, OCP MX v1.0 sec.
# 5.4.1), the codes from `quantize_with_scale_zero_point` at s'.
def _bf16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


def _e8m0_up(s: np.ndarray) -> np.ndarray:
    """Biased exponent (bias 127) of the smallest power of two >= s (s > 0, normal)."""
    m, e = np.frexp(s.astype(np.float64))  # s = m 2^e, m in [0.5, 1)
    return (e - (m == 0.5) + 127).astype(np.uint8)  # 2^(e-1) when s is a power of two


def test_bf16_token_scales_and_int2_zero_points_are_stored_rounded():
    # Keys int8 per token, values int2 per token, scale_dtype bf16: the stored scale bits
    # are bf16(s), the codes are made with s' = bf16(s), read = codes * s'; int2 zero points
    # are stored as bf16(zp s / s'). Slot 0, pages [4, 1]: tokens 4, 5 at page 1.
    layout = _layout(LayerKV("int8", "token", "int2", "token", "bf16"))
    state = layout.init_state()
    assert state[0]["keys"]["scales"].dtype == jnp.uint16  # bf16 bit patterns
    assert state[0]["values"]["zero_points"].dtype == jnp.uint16
    k, v = _tokens(6, 21, 3.0), _tokens(6, 22, 0.7)
    table = _table(0, 6, [4, 1])
    new = _write(layout, state, 0, table, 0, k, v)
    s = np.abs(k[0]).max(axis=-1, keepdims=True) / 127  # [6, H, 1]
    kept = _bf16(s)
    got = np.concatenate([np.asarray(new[0]["keys"]["scales"][4]),
                          np.asarray(new[0]["keys"]["scales"][1, :2])])  # fmt: skip
    np.testing.assert_array_equal(got, kept.view(np.uint16))
    assert np.any(kept.astype(np.float32) != s)  # the rounding did change some scales
    s_v, zp_v = compute_scale_zero_point(v[0], "int2", axis=-1)
    rounded = _bf16(s_v).astype(np.float32)
    zp_kept = _bf16(np.asarray(zp_v, np.float32) * np.asarray(s_v) / rounded)
    np.testing.assert_array_equal(
        np.asarray(new[0]["values"]["zero_points"][4]), zp_kept[:4].view(np.uint16)
    )
    np.testing.assert_array_equal(
        np.asarray(new[0]["values"]["scales"][1, :2]), _bf16(s_v)[4:].view(np.uint16)
    )
    keys, values, _ = _read(layout, new, 0, table, 6)
    want_k = quantize_with_scale_zero_point(k[0], "int8", kept.astype(np.float32), axis=-1)
    np.testing.assert_array_equal(np.asarray(new[0]["keys"]["pages"][4]), want_k.data[:4])
    np.testing.assert_array_equal(np.asarray(keys[0, :6]), np.asarray(dequantize(want_k)))
    # half a step of s' (<= s (1 + 2^-8)) at most, plus float32 rounding of x / s'
    assert np.all(np.abs(np.asarray(keys[0, :6]) - k[0]) <= kept.astype(np.float32) / 2 * 1.0001)
    want_v = quantize_with_scale_zero_point(
        v[0], "int2", rounded, zp_kept.astype(np.float32), axis=-1
    )
    np.testing.assert_array_equal(np.asarray(values[0, :6]), np.asarray(dequantize(want_v)))


def test_e8m0_channel_scales_are_powers_of_two_rounded_up():
    # Keys int4 per channel, values fp8 per token, scale_dtype e8m0 (uint8 codes): a full
    # key page's scale per (head, channel) is 2^ceil(log2(amax / 7)) over its 4 tokens, so
    # no code clips and read = codes * 2^(code - 127); token 4 waits in the residual (exact).
    layout = _layout(LayerKV("int4", "channel", "fp8_e4m3", "token", "e8m0"))
    state = layout.init_state()
    assert state[0]["keys"]["scales"].dtype == jnp.uint8
    k, v = _tokens(5, 23, 2.0), _tokens(5, 24, 50.0)
    table = _table(1, 5, [3, 2])
    new = _write(layout, state, 1, table, 0, k, v)
    codes = _e8m0_up(np.abs(k[0, :4]).max(axis=0, keepdims=True) / 7)  # [1, H, D]
    np.testing.assert_array_equal(np.asarray(new[1]["keys"]["scales"][3]), codes)
    s_up = np.ldexp(np.float32(1), codes.astype(np.int32) - 127).astype(np.float32)
    want = quantize_with_scale_zero_point(k[0, :4], "int4", s_up, axis=0)
    keys, values, _ = _read(layout, new, 1, table, 5)
    np.testing.assert_array_equal(np.asarray(keys[0, :4]), np.asarray(dequantize(want)))
    np.testing.assert_array_equal(np.asarray(keys[0, 4]), k[0, 4])
    v_codes = _e8m0_up(np.abs(v[0]).max(axis=-1, keepdims=True) / 448)  # [5, H, 1]
    np.testing.assert_array_equal(np.asarray(new[1]["values"]["scales"][3]), v_codes[:4])
    np.testing.assert_array_equal(np.asarray(new[1]["values"]["scales"][2, :1]), v_codes[4:])
    v_up = np.ldexp(np.float32(1), v_codes.astype(np.int32) - 127).astype(np.float32)
    want_v = quantize_with_scale_zero_point(v[0], "fp8_e4m3", v_up, axis=-1)
    np.testing.assert_array_equal(np.asarray(values[0, :5]), np.asarray(dequantize(want_v)))
    # the power of two is >= s (nothing clips), so |error| <= s' / 2 < s for int4
    s = np.abs(k[0, :4]).max(axis=0, keepdims=True) / 7
    assert np.all(s_up >= s) and np.all(s_up < 2 * s)
    assert np.all(np.abs(np.asarray(keys[0, :4]) - k[0, :4]) <= s_up / 2 * 1.0001)


def test_bf16_channel_scales_with_int2_zero_points():
    # int2 keys per channel with bf16 scales: a full page stores bf16(s) per (head, channel)
    # and zero points bf16(zp s / s'), and reads back as the codec at (s', zp').
    layout = _layout(LayerKV("int2", "channel", "bf16", "token", "bf16"))
    k = _tokens(4, 25, 1.5) + 0.5
    table = _table(0, 4, [5])
    new = _write(layout, layout.init_state(), 0, table, 0, k, k)
    s, zp = compute_scale_zero_point(k[0], "int2", axis=0)
    rounded = _bf16(s).astype(np.float32)
    zp_kept = _bf16(np.asarray(zp, np.float32) * np.asarray(s) / rounded)
    np.testing.assert_array_equal(np.asarray(new[0]["keys"]["scales"][5]), _bf16(s).view(np.uint16))
    np.testing.assert_array_equal(
        np.asarray(new[0]["keys"]["zero_points"][5]), zp_kept.view(np.uint16)
    )
    keys, _, _ = _read(layout, new, 0, table, 4)
    want = quantize_with_scale_zero_point(k[0], "int2", rounded, zp_kept.astype(np.float32), axis=0)
    np.testing.assert_array_equal(np.asarray(keys[0, :4]), np.asarray(dequantize(want)))


class _Described:
    """A LayerKVStorage whose description of one array is replaced (a storage.py that
    disagrees with the codec): `tensor_state` must refuse to allocate from it."""

    def __init__(self, real: LayerKVStorage, name: str, **change):
        self.real, self.name, self.change = real, name, change

    def arrays(self, spec):
        return tuple(
            dataclasses.replace(a, **self.change) if a.name == self.name else a
            for a in self.real.arrays(spec)
        )


def test_state_refuses_a_storage_description_the_codec_disagrees_with():
    # int8 per token, page [4, 2, 8]: the codec stores int8 pages [4, 2, 8] and float32
    # scales [4, 2, 1]. A described page dtype, page shape or scale dtype that differs is an
    # AssertionError naming both sides; with bf16-stored scales the codec's float32 scale is
    # expected to be replaced (no error), but the page dtype is still checked.
    for scale_dtype, name, change, message in (
        ("float32", "pages", {"dtype": "uint8"},
         "int8 pages: the quantizer stores (4, 2, 8) int8, the KV storage description says "
         "(4, 2, 8) uint8"),
        ("float32", "pages", {"shape": (4, 2, 4)},
         "int8 pages: the quantizer stores (4, 2, 8) int8, the KV storage description says "
         "(4, 2, 4) int8"),
        ("float32", "scales", {"dtype": "bfloat16"},
         "int8 scales: the quantizer stores (4, 2, 1) float32, the KV storage description "
         "says (4, 2, 1) bfloat16"),
        ("bf16", "pages", {"dtype": "uint8"},
         "int8 pages: the quantizer stores (4, 2, 8) int8, the KV storage description says "
         "(4, 2, 8) uint8"),
        ("bf16", "scales", {"shape": (4, 2, 2)},
         "int8 scales: the quantizer stores (4, 2, 1) float32, the KV storage description "
         "says (4, 2, 2) bfloat16"),
    ):  # fmt: skip
        layout = _layout(LayerKV("int8", "token", "int8", "token", scale_dtype))
        spec = layout.layers[0].kv.keys
        wrong = _Described(layout.layers[0], name, **change)
        with pytest.raises(AssertionError, match=f"^{re.escape(message)}$"):
            layout.tensor_state(wrong, spec)
    layout = _layout(LayerKV("int8", "token", "int8", "token", "bf16"))
    state = layout.tensor_state(layout.layers[0], layout.layers[0].kv.keys)
    assert state["scales"].dtype == jnp.uint16 and state["scales"].shape == (NUM_PAGES, 4, 2, 1)


@pytest.mark.parametrize(("keys_fmt", "values_fmt"), [("mxfp4", "mxfp8"), ("nvfp4", "mxfp4")])
def test_block_formats_read_back_group_by_group_on_a_wide_head(keys_fmt, values_fmt):
    # head_dim 64 holds two 32-wide MX blocks (four 16-wide nvfp4 blocks) per (token, head):
    # a page read back with the wrong axis or group size would scale whole heads by one
    # block's scale (head_dim 8 above is a single partial block, where both agree). One
    # token per row of the write, on a fresh page each, so nvfp4's per-page tensor scale is
    # the codec's own for that token (opened by it); the bound: the codec's round trip, exact.
    d = 64
    kv = LayerKV(keys_fmt, "token", values_fmt, "token")
    layers = tuple(LayerKVStorage(i, kv, P, H, d, 0, "float32") for i in range(2))
    layout = PagedLayout(NUM_PAGES, MAX_SEQS, MAX_PAGES, layers, "float32")
    rng = np.random.default_rng(7)
    # Blocks of very different magnitude within each head: 1x, 100x (and 1x, 100x for nvfp4).
    spread = np.repeat(np.array([1.0, 100.0, 1.0, 100.0], np.float32), 16)
    k = (rng.standard_normal((1, 1, H, d)) * spread).astype(np.float32)
    v = (rng.standard_normal((1, 1, H, d)) * spread[::-1]).astype(np.float32)
    table = _table(0, 1, [2])
    state = _write(layout, layout.init_state(), 0, table, 0, k, v)
    keys, values, _ = _read(layout, state, 0, table, 1)
    np.testing.assert_array_equal(np.asarray(keys[0, :1]), _codec(k[0], keys_fmt))
    np.testing.assert_array_equal(np.asarray(values[0, :1]), _codec(v[0], values_fmt))


@pytest.mark.parametrize("layer", [0, 1])
def test_a_write_replaces_its_layer_and_keeps_the_others(layer):
    # `write` returns the state tuple with one layer replaced: still one entry per layer (2),
    # the other layer's arrays untouched, and the written one changed.
    layout = _layout(LayerKV("int8", "token", "int8", "token"))
    state = layout.init_state()
    new = _write(layout, state, layer, _table(0, 1, [1]), 0, _tokens(1, 3), _tokens(1, 4))
    assert len(new) == len(state) == 2
    other = 1 - layer
    for name in ("keys", "values"):
        assert _unchanged(state[other][name], new[other][name])
        assert not _unchanged(state[layer][name], new[layer][name])


def test_per_channel_continuations_read_their_own_slots_residual():
    # Slot 1 holds 6 tokens (its residual: tokens 4, 5). Slot 0 then writes 3 tokens, 2 more
    # from position 3 (the last offset of page 0, crossing into page 1: two pages touched by
    # a 2-token run), and 2 more from position 5 (mid-page, base 4). Slot 0's page 0 must be
    # the codec's page of its own tokens 0..3 (built from its own residual, never slot 1's)
    # and tokens 4..6 wait in its residual, exact (float32 store); slot 1 reads as before.
    layout = _layout(LayerKV("int8", "channel", "int8", "channel"))
    k1, k0 = _tokens(6, 21, 5.0), _tokens(7, 22)
    state = _write(layout, layout.init_state(), 0, _table(1, 6, [4, 5]), 0, k1, k1)
    state = _write(layout, state, 0, _table(0, 3, [2]), 0, k0[:, :3], k0[:, :3])
    state = _write(layout, state, 0, _table(0, 5, [2, 3]), 3, k0[:, 3:5], k0[:, 3:5])
    table = _table(0, 7, [2, 3])
    state = _write(layout, state, 0, table, 5, k0[:, 5:7], k0[:, 5:7])
    keys, values, _ = _read(layout, state, 0, table, 7)
    for got in (keys, values):
        np.testing.assert_array_equal(np.asarray(got[0, :4]), _codec(k0[0, :4], "int8", axis=0))
        np.testing.assert_array_equal(np.asarray(got[0, 4:7]), k0[0, 4:7])
    keys1, _, _ = _read(layout, state, 0, _table(1, 6, [4, 5]), 6)
    np.testing.assert_array_equal(np.asarray(keys1[0, :4]), _codec(k1[0, :4], "int8", axis=0))
    np.testing.assert_array_equal(np.asarray(keys1[0, 4:6]), k1[0, 4:6])


def test_nvfp4_token_pages_read_their_own_tensor_scale_on_page_zero():
    # Slot 0 opens page 1 with tokens 10^4 x louder than slot 1's, which then opens page 0.
    # Page 0's tokens are quantized and read with page 0's own tensor scale: each element
    # within its block's bound max|x| / 6 * (1 + 2^-3) (as in the test above). With page 1's
    # scale, their block scales underflow E4M3 and they read back as zeros.
    layout = _layout(LayerKV("nvfp4", "token", "bf16", "token"))
    loud, quiet = _tokens(2, 23, 1e4), _tokens(2, 24)
    state = _write(layout, layout.init_state(), 0, _table(0, 2, [1]), 0, loud, loud)
    table = _table(1, 2, [0])
    state = _write(layout, state, 0, table, 0, quiet, quiet)
    keys, _, _ = _read(layout, state, 0, table, 2)
    err = np.abs(np.asarray(keys[0, :2]) - quiet[0])
    bound = np.abs(quiet[0]).max(axis=-1, keepdims=True) / 6 * (1 + 2**-3)
    assert np.all(err <= bound + 1e-7)


def test_bf16_reads_with_residual_and_sinks_stay_bf16():
    # Compute dtype bf16, bf16 store: per-channel keys (a residual page) and int8 per-token
    # values with 2 sink tokens read back as bf16 arrays, the residual and sinks exactly.
    layout = _layout(
        LayerKV("int8", "channel", "int8", "token"), sinks=2, store="bfloat16", dtype="bfloat16"
    )
    k = _tokens(6, 25).astype(ml_dtypes.bfloat16).astype(np.float32)  # bf16-exact tokens
    table = _table(0, 6, [1, 2])
    state = _write(layout, layout.init_state(), 0, table, 0, k, k)
    keys, values, _ = _read(layout, state, 0, table, 6)
    assert keys.dtype == values.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(keys[0, 4:6], np.float32), k[0, 4:6])
    np.testing.assert_array_equal(np.asarray(values[0, :2], np.float32), k[0, :2])
