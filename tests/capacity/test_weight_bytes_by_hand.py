"""Capacity byte arithmetic that the budget tests leave unpinned (found by `make mutation
TARGETS=capacity-bytes`): sharding labels, a static W8A8 scale's 4 bytes, the store dtype of
unquantized KV, and the one-line errors for impossible counts. Expected bytes by hand on the
tiny model (2 layers, 2 KV heads of 8, 16-token pages).
"""

from __future__ import annotations

import pytest

from tenantq.capacity.kv import kv_pool_bytes, pool_bytes_from_layers, tenant_pages
from tenantq.capacity.weights import sharding_label, tensor_bytes
from tenantq.numerics import storage_nbytes
from tenantq.quant.plan import STATIC_ACT_SCALE_BYTES, KVPlan, QuantPlan, Rule
from tenantq.storage.kv import kv_storage
from tenantq.testing import tiny_config


def test_sharding_labels_say_how_each_line_is_laid_out():
    assert sharding_label("embed", 1, False) == "whole (1 chip)"
    assert sharding_label("mlp", 1, False) == "whole (1 chip)"
    assert sharding_label("embed", 2, False) == "sharded over vocab"
    assert sharding_label("lm_head", 3, True) == "replicated (vocab not divisible by 3 chips)"
    assert sharding_label("attention", 2, False) == "sharded over heads"
    assert sharding_label("norms", 2, False) == "replicated"


def test_a_static_activation_scale_adds_one_float32_per_tensor():
    # Static W8A8 keeps one calibrated float32 activation scale per linear input (4 bytes,
    # replicated on every chip) on top of the weight's own storage.
    assert STATIC_ACT_SCALE_BYTES == 4
    config = tiny_config()
    rule = dict(pattern="layers/0/mlp/up_proj", format="int8", activations="int8")
    dynamic = QuantPlan(rules=(Rule(**rule),))
    static = QuantPlan(rules=(Rule(**rule, activation_scale="static"),))
    shape = config.tensors()["layers/0/mlp/up_proj"].shape
    want = storage_nbytes(shape, "int8", axis=0)
    for plan, extra in ((dynamic, 0), (static, 4)):
        by_path = {t.path: t.bytes_per_chip for t in tensor_bytes(config, plan)}
        assert by_path["layers/0/mlp/up_proj"] == want + extra


def test_a_bad_chip_count_names_chip_counts():
    with pytest.raises(ValueError) as err:
        tensor_bytes(tiny_config(), QuantPlan(), 3)  # 4 heads, 2 KV heads: 3 splits nothing
    assert str(err.value).endswith(": valid chip counts are 1, 2")


def test_unquantized_kv_is_stored_in_the_engines_dtype():
    # int8 keys per channel wait in a residual page of the store dtype: 16 tokens x 2 heads
    # x 8 dims per slot and layer = 256 values: 512 B in bfloat16, 1,024 B in float32.
    config = tiny_config()
    plan = QuantPlan(kv=KVPlan("int8"))
    for dtype, per_value in (("bfloat16", 2), ("float32", 4)):
        pool = kv_pool_bytes(config, plan, 0, 1, 16, store_dtype=dtype)
        assert pool["residual_bytes"] == 2 * 16 * 2 * 8 * per_value, dtype


def test_impossible_counts_are_refused():
    config = tiny_config()
    layers = kv_storage(config, QuantPlan(kv=KVPlan("int8", sink_tokens=4)), 16, 1)
    assert pool_bytes_from_layers(layers, 0, 0)["total_bytes"] == 0  # zero is allowed
    for pages, slots in ((-1, 0), (0, -1), ([1, -1], 0)):
        with pytest.raises(ValueError) as err:
            pool_bytes_from_layers(layers, pages, slots)
        assert str(err.value) == "page and slot counts must not be negative"
    for context in (0, -5, "8", 8.0):
        with pytest.raises(ValueError) as err:
            tenant_pages(config, context, 16)
        assert str(err.value) == f"context must be a positive number of tokens, got {context!r}"
    assert tenant_pages(config, 1, 16) == (1, 1)  # one token still takes a page per layer
