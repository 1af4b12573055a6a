"""Passkey needles: a random value hidden at a chosen depth of real source text, asked back.

The needle line `PASSKEY_<NAME> = 48213` goes into a haystack of real stdlib tokens; the
prompt ends by repeating the line's prefix `PASSKEY_<NAME> = ` after a `# recall` comment,
so the answer is exactly the five digits (one token each, see tokenizer_train). This is the
public generator both the trainer and the quality suite's needle grid use.

Stop rule: generate greedily exactly `len(answer_ids)` tokens; the needle is retrieved when
they equal `answer_ids` (`needle_correct`). Chance is 1e-5 (five uniform digits).
"""

from __future__ import annotations

import string
import weakref

import numpy as np
from tokenizers import Tokenizer

NAME_LETTERS = 4
VALUE_DIGITS = 5
QUERY_HEADER = "\n# recall\n"


def needle_text(name: str, value: int) -> str:
    return f"PASSKEY_{name} = {value}\n"


def query_text(name: str) -> str:
    return f"PASSKEY_{name} = "


def random_name(rng: np.random.Generator) -> str:
    return "".join(rng.choice(list(string.ascii_uppercase), NAME_LETTERS))


def random_value(rng: np.random.Generator) -> int:
    return int(rng.integers(10 ** (VALUE_DIGITS - 1), 10**VALUE_DIGITS))


_NEWLINE_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _newline_token_mask(tokenizer: Tokenizer) -> np.ndarray:
    """mask[id] is True where token `id` ends a line (its text ends in newline + indent)."""
    cached = _NEWLINE_MASKS.get(tokenizer)
    if cached is not None:
        return cached
    mask = np.zeros(tokenizer.get_vocab_size(), bool)
    for i in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([i])
        mask[i] = "\n" in text and text.rstrip(" \t").endswith("\n")
    _NEWLINE_MASKS[tokenizer] = mask
    return mask


def make_needle_example(
    tokenizer: Tokenizer,
    haystack_source: np.ndarray,
    length_tokens: int,
    depth_fraction: float,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """One passkey prompt of exactly `length_tokens` tokens and its answer.

    `haystack_source` is a 1-D array of token ids (a tokenized corpus split, documents
    concatenated); a random window of it is the haystack. The needle line is inserted at
    `depth_fraction` (0 = right after BOS, 1 = right before the query) of the haystack,
    moved forward to the next line start when one is within 32 tokens. Returns
    `(prompt_ids, answer_ids)`, int32; the prompt starts with BOS.
    """
    if not 0.0 <= depth_fraction <= 1.0:
        raise ValueError(f"depth_fraction must be in [0, 1], got {depth_fraction}")
    name, value = random_name(rng), random_value(rng)
    bos = tokenizer.token_to_id("<|bos|>")
    needle = tokenizer.encode(needle_text(name, value)).ids
    query = tokenizer.encode(QUERY_HEADER).ids + tokenizer.encode(query_text(name)).ids
    answer = tokenizer.encode(str(value)).ids
    hay_len = length_tokens - 1 - len(needle) - len(query)
    if hay_len < 0:
        raise ValueError(f"length_tokens={length_tokens} is too short for a needle")
    if hay_len > len(haystack_source):
        raise ValueError(f"haystack source has {len(haystack_source)} tokens, need {hay_len}")
    start = int(rng.integers(0, len(haystack_source) - hay_len + 1))
    hay = np.asarray(haystack_source[start : start + hay_len])
    cut = int(round(depth_fraction * hay_len))
    if 0 < cut < hay_len:
        ends_line = _newline_token_mask(tokenizer)[hay[cut - 1 : min(hay_len, cut + 31)]]
        if ends_line.any():
            cut = cut + int(np.argmax(ends_line))
    prompt = np.concatenate([[bos], hay[:cut], needle, hay[cut:], query]).astype(np.int32)
    assert len(prompt) == length_tokens
    return prompt, np.asarray(answer, np.int32)


def needle_correct(generated_ids: np.ndarray, answer_ids: np.ndarray) -> bool:
    """The stop rule: the first `len(answer_ids)` generated tokens equal the answer."""
    generated = np.asarray(generated_ids)[: len(answer_ids)]
    return len(generated) == len(answer_ids) and bool(np.all(generated == answer_ids))
