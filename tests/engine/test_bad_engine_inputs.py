"""Bad engine inputs: each is one ValueError line naming the field and what would be right.

A token id the model would clamp (>= vocab) or wrap (< 0) silently corrupts every quality
figure measured with it, so ids are checked on the host at every entry point.
"""

from __future__ import annotations

import numpy as np
import pytest

from tenantq.engine import Engine, PagedPool

VOCAB = 64  # tenantq.testing.tiny_config


@pytest.fixture(scope="module")
def engine(config, params):
    return Engine(config, params, max_seqs=2, max_seq_tokens=32)


def _prefill_then_decode(tokens):
    def call(e):
        batch, _ = e.prefill([[1, 2], [3, 4]], reserve_tokens=2)
        try:
            e.decode(batch, tokens)
        finally:
            e.release(batch)

    return call


# (case, call, fragments the message must hold: the field, the value, what is allowed)
ENGINE_CALLS = [
    ("id = vocab", lambda e: e.logits([[1, 2, VOCAB]]),
     ["token_ids: row 0, position 2", f"id {VOCAB}", "0..63", "vocab_size=64"]),
    ("id -1", lambda e: e.logits([[1], [5, -1]]), ["row 1, position 1", "id -1", "0..63"]),
    ("id 2**40", lambda e: e.logits([[2**40]]), ["position 0", f"id {2**40}", "0..63"]),
    ("float id", lambda e: e.logits([[1, 2.0]]), ["position 1", "2.0", "not a token id"]),
    ("float id, flat", lambda e: e.logits([1, 2.0]), ["row 0, position 1", "2.0", "0..63"]),
    ("float array", lambda e: e.logits(np.ones((1, 3))), ["float64", "integers in 0..63"]),
    ("3-d array", lambda e: e.logits(np.ones((1, 2, 3), int)), ["[batch, seq]", "(1, 2, 3)"]),
    ("string", lambda e: e.logits("hello"), ["token_ids", "list of token-id lists", "str"]),
    ("empty batch", lambda e: e.logits([]), ["token_ids", "at least one sequence"]),
    ("empty row", lambda e: e.logits([[1], []]), ["row 1 is empty"]),
    ("bool id", lambda e: e.logits([[True, 2]]), ["position 0", "True", "not a token id"]),
    ("score prompt id", lambda e: e.score([[1, 99]], [[2]]), ["prompts: row 0, position 1",
                                                             "id 99", "vocab_size=64"]),
    ("score continuation id", lambda e: e.score([[1]], [[2, -3]]),
     ["continuations: row 0, position 1", "id -3"]),
    ("score count", lambda e: e.score([[1], [2]], [[3]]), ["2 prompts but 1 continuations"]),
    ("generate prompt id", lambda e: e.generate([[1, 64]], 2), ["prompts: row 0, position 1"]),
    ("max_new_tokens negative", lambda e: e.generate([[1]], -1),
     ["max_new_tokens", "-1", "whole number >= 0"]),
    ("max_new_tokens float", lambda e: e.generate([[1]], 2.5), ["max_new_tokens", "2.5"]),
    ("stop_tokens int", lambda e: e.generate([[1]], 2, stop_tokens=2),
     ["stop_tokens", "list of token ids", "[2]"]),
    ("stop_tokens id", lambda e: e.generate([[1]], 2, stop_tokens=[70]),
     ["stop_tokens: row 0, position 0", "id 70"]),
    ("prefill id", lambda e: e.prefill([[0, 1000]]), ["prompts: row 0, position 1", "id 1000"]),
    ("reserve_tokens", lambda e: e.prefill([[1]], reserve_tokens=-2), ["reserve_tokens", "-2"]),
    ("decode id", _prefill_then_decode([3, 64]), ["tokens: row 0, position 1", "id 64"]),
    ("decode count", _prefill_then_decode([3]), ["tokens: 1 ids for 2 sequences"]),
    ("tenant pages fractional", lambda e: e.add_tenant("t", 2.5),
     ["guaranteed_pages", "2.5", "whole number"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "call", "fragments"), ENGINE_CALLS, ids=[c[0] for c in ENGINE_CALLS]
)
def test_bad_engine_call_is_one_named_line(engine, case, call, fragments) -> None:
    with pytest.raises(ValueError) as err:
        call(engine)
    message = str(err.value)
    assert "\n" not in message, case
    for fragment in fragments:
        assert fragment in message, (case, fragment, message)
    assert engine.cache.free_pages == engine.cache.num_pages  # nothing left half-allocated


def test_a_flat_id_list_is_one_sequence(engine) -> None:
    np.testing.assert_array_equal(engine.logits([5, 9, 3]), engine.logits([[5, 9, 3]]))
    np.testing.assert_array_equal(engine.logits(np.array([5, 9, 3])), engine.logits([[5, 9, 3]]))


# (case, Engine/PagedPool keyword arguments, fragments of the message)
CONSTRUCTION = [
    ("dtype typo", dict(dtype="bfloat61"), ["dtype 'bfloat61'", "valid: bfloat16, float32"]),
    ("dtype int8", dict(dtype="int8"), ["dtype 'int8'", "valid: bfloat16, float32", "plan"]),
    ("dtype float64", dict(dtype="float64"), ["dtype 'float64'", "valid: bfloat16, float32",
                                              "x64"]),
    ("pool_bytes string", dict(pool_bytes="2GiB"), ["pool_bytes", "'2GiB'", "parse_bytes"]),
    ("pool_bytes too small", dict(pool_bytes=100), ["100 bytes", "one page in every layer"]),
    ("num_pages and pool_bytes", dict(num_pages=4, pool_bytes=10**6), ["num_pages or pool_bytes"]),
    ("num_pages zero", dict(num_pages=0), ["num_pages must be a positive integer, got 0"]),
    ("max_seqs float", dict(max_seqs=2.0), ["max_seqs must be a positive integer, got 2.0"]),
    ("page_tokens zero", dict(page_tokens=0), ["page_tokens must be a positive integer"]),
    ("max_seq_tokens too long", dict(max_seq_tokens=10**6),
     ["max_seq_tokens=1000000", "context (128 tokens)"]),
    ("scale_scope", dict(scale_scope="tensor"), ["scale_scope='tensor'", "global, shard"]),
    ("tp zero", dict(tp=0), ["tp must be a positive integer, got 0"]),
    ("tp three", dict(tp=3), ["tensor-parallel degree 3", "valid tp values are 1, 2"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "kwargs", "fragments"), CONSTRUCTION, ids=[c[0] for c in CONSTRUCTION]
)
def test_bad_engine_construction_is_one_named_line(config, params, case, kwargs, fragments):
    with pytest.raises(ValueError) as err:
        Engine(config, params, **kwargs)
    message = str(err.value)
    assert "\n" not in message, case
    for fragment in fragments:
        assert fragment in message, (case, fragment, message)


def test_pool_refuses_bad_sizes_directly(config) -> None:
    with pytest.raises(ValueError, match="pool_bytes must be a whole number of bytes"):
        PagedPool(config, pool_bytes=1e6)
