"""The pool's page/token scales stored as bf16 or E8M0 (`kv.scale_dtype`): write, read back.

Each bound follows from the stored scale's own rounding, checked per scale group against
numpy statistics of what was written (a float32 pool, so the residual window adds nothing):
- bf16 scale s' = bf16(s), |s' - s| <= 2^-8 s (8 significant bits, round to nearest). A
  symmetric int code then errs by at most half a step: |x - x^| <= s (1 + 2^-8) / 2 (a value
  at amax may reach qmax (1 + 2^-8) / 1 and clip by less than that). int2 also rounds its
  zero point to bf16 (|dzp| <= 2^-8 |lo| / s'): |x - x^| <= s (1 + 2^-8) / 2 + 2^-8 |lo|.
- E8M0 scale s' = 2^ceil(log2 s) (OCP MX v1.0 sec. 5.4.1 scale type, rounded up): s <= s' < 2s,
  nothing clips, |x - x^| <= s' / 2 < s: one code step at most doubles.
s = amax / qmax for symmetric int (127, 7), (hi - lo) / 3 for int2; fp8 E4M3 elements keep a
relative error <= 2^-4 (3 mantissa bits) plus half the subnormal step 2^-9 s'.
"""

from __future__ import annotations

import numpy as np
import pytest

from tenantq.engine.pool import PagedPool
from tenantq.numerics import get_format
from tenantq.quant.plan import KVPlan, QuantPlan

PAGE_TOKENS = 4
TOKENS = 12  # three full pages: every key page is quantized, none waits in the residual
BF16_REL = 2.0**-8
F32_SLACK = 1e-6  # float32 division/multiplication rounding, relative to the group's range


@pytest.fixture(scope="module")
def wide(make_config):
    # head_dim 64: int2 value groups of 32 split a head in two; int4/int8 take the whole head
    return make_config(head_dim=64)


