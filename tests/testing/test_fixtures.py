"""The shared fixtures of `tenantq.testing` are what the tests assume they are."""

from __future__ import annotations

from tenantq.engine import Engine
from tenantq.testing import EOS_ID, odd_config, tiny_config, tiny_params, tiny_tokenizer


def test_tiny_tokenizer_round_trips_text_within_the_tiny_vocabulary() -> None:
    tok, config = tiny_tokenizer(), tiny_config()
    text = "def f(x):\n    return [x, 42]  # ok!"
    ids = tok.encode(text)
    assert len(ids) == len(text)  # one id per character
    assert tok.decode(ids) == text
    # Every id the tokenizer can produce is a row of the tiny embedding (vocab 64).
    assert tok.vocab_size == config.vocab_size == 64
    assert max(ids) < config.vocab_size and EOS_ID in config.eos_token_ids


def test_an_engine_runs_text_through_the_tiny_model(config, params, tokenizer) -> None:
    engine = Engine(config, params, tokenizer=tokenizer, max_seqs=1, max_seq_tokens=32)
    out = engine.generate([engine.encode("abc")], 3, stop_tokens=())
    assert len(out[0]) == 3 and all(0 <= t < config.vocab_size for t in out[0])
    assert isinstance(engine.decode_text(out[0]), str)


def test_configs_keep_their_documented_shapes() -> None:
    assert (tiny_config().num_layers, tiny_config().num_kv_heads, tiny_config().head_dim) == (
        2, 2, 8,
    )  # fmt: skip
    odd = odd_config()
    assert (odd.vocab_size, odd.hidden_size, odd.intermediate_size) == (11, 8, 13)
    assert set(tiny_params(odd)) == set(odd.tensors())
