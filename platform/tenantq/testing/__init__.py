"""Tiny models and a tiny tokenizer that every test (and the benches' smoke runs) share.

Shapes are small enough to compile in about a second. `tiny_config` is the engine's
2-layer Llama; `odd_config` has odd sizes on purpose (packing pads a nibble, groups and
MX/nvfp4 blocks run partial) for byte-count tests; `tiny_tokenizer` is a character-level
tokenizer whose ids fit `tiny_config`'s vocabulary. After gemma's `gm/testing`.
"""

from __future__ import annotations

from typing import Any

from tenantq.model.config import ModelConfig

# Special ids of `tiny_tokenizer`, matching `tiny_config`'s eos.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_CHARACTERS = " abcdefghijklmnopqrstuvwxyz0123456789.,:;!?'\"()[]{}-+*/=<>_#\n"


def tiny_config(**overrides: Any) -> ModelConfig:
    """2 layers, width 32, 4 query heads sharing 2 KV heads of 8, vocabulary 64, context 128."""
    fields: dict[str, Any] = dict(
        model_type="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        bos_token_id=BOS_ID,
        eos_token_ids=(EOS_ID,),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def odd_config(**overrides: Any) -> ModelConfig:
    """A 2-layer Llama-shaped config with odd sizes (vocab 11, width 8, MLP 13, head_dim 4)."""
    odd = dict(vocab_size=11, hidden_size=8, intermediate_size=13, num_heads=2, num_kv_heads=1,
               head_dim=4, max_position_embeddings=256)  # fmt: skip
    return tiny_config(**{**odd, **overrides})


def tiny_params(config: ModelConfig | None = None, seed: int = 0) -> dict[str, Any]:
    """Random float32 params of `config` (default `tiny_config()`), keyed by tensor path."""
    from tenantq.model.decoder import init_params

    return init_params(config or tiny_config(), seed=seed)


def tiny_tokenizer():
    """A character-level `Tokenizer`: ids 0-2 are <pad>, <s>, </s>; then one id per
    character of lowercase text: 64 ids, exactly `tiny_config`'s vocabulary."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from tenantq.model.tokenizer import Tokenizer

    vocab = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID}
    vocab.update({c: i + 3 for i, c in enumerate(_CHARACTERS)})
    inner = HFTokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    inner.decoder = decoders.Fuse()
    inner.add_special_tokens(["<pad>", "<s>", "</s>"])
    return Tokenizer(inner, source="tenantq.testing.tiny_tokenizer")
