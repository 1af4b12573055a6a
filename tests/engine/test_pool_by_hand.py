"""The host half of the paged pool by hand (`make mutation TARGETS=pool`): option checks and
their one-line errors, the three ways a pool is sized, static scales written from KVScales,
slots, tenants, preemption, the block table, and the bytes report. Tiny pools, no engine.

Byte figures are hand arithmetic on the tiny model (2 layers, 2 KV heads of 8 channels):
with int8 keys per channel, int8 values per token, 4 sink tokens and 4-token pages, a page
is, per layer, keys 64 B + one float32 scale per (head, channel) (16 x 4 = 64 B) + values
64 B + one float32 scale per (token, head) (8 x 4 = 32 B) = 224 B; a slot is the keys'
bf16 residual page (128 B) + bf16 sinks of keys and values (2 x 4 x 16 x 2 = 256 B) = 384 B.
"""

from __future__ import annotations

import os
import re
from fractions import Fraction

import numpy as np
import pytest

from tenantq.engine.cache import CacheFull
from tenantq.engine.pool import (
    CPU_MEMORY_FRACTION,
    PagedPool,
    SequencePreempted,
    device_memory_bytes,
)
from tenantq.quant.kv_calibration import KVScales
from tenantq.quant.plan import KVPlan, QuantPlan
from tenantq.testing import tiny_config

INT8_SINKS = QuantPlan(kv=KVPlan("int8", "channel", "int8", "token", sink_tokens=4))
PAGE_BYTES, SLOT_BYTES = 224, 384  # per layer, see the module docstring


def _pool(plan=INT8_SINKS, **kw) -> PagedPool:
    args = dict(page_tokens=4, max_seqs=4, max_seq_tokens=32, num_pages=4)
    args.update(kw)
    return PagedPool(tiny_config(), plan, **args)


def _raises(exc, message: str):
    return pytest.raises(exc, match=f"^{re.escape(message)}$")


# ----------------------------------------------------------------------- options
@pytest.mark.parametrize("name", ["page_tokens", "max_seqs", "max_seq_tokens", "num_pages"])
@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_counts_must_be_positive_integers(name, bad):
    with _raises(ValueError, f"{name} must be a positive integer, got {bad!r}"):
        _pool(**{name: bad})


def test_numpy_integers_are_counts():
    pool = _pool(num_pages=np.int64(3), max_seqs=np.int32(2))
    assert (pool.num_pages, pool.layout.num_pages, pool.max_seqs) == (3, 3, 2)


def test_context_and_size_options():
    with _raises(ValueError, "max_seq_tokens=129 exceeds the model's context (128 tokens)"):
        _pool(max_seq_tokens=129)
    with _raises(ValueError, "pass num_pages or pool_bytes, not both"):
        _pool(num_pages=4, pool_bytes=10_000)
    message = (
        "pool_bytes must be a whole number of bytes, got '2GiB'; for '2GiB'-style sizes use "
        "tenantq.capacity.parse_bytes('2GiB')"
    )
    with _raises(ValueError, message):
        _pool(num_pages=None, pool_bytes="2GiB")
    with pytest.raises(ValueError, match=r"^pool_bytes must be a whole number of bytes, got True;"):
        _pool(num_pages=None, pool_bytes=True)


def test_static_axes_need_kv_scales():
    plan = QuantPlan.uniform(kv="int8")  # int8's default axes: tensor/tensor (static)
    message = (
        "the plan's KV uses static scales (key_axis/value_axis 'tensor' or 'head'); pass "
        "kv_scales=tenantq.quant.kv_calibration.kv_static_scales(model_path, plan)"
    )
    with _raises(ValueError, message):
        _pool(plan)