def _write_read(config, fmt: str, scale_dtype: str, k, v):
    """Write TOKENS tokens of one sequence into layer 0 and read them back (float32 pool)."""
    kv = KVPlan(fmt, "channel", fmt, "token", scale_dtype=scale_dtype)
    pool = PagedPool(config, QuantPlan(kv=kv), dtype="float32", page_tokens=PAGE_TOKENS,
                     max_seqs=2, max_seq_tokens=32)  # fmt: skip
    seq = pool.allocate(TOKENS)
    pool.make_room([seq], [TOKENS])
    table = pool.table([seq])
    positions = np.arange(TOKENS, dtype=np.int32)[None]
    valid = np.ones((1, TOKENS), bool)
    pool.state = pool.layout.write(pool.state, 0, table, positions, valid, k[None], v[None])
    keys, values, _ = pool.layout.read(pool.state, 0, table, TOKENS)
    pages = np.asarray(table[0, 2 : 2 + TOKENS // PAGE_TOKENS])
    return np.asarray(keys[0, :TOKENS]), np.asarray(values[0, :TOKENS]), pool, pages


def _groups(x: np.ndarray, axis: str, group: int | None):
    """x [tokens, heads, d] as groups on the last axis: per page's tokens (channel) or per
    `group` elements of head_dim (token)."""
    t, h, d = x.shape
    if axis == "channel":  # [pages, heads, d, page_tokens]
        return x.reshape(t // PAGE_TOKENS, PAGE_TOKENS, h, d).transpose(0, 2, 3, 1)
    g = min(group or d, d)
    return x.reshape(t, h, d // g, g)


def _data(config, seed: int):
    rng = np.random.default_rng(seed)
    shape = (TOKENS, config.num_kv_heads, config.head_dim)
    # keys with a per-channel offset and spread (as real keys have outliers per channel)
    spread = rng.uniform(0.2, 5.0, shape[1:])
    k = (rng.standard_normal(shape) * spread + rng.normal(0, 2, shape[1:])).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    return k, v


@pytest.mark.slow  # four pools, four compiles (~15 s at load 10 on 2 cores)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("scale_dtype", ["bf16", "e8m0"])
def test_symmetric_int_round_trip_within_the_scale_dtypes_bound(wide, fmt, scale_dtype):
    k, v = _data(wide, seed=len(fmt) + len(scale_dtype))
    got_k, got_v, _, _ = _write_read(wide, fmt, scale_dtype, k, v)
    spec = get_format(fmt)
    for x, got, axis in ((k, got_k, "channel"), (v, got_v, "token")):
        xs, gs = (
            _groups(x, axis, spec.default_group_size),
            _groups(got, axis, spec.default_group_size),
        )
        s = np.abs(xs).max(axis=-1, keepdims=True) / spec.max_finite
        bound = 0.5 * s * (1 + BF16_REL) if scale_dtype == "bf16" else s  # e8m0: s'/2 < s
        err = np.abs(gs - xs)
        assert np.all(err <= bound * (1 + F32_SLACK)), (fmt, scale_dtype, axis, float(err.max()))
        # the bound is not vacuous: errors reach at least a quarter of it somewhere
        assert float((err / bound).max()) > 0.25


def test_e8m0_scales_are_powers_of_two_rounded_up(wide):
    k, v = _data(wide, seed=7)
    _, _, pool, pages = _write_read(wide, "int4", "e8m0", k, v)
    codes = np.asarray(pool.state[0]["keys"]["scales"])[pages]  # [pages, 1, heads, d] uint8
    assert codes.dtype == np.uint8
    stored = np.ldexp(1.0, codes.astype(np.int32) - 127)[:, 0]  # [pages, heads, d]
    s = np.abs(_groups(k, "channel", None)).max(axis=-1) / 7.0
    assert np.all(stored >= s) and np.all(stored < 2 * s)


def test_bf16_scales_are_within_2_to_minus_8_of_float32(wide):
    import ml_dtypes

    k, v = _data(wide, seed=8)
    _, _, pool, pages = _write_read(wide, "int8", "bf16", k, v)
    bits = np.asarray(pool.state[0]["keys"]["scales"])[pages]
    assert bits.dtype == np.uint16  # bf16 held as its bit pattern
    stored = bits.view(ml_dtypes.bfloat16).astype(np.float32)[:, 0]
    s = np.abs(_groups(k, "channel", None)).max(axis=-1) / 127.0
    assert np.all(np.abs(stored - s) <= BF16_REL * s * (1 + F32_SLACK))


def test_int2_with_bf16_scale_and_zero_point_within_bound(wide):
    k, v = _data(wide, seed=9)
    got_k, got_v, pool, _ = _write_read(wide, "int2", "bf16", k, v)
    assert np.asarray(pool.state[0]["keys"]["zero_points"]).dtype == np.uint16
    for x, got, axis in ((k, got_k, "channel"), (v, got_v, "token")):
        xs, gs = _groups(x, axis, 32), _groups(got, axis, 32)
        lo, hi = xs.min(axis=-1, keepdims=True), xs.max(axis=-1, keepdims=True)
        s = (hi - lo) / 3
        bound = 0.5 * s * (1 + BF16_REL) + BF16_REL * np.abs(lo)
        err = np.abs(gs - xs)
        assert np.all(err <= bound + F32_SLACK * (hi - lo + np.abs(lo))), (axis, float(err.max()))


def test_fp8_with_e8m0_scales_within_the_element_bound(wide):
    k, v = _data(wide, seed=10)
    got_k, got_v, _, _ = _write_read(wide, "fp8_e4m3", "e8m0", k, v)
    for x, got, axis in ((k, got_k, "channel"), (v, got_v, "token")):
        xs, gs = _groups(x, axis, None), _groups(got, axis, None)
        s_up = 2 * np.abs(xs).max(axis=-1, keepdims=True) / 448.0  # s' < 2s
        bound = 2.0**-4 * np.abs(xs) + 2.0**-10 * s_up
        assert np.all(np.abs(gs - xs) <= bound * (1 + F32_SLACK)), axis
