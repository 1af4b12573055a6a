"""Text <-> token ids for a checkpoint folder, through the `tokenizers` library.

Only `tokenizer.json` is read (the fast-tokenizer file every Llama-family checkpoint
ships). It is optional: a folder without it, or with one the library cannot read, still
loads and runs on token ids (an unreadable file is a warning naming it), and whatever
needs text asks for the tokenizer and gets a clear error there. `token_stream` is the one
way text becomes a stream of ids (EOS after each document, as the trainer saw it).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    """`encode(text) -> ids` and `decode(ids) -> text` for one checkpoint."""

    def __init__(self, inner: _HFTokenizer, *, source: str = ""):
        self._inner = inner
        self.source = source

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        return cls(_HFTokenizer.from_file(str(path)), source=str(path))

    @property
    def vocab_size(self) -> int:
        return self._inner.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._inner.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._inner.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self._inner.token_to_id(token)


def token_stream(tokenizer, docs: Sequence[str]) -> np.ndarray:
    """int32 ids of `docs` tokenized and concatenated with EOS after each, as the trainer saw
    text (no EOS where the vocabulary has none). `tokenizer`: a `Tokenizer` (or anything with
    `encode(text) -> ids` and `token_id`), or a `tokenizers.Tokenizer`, whose batch API the
    trainer's splits use."""
    if isinstance(tokenizer, _HFTokenizer):
        eos = tokenizer.token_to_id("<|eos|>")
        encoded = [e.ids for e in tokenizer.encode_batch(list(docs))]
    else:
        eos = tokenizer.token_id("<|eos|>")
        encoded = [tokenizer.encode(doc) for doc in docs]
    tail = [eos] if eos is not None else []
    parts = [np.asarray(list(ids) + tail, np.int32) for ids in encoded]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


class TokenizerUnreadableWarning(UserWarning):
    """A checkpoint's tokenizer.json exists but could not be read; the model loads without it."""


def load_tokenizer(folder: str | Path) -> Tokenizer | None:
    """The folder's `tokenizer.json`; None when it has none or it cannot be read (warns)."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return Tokenizer.from_file(path)
    except Exception as err:  # the tokenizers library raises bare Exception subclasses
        warnings.warn(
            f"{path}: the tokenizer could not be read ({err}); the model loads without one "
            "and runs on token ids only",
            TokenizerUnreadableWarning,
            stacklevel=2,
        )
        return None


def require_tokenizer(folder: str | Path, vocab_size: int | None = None) -> Tokenizer:
    """The folder's tokenizer, for work that needs text: one ValueError line when it is
    missing, unreadable (naming why) or has more tokens than the model's vocabulary
    (`vocab_size`: its ids would index past the embedding)."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no tokenizer.json; the quality suite needs text")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as err:  # the tokenizers library raises bare Exception subclasses
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"{path}: cannot be read as a tokenizer ({first}); give the tokenizer.json of "
            "this checkpoint (Hugging Face `tokenizers` format)"
        ) from None
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"{path}: {tokenizer.vocab_size} tokens, more than the model's vocab_size of "
            f"{vocab_size} (config.json); the tokenizer belongs to another model"
        )
    return tokenizer
