"""The pool sizes itself from memory by default; `engine.settings()` says what was chosen."""

from __future__ import annotations

import os

import pytest

from tenantq.engine import Engine, PagedPool
from tenantq.engine import pool as pool_module
from tenantq.quant.plan import KVPlan, QuantPlan
from tenantq.storage.kv import kv_storage
from tenantq.testing import tiny_config

KV = QuantPlan(kv=KVPlan("int8", "channel", "int4", "token", sink_tokens=2))


def _memory(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr(pool_module, "device_memory_bytes", lambda device=None: (nbytes, "test"))


def test_default_pool_is_memory_less_weights_less_reserve(monkeypatch, config) -> None:
    # pool = memory - weights - 10% reserve; pages = (pool - slots' buffers) // page bytes.
    memory, weights = 50_000, 20_000
    _memory(monkeypatch, memory)
    layers = kv_storage(config, KV, 16)
    page = sum(lay.page_bytes for lay in layers)
    slots = 4 * sum(lay.slot_bytes for lay in layers)
    pool = PagedPool(config, KV, max_seqs=4, weights_bytes=weights)
    expected = (memory - weights - memory // 10 - slots) // page
    assert 0 < expected < 4 * 128 // 16  # memory binds here, not the sequences' need
    assert pool.num_pages == expected
    assert pool.nbytes <= memory - weights - memory // 10 < pool.nbytes + page


def test_default_pool_stops_at_what_max_seqs_can_use(monkeypatch, config) -> None:
    _memory(monkeypatch, 10**12)  # ample memory: every slot can hold a full context
    pool = PagedPool(config, KV, max_seqs=3, max_seq_tokens=40)
    assert pool.num_pages == 3 * -(-40 // 16)


def test_too_little_memory_for_one_sequence_names_the_figures(monkeypatch) -> None:
    # A Llama-3.1-8B-shaped KV (32 layers x 8 KV heads x 128) in 16 GiB that the weights fill:
    # no array is allocated before the error.
    config = tiny_config(
        vocab_size=128, hidden_size=4096, intermediate_size=256, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
    )  # fmt: skip
    _memory(monkeypatch, 16 * 2**30)
    with pytest.raises(ValueError) as err:
        PagedPool(config, max_seqs=16, weights_bytes=16_060_522_496)
    message = str(err.value)
    for figure in ("17,179,869,184", "16,060,522,496", "1,717,986,918", "131,072 tokens"):
        assert figure in message, (figure, message)
    assert "pool_bytes" in message and "\n" not in message


def test_cpu_device_memory_is_the_documented_fraction_of_host_memory() -> None:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    nbytes, source = pool_module.device_memory_bytes()
    assert nbytes == int(physical * pool_module.CPU_MEMORY_FRACTION) == physical // 2
    assert "host" in source


def test_settings_name_everything_that_changes_results_or_memory(config, params) -> None:
    engine = Engine(config, params, KV, dtype="float32", num_pages=6, max_seqs=2, page_tokens=8)
    assert engine.settings() == {
        "dtype": "float32",
        "tp": 1,
        "scale_scope": "global",
        "cache": "paged",
        "kv_store_dtype": "float32",
        "page_tokens": 8,
        "pool_pages": 6,
        "max_seqs": 2,
        "max_seq_tokens": config.max_position_embeddings,
        "plan_fingerprint": KV.fingerprint(),
    }
    other = Engine(config, params, dtype="bfloat16", num_pages=6, max_seqs=2, page_tokens=8)
    changed = {k for k, v in other.settings().items() if engine.settings()[k] != v}
    assert changed == {"dtype", "kv_store_dtype", "plan_fingerprint"}


def test_pool_bytes_is_a_ceiling_with_slot_buffers(config) -> None:
    # int8 KV with sinks: each slot holds a residual window and sink copies besides the pages;
    # they come out of pool_bytes too, so the pool never holds more than it was given.
    plan = QuantPlan(kv=KVPlan("int8", "channel", "int8", "token", sink_tokens=4))
    pool = PagedPool(config, plan, page_tokens=4, max_seqs=2, pool_bytes=10_000)
    page = sum(lay.page_bytes for lay in kv_storage(config, plan, 4))
    assert pool.nbytes <= 10_000 < pool.nbytes + page
