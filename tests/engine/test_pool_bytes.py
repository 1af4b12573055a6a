"""A pool sized by `pool_bytes` holds no more than that, slot buffers included (hand arithmetic).

A quantized KV pool is pages plus per-sequence slot buffers (the bf16 residual window of a
per-channel tensor and the bf16 sink tokens). `pool_bytes` must pay for the slots first and
buy pages with the rest; counting pages only would overrun the budget.
"""

from __future__ import annotations

import pytest

from tenantq.engine.pool import PagedPool
from tenantq.quant.plan import KVPlan, QuantPlan

INT8_WITH_SINKS = QuantPlan(kv=KVPlan("int8", "channel", "int8", "token", sink_tokens=4))


def _hand_bytes(config, page_tokens: int, sinks: int) -> tuple[int, int]:
    """(bytes of one page in every layer, bytes of one sequence slot in every layer).

    Keys int8 per channel: p*h*d bytes of codes + one float32 scale per (head, channel).
    Values int8 per token: p*h*d bytes + one float32 scale per (token, head).
    Slot: the keys' bf16 residual page (p*h*d*2) + a bf16 copy of `sinks` tokens of keys
    and of values (2 * sinks*h*d*2).
    """
    p, h, d, layers = page_tokens, config.num_kv_heads, config.head_dim, config.num_layers
    page = (p * h * d + h * d * 4) + (p * h * d + p * h * 4)
    slot = p * h * d * 2 + 2 * sinks * h * d * 2
    return layers * page, layers * slot


@pytest.mark.parametrize(("page_tokens", "max_seqs"), [(4, 4), (16, 2)])
def test_pool_bytes_pays_for_the_slot_buffers(config, page_tokens: int, max_seqs: int) -> None:
    # tiny config (2 layers, 2 KV heads, head_dim 8): at (4, 4) a page is 448 B and the four
    # slots 3,072 B, so 10,000 B buy (10,000 - 3,072) // 448 = 15 pages = 9,792 B in all.
    # Counting pages alone would buy 22 pages: 9,856 + 3,072 = 12,928 B, over the budget.
    page_bytes, slot_bytes = _hand_bytes(config, page_tokens, sinks=4)
    pool = PagedPool(
        config, INT8_WITH_SINKS, page_tokens=page_tokens, max_seqs=max_seqs, pool_bytes=10_000
    )
    slots = max_seqs * slot_bytes
    assert pool.num_pages == (10_000 - slots) // page_bytes
    assert pool.nbytes == pool.num_pages * page_bytes + slots  # the real arrays, read back
    assert pool.nbytes <= 10_000 < pool.nbytes + page_bytes  # fits, and one more page would not
    if (page_tokens, max_seqs) == (4, 4):
        assert (pool.num_pages, pool.nbytes) == (15, 9_792)


def test_pool_bytes_too_small_for_the_slots_names_both_figures(config) -> None:
    # 16 slots of 768 B are 12,288 B: no page can be bought with 10,000 B.
    with pytest.raises(ValueError, match=r"10,000 bytes .* \(12,288 bytes\) and one page"):
        PagedPool(config, INT8_WITH_SINKS, page_tokens=4, max_seqs=16, pool_bytes=10_000)


def test_slots_plus_one_page_is_the_smallest_pool(config) -> None:
    # At (4, 4): four slots of 768 B and one page of 448 B = 3,520 B is the least that works.
    pool = PagedPool(config, INT8_WITH_SINKS, page_tokens=4, max_seqs=4, pool_bytes=3_520)
    assert (pool.num_pages, pool.nbytes) == (1, 3_520)
    with pytest.raises(ValueError, match=r"3,519 bytes .* \(3,072 bytes\) and one page"):
        PagedPool(config, INT8_WITH_SINKS, page_tokens=4, max_seqs=4, pool_bytes=3_519)
