"""Passkey needles: a random value hidden at a chosen depth of real source text, asked back.

The needle line `PASSKEY_<NAME> = 48213` goes into a haystack of real stdlib tokens; the
prompt ends by repeating the line's prefix `PASSKEY_<NAME> = ` after a `# recall` comment,
so the answer is exactly the five digits (one token each, see tokenizer_train). This is the
public generator both the trainer and the quality suite's needle grid use; it takes a raw
`tokenizers.Tokenizer` or the engine's tokenizer wrapper (`tenantq.model.tokenizer`).

Harder variants in the manner of RULER (Hsieh et al. 2024, arXiv:2404.06654), which stress
attention precision: `multikey` (distractor needles whose names differ from the asked one by
one letter), `multivalue` (one name written several times; every value asked back, in order)
and `vartrack` (`PASSKEY_B = PASSKEY_A` later in the text; asking B needs A's value copied).

Stop rule: generate greedily exactly `len(answer_ids)` tokens; the needle is retrieved when
they equal `answer_ids` (`needle_correct`). Chance is 1e-5 (five uniform digits).

The grid (`needle_grid`: lengths x depths spread evenly over 0-100%, one seeded generator per
length) is drawn here once, for the model card (`reference.evaluate`) and the quality suite
(`evals.needle_grid`).
"""

from __future__ import annotations

import string
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

NAME_LETTERS = 4
VALUE_DIGITS = 5
QUERY_HEADER = "\n# recall\n"
VARIANTS = ("single", "multikey", "multivalue", "vartrack")


def needle_text(name: str, value: int) -> str:
    return f"PASSKEY_{name} = {value}\n"


def query_text(name: str) -> str:
    return f"PASSKEY_{name} = "


def random_name(rng: np.random.Generator) -> str:
    return "".join(rng.choice(list(string.ascii_uppercase), NAME_LETTERS))


def random_value(rng: np.random.Generator) -> int:
    return int(rng.integers(10 ** (VALUE_DIGITS - 1), 10**VALUE_DIGITS))