def test_defaults_and_geometry():
    # Defaults: 16-token pages, 16 slots, the model's context (128) -> 128/16 = 8 pages per
    # sequence; the block table is [slot, length, 8 pages].
    pool = PagedPool(tiny_config(), num_pages=5)
    assert (pool.page_tokens, pool.max_seqs, pool.max_seq_tokens) == (16, 16, 128)
    assert (pool.layout.max_pages, pool.layout.max_seqs, pool.sized_by) == (8, 16, "num_pages")
    assert pool.table([None]).shape == (1, 10)
    assert (pool.layout.dtype, pool.layout.store_dtype) == ("bfloat16", "bfloat16")
    # A partial last page still counts: 33 tokens of 16 -> 3 pages.
    assert _pool(page_tokens=16, max_seq_tokens=33).layout.max_pages == 3
    # float32 compute keeps unquantized KV in float32; any other dtype stores bfloat16.
    assert _pool(dtype="float32").layout.store_dtype == "float32"
    f16 = _pool(dtype="float16")
    assert (f16.layout.dtype, f16.layout.store_dtype) == ("float16", "bfloat16")
    assert PagedPool(tiny_config(), None, num_pages=2).layout.layers[0].kv.key_format == "bf16"


# ----------------------------------------------------------------------- sizing
def test_pool_bytes_buys_pages_after_the_slots():
    # 2 layers: page 448 B, slot 768 B; 4 slots = 3,072 B; (10,000 - 3,072) // 448 = 15.
    pool = _pool(num_pages=None, pool_bytes=np.int64(10_000))
    assert (pool.num_pages, pool.sized_by) == (15, "pool_bytes=10,000")
    assert pool.nbytes == 15 * 448 + 3_072


def test_pool_bytes_of_a_float32_pool_count_float32_buffers():
    # A float32 engine keeps residual and sinks in float32: a slot is 2 * (64 * 4 + 2 * 4 *
    # 16 * 4) = 1,536 B, 4 slots 6,144 B; pages are unchanged (448 B): (10,000 - 6,144) //
    # 448 = 8 pages, 9,728 B in all.
    pool = _pool(num_pages=None, pool_bytes=10_000, dtype="float32")
    assert pool.storage_per_device[0].store_dtype == "float32"
    assert (pool.num_pages, pool.nbytes) == (8, 8 * 448 + 6_144)


def test_pool_bytes_under_tensor_parallelism_are_per_device():
    # tp=2: one KV head per device, so a page is 224 B and a slot 384 B per device:
    # (10,000 - 4 * 384) // 224 = 37 pages; the arrays (all devices) hold twice that.
    pool = _pool(num_pages=None, pool_bytes=10_000, tp=2)
    assert pool.num_pages == 37
    assert [s.kv_heads for s in pool.storage_per_device] == [1, 1]
    assert pool.layout.kv_heads == 2
    assert pool.nbytes == 2 * (37 * 224 + 4 * 384)


def test_memory_sizing_at_its_boundary():
    # 8-token sequences of 4-token pages: 2 pages; one sequence needs 2 * 448 B of pages and
    # 2 slots * 768 B = 1,536 B of buffers = 2,432 B. The pool is the device's memory less
    # weights and the 1/10 reserve (DEFAULT_RESERVE_FRACTION, vLLM's 0.9 utilisation).
    memory, source = device_memory_bytes()
    reserve = memory // 10
    kw = dict(num_pages=None, max_seqs=2, max_seq_tokens=8)
    exact = _pool(weights_bytes=memory - reserve - 2_432, **kw)
    assert exact.num_pages == 2  # (2,432 - 1,536) // 448
    assert exact.sized_by == f"memory: 2,432 of {source}"
    assert _pool(weights_bytes=memory - reserve - 2_432 - 448, **kw).num_pages == 3
    default = _pool(**kw)  # no weights unless told: the pool is memory less the reserve
    assert default.num_pages == 4  # capped at max_seqs * max_pages = 2 * 2
    assert default.sized_by == f"memory: {memory - reserve:,} of {source}"
    weights = memory - reserve - 2_431
    message = (
        f"the KV pool gets 2,431 bytes ({source}: {memory:,}, less weights {weights:,} and "
        f"the 1/10 reserve {reserve:,}), but one sequence of 8 tokens needs 896 bytes of "
        "pages plus 1,536 of slot buffers; lower max_seq_tokens or max_seqs, or pass "
        "pool_bytes/num_pages"
    )
    with _raises(ValueError, message):
        _pool(weights_bytes=weights, **kw)


