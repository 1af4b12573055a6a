"""Static (tensor/head) KV scales and int2 KV in the paged pool, through its jit-side layout.

Writes and reads go through `PagedLayout.write`/`read` as one step does (a float32 pool, so no
bf16 rounding intervenes); expectations are built from numerics alone. Clipping is counted on
data built to clip a known number of elements.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tenantq.engine import Engine
from tenantq.engine.pool import PagedPool
from tenantq.numerics import dequantize, quantize, quantize_with_scale_zero_point
from tenantq.quant.kv_calibration import KVScales
from tenantq.quant.plan import KVPlan, QuantPlan

PAGE_TOKENS = 4


def _scales(config, absmax: float = 1.0, lo: float = -1.0, hi: float = 1.0) -> KVScales:
    """Statistics of our choosing: every head of every layer has max |x| = absmax."""
    shape = (config.num_layers, config.num_kv_heads)
    stats = {
        "absmax": np.full(shape, absmax, np.float32),
        "min": np.full(shape, lo, np.float32),
        "max": np.full(shape, hi, np.float32),
        "percentile": np.full(shape, absmax, np.float32),
        "layer_percentile": np.full(shape[0], absmax, np.float32),
    }
    return KVScales("model", "data", 99.99, 0, {"keys": stats, "values": stats})


def _pool(config, kv: KVPlan, scales: KVScales | None) -> PagedPool:
    return PagedPool(
        config, QuantPlan(kv=kv), dtype="float32", page_tokens=PAGE_TOKENS, max_seqs=2,
        max_seq_tokens=32, kv_scales=scales,
    )  # fmt: skip


def _write(pool: PagedPool, keys, values, valid) -> int:
    seq = pool.allocate(keys.shape[1])
    pool.make_room([seq], [int(valid.sum())])
    positions = np.arange(keys.shape[1], dtype=np.int32)[None]
    table = pool.table([seq])
    pool.state = pool.layout.write(pool.state, 0, table, positions, valid, keys, values)
    return seq


def _read(pool: PagedPool, seq: int, tokens: int):
    keys, values, _ = pool.layout.read(pool.state, 0, pool.table([seq]), tokens)
    return np.asarray(keys[0, :tokens]), np.asarray(values[0, :tokens])


def test_clip_rate_counts_exactly_the_elements_beyond_the_static_range(config) -> None:
    # fp8 keys per tensor with amax 1 (scale 1/448): |x| <= 1 fits, 2.0 saturates at 448 * s.
    # 12 real tokens and 4 padding tokens; exactly 10 real elements are set to +-2 (clipped)
    # and every padding element to 5 (never written, so never counted).
    h, d = config.num_kv_heads, config.head_dim
    rng = np.random.default_rng(0)
    k = rng.uniform(-1, 1, (1, 16, h, d)).astype(np.float32)
    flat = k[0, :12].reshape(-1)
    picked = rng.choice(flat.size, 10, replace=False)
    flat[picked] = np.where(np.arange(10) % 2, 2.0, -2.0)
    k[0, :12] = flat.reshape(12, h, d)
    k[0, 12:] = 5.0
    v = np.zeros_like(k)
    valid = np.arange(16)[None] < 12
    pool = _pool(config, KVPlan("fp8_e4m3", "tensor", "fp8_e4m3", "head"), _scales(config))
    seq = _write(pool, k, v, valid)
    rows = {r["tensor"]: r for r in pool.kv_clip_report() if r["layer"] == 0}
    assert rows["keys"]["clipped"] == 10 and rows["keys"]["elements"] == 12 * h * d
    assert rows["keys"]["clip_rate"] == 10 / (12 * h * d)
    assert rows["values"]["clipped"] == 0
    got_k, _ = _read(pool, seq, 12)
    # What is read is the codec's result for the calibrated scale: 1/448 (a true division).
    scale = np.float32(1.0) / np.float32(448.0)
    want = np.asarray(dequantize(quantize_with_scale_zero_point(k[0, :12], "fp8_e4m3", scale)))
    assert np.array_equal(got_k, want)
    assert np.abs(got_k[np.abs(k[0, :12]) == 2.0]).max() == pytest.approx(1.0)  # 448 * s


def test_per_head_scales_are_each_heads_own(config) -> None:
    # int8 per head: head j gets scale amax_j / 127. Statistics give head 0 amax 1, head 1 amax
    # 8; data within those ranges comes back within half a step (amax_j / 254) and nothing clips.
    assert config.num_kv_heads >= 2
    h, d = config.num_kv_heads, config.head_dim
    scales = _scales(config)
    amax = np.arange(1, h + 1, dtype=np.float32) ** 3  # 1, 8, ...
    for tensor in ("keys", "values"):
        scales.stats[tensor]["absmax"][0] = amax
    rng = np.random.default_rng(1)
    k = (rng.uniform(-1, 1, (1, 8, h, d)) * amax[None, None, :, None]).astype(np.float32)
    pool = _pool(config, KVPlan("int8", "head", "int8", "head"), scales)
    seq = _write(pool, k, k, np.ones((1, 8), bool))
    got_k, got_v = _read(pool, seq, 8)
    bound = (amax / 127 / 2)[None, :, None] * (1 + 1e-6)
    assert np.all(np.abs(got_k - k[0]) <= bound) and np.all(np.abs(got_v - k[0]) <= bound)
    assert all(r["clipped"] == 0 for r in pool.kv_clip_report())


def test_int2_kivi_pages_read_back_within_half_a_step(config) -> None:
    # Keys per channel over each full page (the newest partial page waits in the residual
    # window, exact); values per token in groups of 32 along head_dim (KIVI's grouping).
    h, d = config.num_kv_heads, config.head_dim
    rng = np.random.default_rng(2)
    k = (rng.standard_normal((1, 10, h, d)) * 3 + 1).astype(np.float32)
    v = rng.standard_normal((1, 10, h, d)).astype(np.float32)
    pool = _pool(config, KVPlan("int2", "channel", "int2", "token"), None)
    seq = _write(pool, k, v, np.ones((1, 10), bool))
    got_k, got_v = _read(pool, seq, 10)
    for first in (0, 4):  # two full pages of 4 tokens
        page = k[0, first : first + 4]
        want = np.asarray(dequantize(quantize(page, "int2", axis=0)))
        assert np.array_equal(got_k[first : first + 4], want)
    assert np.array_equal(got_k[8:], k[0, 8:])  # residual window, float32 pool: exact
    assert np.array_equal(got_v, np.asarray(dequantize(quantize(v[0], "int2", axis=-1))))


def test_a_static_plan_without_scales_is_one_line_naming_what_to_pass(config, params) -> None:
    with pytest.raises(ValueError, match=r"static scales .* pass kv_scales=") as err:
        Engine(config, params, QuantPlan.uniform("bf16", "fp8_e4m3"), max_seqs=1)
    assert "\n" not in str(err.value)


def test_engine_reports_the_clip_rate_and_records_the_scales(config, params) -> None:
    # Scales far too small (amax 1e-3) clip almost every element; no static axis: None.
    plan = QuantPlan(kv=KVPlan("fp8_e4m3", "head", "fp8_e4m3", "tensor"))
    engine = Engine(config, params, plan, kv_scales=_scales(config, 1e-3), max_seqs=2)
    assert engine.kv_clip_rate() == 0.0  # nothing written yet
    engine.logits([[1, 2, 3, 4, 5]])
    assert engine.kv_clip_rate() > 0.5
    assert engine.settings()["kv_scales"] == _scales(config, 1e-3).fingerprint()
    assert Engine(config, params, QuantPlan(), max_seqs=1).kv_clip_rate() is None
    # The printed memory report names each layer's static bytes (scales + clip counters).
    rows = engine.memory_report().kv_layers
    lines = [x for x in str(engine.memory_report()).splitlines() if x.strip().startswith("layer")]
    assert all(r["static_bytes"] > 0 for r in rows)
    assert len(lines) == len(rows)
    for row, line in zip(rows, lines, strict=True):
        assert f"static {row['static_bytes']:,} B" in line


def test_scales_of_another_model_are_refused_by_name(config) -> None:
    # Per-head scales calibrated on a model with one more KV head do not fit this pool.
    other = SimpleNamespace(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads + 1)
    kv = KVPlan("int8", "head", "bf16", "token")
    with pytest.raises(ValueError, match=r"kv_scales give 3 keys scales .* needs 2"):
        _pool(config, kv, _scales(other))
