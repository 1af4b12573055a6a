"""Byte-level BPE tokenizer for the reference model, trained on the corpus train split.

Digits are split one per token before BPE so that a passkey (and any number) is spelled
digit by digit: copying it back is then a clean per-token induction task, and exact-match
scoring does not depend on how BPE happened to merge digit runs.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 2048
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int]:
    return {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}