def test_memory_sizing_pays_the_static_scales_once():
    # Static int8 KV (tensor axes): no page scales and no residual, so a page is 2 * (64 + 64)
    # = 256 B in both layers, a slot the sinks' 2 * 256 = 512 B, and the static scales and
    # clip counters 2 layers * 2 tensors * (4 + 8) = 48 B once. One 8-token sequence (2
    # pages) with 2 slots: 512 + 1,024 + 48 = 1,584 B.
    plan = QuantPlan(kv=KVPlan("int8", "tensor", "int8", "tensor", sink_tokens=4))
    memory, _ = device_memory_bytes()
    reserve = memory // 10
    kw = dict(num_pages=None, max_seqs=2, max_seq_tokens=8, kv_scales=_scales())
    assert _pool(plan, weights_bytes=memory - reserve - 1_584, **kw).num_pages == 2
    with pytest.raises(ValueError, match="needs 512 bytes of pages plus 1,072 of slot buffers"):
        _pool(plan, weights_bytes=memory - reserve - 1_583, **kw)


def test_memory_sizing_of_a_one_layer_model():
    # One layer: a page 224 B, a slot 384 B; 8 tokens = 2 pages -> 2 * 224 + 2 * 384 = 1,216 B.
    memory, _ = device_memory_bytes()
    pool = PagedPool(
        tiny_config(num_layers=1), INT8_SINKS, page_tokens=4, max_seqs=2, max_seq_tokens=8,
        weights_bytes=memory - memory // 10 - 1_216,
    )  # fmt: skip
    assert pool.num_pages == 2


def test_device_memory_on_cpu_is_half_the_host():
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert Fraction(1, 2) == CPU_MEMORY_FRACTION
    assert device_memory_bytes() == (
        physical // 2,
        f"1/2 of the host's {physical:,} bytes of physical memory (CPU)",
    )


class _Accelerator:
    """A stand-in device (unit test): what `jax.Device` reports about its memory."""

    platform, device_kind = "tpu", "TPU v5 lite"

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_device_memory_of_an_accelerator_is_its_bytes_limit():
    assert device_memory_bytes(_Accelerator({"bytes_limit": 16 * 2**30, "in_use": 5})) == (
        17_179_869_184,
        "TPU v5 lite memory (bytes_limit)",
    )
    # No statistics (or no limit in them): the host figure, as on a CPU.
    cpu = device_memory_bytes()
    assert device_memory_bytes(_Accelerator(None)) == cpu
    assert device_memory_bytes(_Accelerator({"bytes_limit": 0})) == cpu
    # A CPU device is always the host figure, whatever statistics it reports.
    host = _Accelerator({"bytes_limit": 5})
    host.platform = "cpu"
    assert device_memory_bytes(host) == cpu


# ----------------------------------------------------------------------- static scales
def _scales(heads: int = 2) -> KVScales:
    # absmax per [layer, head]; int8 symmetric scale = amax / 127.
    absmax = np.array([[1.27, 2.54, 0.0][:heads], [3.81, 0.127, 0.0][:heads]], np.float32)
    stats = {t: {"absmax": absmax} for t in ("keys", "values")}
    return KVScales("m", "d", 99.9, 10, stats)


def test_static_scales_are_written_per_tensor_and_per_head():
    # keys per tensor: max over heads / 127 (0.02, 0.03); values per head: 0.01, 0.02 | 0.03,
    # 0.001, shaped (1, 1, heads, 1) so the head axis stays at index 2.
    plan = QuantPlan(kv=KVPlan("int8", "tensor", "int8", "head"))
    pool = _pool(plan, kv_scales=_scales())
    assert pool.kv_scales is not None
    k0, k1 = (np.asarray(pool.state[i]["keys"]["static_scale"]) for i in (0, 1))
    np.testing.assert_allclose(k0, [0.02], rtol=1e-6)
    np.testing.assert_allclose(k1, [0.03], rtol=1e-6)
    v0, v1 = (np.asarray(pool.state[i]["values"]["static_scale"]) for i in (0, 1))
    assert v0.shape == (1, 1, 2, 1)
    np.testing.assert_allclose(v0.ravel(), [0.01, 0.02], rtol=1e-6)
    np.testing.assert_allclose(v1.ravel(), [0.03, 0.001], rtol=1e-6)
    assert pool.kv_clip_report() == [
        {"layer": i, "tensor": t, "format": "int8", "axis": a, "elements": 0, "clipped": 0,
         "clip_rate": 0.0}
        for i in (0, 1) for t, a in (("keys", "tensor"), ("values", "head"))
    ]  # fmt: skip