class _Codec:
    """The four tokenizer calls needles need, over a raw `tokenizers.Tokenizer` or the
    engine's wrapper (which has `encode(text) -> list[int]` and `token_id`)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._raw = hasattr(tokenizer, "token_to_id")
        if not self._raw and not hasattr(tokenizer, "token_id"):
            raise TypeError(
                f"needles need a tokenizers.Tokenizer or tenantq's tokenizer wrapper, "
                f"got {type(tokenizer).__name__}"
            )

    def ids(self, text: str) -> list[int]:
        out = self.tokenizer.encode(text)
        return list(out.ids) if self._raw else list(out)

    def token_id(self, token: str) -> int:
        tid = (self.tokenizer.token_to_id if self._raw else self.tokenizer.token_id)(token)
        if tid is None:
            raise ValueError(f"the tokenizer has no {token!r} token; needles need a BOS token")
        return int(tid)

    def vocab_size(self) -> int:
        t = self.tokenizer
        return t.get_vocab_size() if self._raw else t.vocab_size

    def decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token])


_NEWLINE_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _newline_token_mask(tokenizer: Any) -> np.ndarray:
    """mask[id] is True where token `id` ends a line (its text ends in newline + indent)."""
    cached = _NEWLINE_MASKS.get(tokenizer)
    if cached is not None:
        return cached
    codec = _Codec(tokenizer)
    mask = np.zeros(codec.vocab_size(), bool)
    for i in range(codec.vocab_size()):
        text = codec.decode_one(i)
        mask[i] = "\n" in text and text.rstrip(" \t").endswith("\n")
    _NEWLINE_MASKS[tokenizer] = mask
    return mask


@dataclass(frozen=True)
class NeedleExample:
    """One prompt of exactly `length_tokens` tokens (BOS first) and the ids to generate."""

    variant: str
    prompt_ids: np.ndarray  # int32
    answer_ids: np.ndarray  # int32
    depth_fraction: float


def _line_start(tokenizer, hay: np.ndarray, cut: int) -> int:
    """`cut` moved forward to the next line start when one is within 32 tokens."""
    hay_len = len(hay)
    if 0 < cut < hay_len:
        ends_line = _newline_token_mask(tokenizer)[hay[cut - 1 : min(hay_len, cut + 31)]]
        if ends_line.any():
            cut = cut + int(np.argmax(ends_line))
    return cut


def _assemble(
    tokenizer,
    codec: _Codec,
    haystack_source: np.ndarray,
    length_tokens: int,
    inserts: list[tuple[float, list[int]]],
    query: list[int],
    rng: np.random.Generator,
) -> np.ndarray:
    """BOS + a random haystack window with each (depth, ids) insert at its depth + query."""
    bos = codec.token_id("<|bos|>")
    hay_len = length_tokens - 1 - sum(len(ids) for _, ids in inserts) - len(query)
    if hay_len < 0:
        raise ValueError(f"length_tokens={length_tokens} is too short for a needle")
    if hay_len > len(haystack_source):
        raise ValueError(f"haystack source has {len(haystack_source)} tokens, need {hay_len}")
    start = int(rng.integers(0, len(haystack_source) - hay_len + 1))
    hay = np.asarray(haystack_source[start : start + hay_len])
    cuts = [_line_start(tokenizer, hay, int(round(d * hay_len))) for d, _ in inserts]
    # Stable by depth: inserts at one cut keep their given order (a definition before its use).
    order = sorted(range(len(inserts)), key=lambda i: cuts[i])
    pieces: list[Any] = [[bos]]
    prev = 0
    for i in order:
        pieces += [hay[prev : cuts[i]], inserts[i][1]]
        prev = cuts[i]
    pieces += [hay[prev:], query]
    prompt = np.concatenate([np.asarray(p, np.int64) for p in pieces]).astype(np.int32)
    assert len(prompt) == length_tokens
    return prompt


def make_needle_example(
    tokenizer: Any,
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
    ex = make_example(tokenizer, haystack_source, length_tokens, depth_fraction, rng)
    return ex.prompt_ids, ex.answer_ids


def make_example(
    tokenizer: Any,
    haystack_source: np.ndarray,
    length_tokens: int,
    depth_fraction: float,
    rng: np.random.Generator,
    variant: str = "single",
    *,
    count: int = 4,
) -> NeedleExample:
    """A needle prompt of `variant` (see the module docstring) with the asked needle at
    `depth_fraction`. `count`: distractors + 1 for `multikey`, values for `multivalue`.

    multikey: `count - 1` distractor lines at random depths, each name one letter away from
    the asked name (never equal to it or to each other). multivalue: the asked name written
    `count` times at depths spread from `depth_fraction`, answer `v1\\nPASSKEY_N = v2...` in
    text order. vartrack: `PASSKEY_A = v` at `depth_fraction`, `PASSKEY_B = PASSKEY_A` at a
    random later depth; the query asks B.
    """
    if not 0.0 <= depth_fraction <= 1.0:
        raise ValueError(f"depth_fraction must be in [0, 1], got {depth_fraction}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown needle variant {variant!r}; valid: {', '.join(VARIANTS)}")
    if variant != "single" and count < 2:
        raise ValueError(f"variant {variant!r} needs count >= 2, got {count}")
    codec = _Codec(tokenizer)
    name, value = random_name(rng), random_value(rng)
    header = codec.ids(QUERY_HEADER)
    if variant == "single":
        inserts = [(depth_fraction, codec.ids(needle_text(name, value)))]
        query, answer = header + codec.ids(query_text(name)), codec.ids(str(value))
    elif variant == "multikey":
        inserts = [(depth_fraction, codec.ids(needle_text(name, value)))]
        used = {name}
        while len(used) < count:
            pos = int(rng.integers(NAME_LETTERS))
            letter = string.ascii_uppercase[int(rng.integers(26))]
            other = name[:pos] + letter + name[pos + 1 :]
            if other in used:
                continue
            used.add(other)
            line = codec.ids(needle_text(other, random_value(rng)))
            inserts.append((float(rng.random()), line))
        query, answer = header + codec.ids(query_text(name)), codec.ids(str(value))
    elif variant == "multivalue":
        values = [value] + [random_value(rng) for _ in range(count - 1)]
        depths = sorted([depth_fraction] + [float(d) for d in rng.random(count - 1)])
        pairs = zip(depths, values, strict=True)
        inserts = [(d, codec.ids(needle_text(name, v))) for d, v in pairs]
        query = header + codec.ids(query_text(name))
        answer = codec.ids(str(values[0]))
        for v in values[1:]:
            answer += codec.ids("\n" + query_text(name)) + codec.ids(str(v))
    else:  # vartrack
        alias = random_name(rng)
        while alias == name:
            alias = random_name(rng)
        later = depth_fraction + (1.0 - depth_fraction) * float(rng.random())
        inserts = [
            (depth_fraction, codec.ids(needle_text(name, value))),
            (later, codec.ids(f"PASSKEY_{alias} = PASSKEY_{name}\n")),
        ]
        query, answer = header + codec.ids(query_text(alias)), codec.ids(str(value))
    prompt = _assemble(tokenizer, codec, haystack_source, length_tokens, inserts, query, rng)
    return NeedleExample(variant, prompt, np.asarray(answer, np.int32), float(depth_fraction))


@dataclass(frozen=True)
class GridCell:
    """One cell of a needle grid: its prompt length, its index among the length's depths."""

    length: int
    index: int
    example: NeedleExample


def needle_grid(
    tokenizer: Any,
    haystack_source: np.ndarray,
    lengths: Sequence[int],
    per_length: int,
    seed: Sequence[int],
    variant: str = "single",
    *,
    count: int = 4,
) -> Iterator[GridCell]:
    """`per_length` examples per length at depths `linspace(0, 1, per_length)`, drawn in that
    order from one generator per length seeded `[*seed, length]` (so a length's cells do not
    depend on which other lengths are asked for)."""
    for length in lengths:
        rng = np.random.default_rng([*seed, length])
        for index, depth in enumerate(np.linspace(0.0, 1.0, per_length)):
            ex = make_example(
                tokenizer, haystack_source, length, float(depth), rng, variant, count=count
            )
            yield GridCell(length, index, ex)


def needle_correct(generated_ids: np.ndarray, answer_ids: np.ndarray) -> bool:
    """The stop rule: the first `len(answer_ids)` generated tokens equal the answer."""
    generated = np.asarray(generated_ids)[: len(answer_ids)]
    return len(generated) == len(answer_ids) and bool(np.all(generated == answer_ids))