def test_static_int2_zero_points_are_written():
    # int2 per head from the calibrated [min, max]: the pool holds KVScales.for_tensor's
    # scale and zero point, reshaped to (1, 1, heads, 1).
    plan = QuantPlan(kv=KVPlan("bf16", "channel", "int2", "head"))
    lo = np.array([[-1.0, -2.0], [0.0, -0.5]], np.float32)
    hi = np.array([[2.0, 1.0], [3.0, 0.5]], np.float32)
    stat = {"absmax": np.maximum(-lo, hi), "min": lo, "max": hi}
    scales = KVScales("m", "d", 99.9, 10, {"keys": stat, "values": stat})
    pool = _pool(plan, kv_scales=scales)
    for layer in (0, 1):
        spec = pool.layout.layers[layer].kv.values
        scale, zp = scales.for_tensor(layer, "values", spec)
        got = pool.state[layer]["values"]
        np.testing.assert_array_equal(np.asarray(got["static_scale"]).ravel(), scale)
        np.testing.assert_array_equal(np.asarray(got["static_zero_point"]).ravel(), zp)
    # (max - min) / 3 codes: layer 0 head 0 spans 3.0 -> scale 1.0.
    np.testing.assert_allclose(np.asarray(pool.state[0]["values"]["static_scale"])[0, 0, 0], 1.0)


def test_kv_scales_of_another_model_are_refused():
    plan = QuantPlan(kv=KVPlan("int8", "channel", "int8", "head"))
    absmax = np.ones((2, 3), np.float32)  # 3 KV heads; the tiny model has 2
    scales = KVScales(
        "m", "d", 99.9, 10, {"keys": {"absmax": absmax}, "values": {"absmax": absmax}}
    )
    message = (
        "kv_scales give 3 values scales for layer 0 (axis 'head'); this model needs 2: "
        "calibrate on this model"
    )
    with _raises(ValueError, message):
        _pool(plan, kv_scales=scales)


def test_clip_report_counts_what_the_static_scale_clipped():
    # keys per tensor at scale 0.02 hold |x| <= 0.02 * 127 = 2.54; write 3 tokens of 16
    # elements each into layer 1 (scale 0.03: |x| <= 3.81) with two elements at 5.0.
    plan = QuantPlan(kv=KVPlan("int8", "tensor", "bf16", "token"))
    pool = _pool(plan, kv_scales=_scales())
    seq = pool.allocate(8)
    pool.make_room([seq], [3])
    x = np.zeros((1, 3, 2, 8), np.float32)
    x[0, 0, 0, 0] = x[0, 2, 1, 7] = 5.0
    x[0, 1, 1, 1] = 3.8  # inside the range
    positions, valid = np.arange(3, dtype=np.int32)[None], np.ones((1, 3), bool)
    pool.state = pool.layout.write(pool.state, 1, pool.table([seq]), positions, valid, x, x)
    assert pool.kv_clip_report() == [
        {"layer": 0, "tensor": "keys", "format": "int8", "axis": "tensor", "elements": 0,
         "clipped": 0, "clip_rate": 0.0},
        {"layer": 1, "tensor": "keys", "format": "int8", "axis": "tensor", "elements": 48,
         "clipped": 2, "clip_rate": 2 / 48},
    ]  # fmt: skip

    # Only static tensors have a row, and a per-channel key before them does not hide them.
    plan = QuantPlan(kv=KVPlan("int8", "channel", "int8", "tensor"))
    rows = _pool(plan, kv_scales=_scales()).kv_clip_report()
    assert [(r["layer"], r["tensor"], r["axis"]) for r in rows] == [
        (0, "values", "tensor"), (1, "values", "tensor"),
    ]  # fmt: skip


# ----------------------------------------------------------------------- sequences
def test_slots_ids_and_the_block_table():
    pool = _pool(max_seqs=3)  # 3 slots, 4 pages: the two "none" markers differ
    a, b = pool.allocate(32), pool.allocate(5)
    assert (a, b) == (0, 1)
    # Open, no pages yet: length 0, no block.
    np.testing.assert_array_equal(pool.table([b]), [[1, 0, 4, 4, 4, 4, 4, 4, 4, 4]])
    with pytest.raises(ValueError, match="zip"):  # one end per sequence, not fewer
        pool.make_room([a, b], [5])
    pool.make_room([a, b], [5, 4])  # 5 tokens: 2 pages (0, 1); 4 tokens: 1 page (2)
    table = pool.table([a, None, b])
    # [slot, tokens after the step, pages..., num_pages (=4) as "no page"]; padding rows
    # carry slot max_seqs (=3) and length 0. max_pages = 32 / 4 = 8 columns of pages.
    np.testing.assert_array_equal(
        table,
        [[0, 5, 0, 1, 4, 4, 4, 4, 4, 4], [3, 0, 4, 4, 4, 4, 4, 4, 4, 4],
         [1, 4, 2, 4, 4, 4, 4, 4, 4, 4]],
    )  # fmt: skip
    assert table.dtype == np.int32
    assert pool.free_pages == 1
    pool.make_room([a], [5])  # no growth: same pages
    assert pool.free_pages == 1
    pool.free(a)
    assert pool.free_pages == 3
    c = pool.allocate(4)
    assert (c, pool.table([c])[0, 0]) == (2, 0)  # slot 0 is reused, ids keep counting


def test_sequence_errors():
    pool = _pool(max_seqs=2, num_pages=8)
    with _raises(CacheFull, "a sequence of 33 tokens exceeds max_seq_tokens=32"):
        pool.allocate(33)
    with pytest.raises(ValueError, match=r"^unknown tenant 'nobody'"):
        pool.allocate(4, tenant="nobody")
    a = pool.allocate(32)  # the refusals took no id and no slot
    assert a == 0
    b = pool.allocate(32)
    with _raises(CacheFull, "all 2 sequence slots are in use"):
        pool.allocate(4)
    with _raises(CacheFull, "sequence 1 would hold 33 tokens, over max_seq_tokens=32"):
        pool.make_room([b], [33])
    pool.make_room([b], [32])  # exactly max_seq_tokens is allowed: 8 pages of 4 tokens
    assert pool.free_pages == 0
    with _raises(ValueError, "sequence 7 is not allocated"):
        pool.free(7)
    pool.free(a)
    assert pool.allocate(32, tenant="default") == 2


def test_a_guarantee_preempts_the_borrower():
    # 4 pages. The default tenant (no guarantee) borrows all four; tenant "a", guaranteed 2,
    # then needs 2: the default tenant's newest sequence loses its pages.
    pool = _pool()
    pool.add_tenant("a", guaranteed_pages=2)
    pool.add_tenant("b")  # no guarantee unless given one
    assert pool.tenant_usage()["b"] == (0, 0)
    old, new = pool.allocate(8), pool.allocate(8)
    pool.make_room([old, new], [8, 8])
    assert pool.free_pages == 0
    mine = pool.allocate(8, tenant="a")
    pool.make_room([mine], [8])
    assert pool.is_preempted(new) and not pool.is_preempted(old)
    assert pool.tenant_usage() == {"default": (2, 0), "a": (2, 2), "b": (0, 0)}
    message = (
        f"sequence {new} was preempted: its pages were reclaimed for another tenant's "
        "guaranteed share; release it and submit it again"
    )
    with _raises(SequencePreempted, message):
        pool.make_room([old, new], [8, 9])
    pool.free(new)  # a preempted sequence has no pages left to return
    assert not pool.is_preempted(new)
    assert pool.free_pages == 0
    assert pool.tenant_usage() == {"default": (2, 0), "a": (2, 2), "b": (0, 0)}
    assert pool.allocate(4) == 3  # its slot came back


# ----------------------------------------------------------------------- bytes
def test_kv_report_by_hand():
    # 3 pages, 2 slots, per layer: data 3 * 128, scales 3 * 96, residual 2 * 128, sinks
    # 2 * 256 = 384 + 288 + 256 + 512 = 1,440 B.
    pool = _pool(num_pages=3, max_seqs=2)
    rows = pool.kv_report()
    assert [r["layer"] for r in rows] == [0, 1]
    for r in rows:
        assert (r["pages"], r["page_bytes"], r["data_bytes"], r["scale_bytes"]) == (
            3,
            224,
            384,
            288,
        )
        assert (r["residual_bytes"], r["sink_bytes"], r["static_bytes"]) == (256, 512, 0)
        assert r["total_bytes"] == 1_440
    assert pool.nbytes == 2_880
