"""The needle grid without an engine: which cells are built, how they are run, how scored.

A character tokenizer (one token per character, BOS 1) builds real needle prompts from
`tenantq.reference.needles`; `run_needles`' two paths (teacher-forced prefill, greedy
decoding) are recorded by stand-ins, so each test runs in milliseconds. The reference for
every cell is `needles.make_example` called with the seeded generator the grid documents.
"""

from __future__ import annotations

import numpy as np
import pytest

from tenantq.evals import needle_grid
from tenantq.evals.generation import Generated
from tenantq.evals.suite import NeedleSpec
from tenantq.reference import needles


class _CharTokenizer:
    """One token per character (ids are code points below 128); `<|bos|>` is id 1."""

    vocab_size = 128

    def token_id(self, token: str) -> int | None:
        return 1 if token == "<|bos|>" else None

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(int(i)) for i in ids)


def _stream(tok: _CharTokenizer) -> np.ndarray:
    text = "".join(f"value_{i} = compute(value_{i - 1}, {i})\n" for i in range(1, 60))
    return np.asarray(tok.encode(text), np.int32)


def test_every_cell_is_the_seeded_needle_of_its_length_and_depth() -> None:
    tok, stream = _CharTokenizer(), _stream(_CharTokenizer())
    spec = NeedleSpec(variant="multikey", lengths=(96, 128), per_length=3, count=3)
    items = needle_grid.build_needles(tok, stream, spec, seed=7)
    # lengths in the spec's order, depths 0, 0.5, 1 (evenly over 0-100%) within each length
    assert [(i.length, i.depth) for i in items] == [
        (96, 0.0), (96, 0.5), (96, 1.0), (128, 0.0), (128, 0.5), (128, 1.0)
    ]  # fmt: skip
    assert [i.example_id for i in items] == [
        f"needle_multikey/len{n}/{k}" for n in (96, 128) for k in range(3)
    ]
    assert {i.task for i in items} == {"needle_multikey"}
    for length in (96, 128):
        # one generator per (seed, variant, length), drawn in depth order
        rng = np.random.default_rng([7, needles.VARIANTS.index("multikey"), length])
        for item, depth in zip([i for i in items if i.length == length], (0.0, 0.5, 1.0),
                               strict=True):  # fmt: skip
            ex = needles.make_example(tok, stream, length, depth, rng, "multikey", count=3)
            assert item.prompt == ex.prompt_ids.tolist() and len(item.prompt) == length
            assert isinstance(item.prompt, list)
            np.testing.assert_array_equal(item.answer, ex.answer_ids)
            # multikey with count 3: two distractor lines, each a PASSKEY_ line of its own
            assert tok.decode(item.prompt).count("PASSKEY_") == 3 + 1  # + the query


def test_another_seed_or_variant_draws_other_needles() -> None:
    tok, stream = _CharTokenizer(), _stream(_CharTokenizer())
    spec = NeedleSpec(variant="single", lengths=(96,), per_length=2)
    a = needle_grid.build_needles(tok, stream, spec, seed=0)
    assert [i.prompt for i in a] == [
        i.prompt for i in needle_grid.build_needles(tok, stream, spec, 0)
    ]
    b = needle_grid.build_needles(tok, stream, spec, seed=1)
    assert [i.prompt for i in a] != [i.prompt for i in b]
    # the single variant's generator is [seed, 0, length]: its first needle is this one
    rng = np.random.default_rng([0, 0, 96])
    ex = needles.make_example(tok, stream, 96, 0.0, rng, "single", count=4)
    assert a[0].prompt == ex.prompt_ids.tolist() and a[0].task == "needle"
    assert tok.decode(a[0].prompt).count("PASSKEY_") == 2  # the needle and the query


def _item(length: int, answer: list[int], name: str) -> needle_grid.NeedleItem:
    return needle_grid.NeedleItem(
        "needle", name, length, 0.0, [1] * (length - 3), np.asarray(answer)
    )


class _Engine:
    """`teacher_forcing_exact` by a rule on the prompt's length; records what asked it."""

    def __init__(self, exact_below: int):
        self.exact_below = exact_below
        self.asked: list[tuple[int, int, int | None]] = []

    def teacher_forcing_exact(self, prompt_tokens, answer_tokens, chunk_tokens=None) -> bool:
        self.asked.append((prompt_tokens, answer_tokens, chunk_tokens))
        return prompt_tokens < self.exact_below


@pytest.fixture
def recorded(monkeypatch):
    """The two generation paths replaced by recorders whose records name their path."""
    calls: list[tuple] = []

    def forced(engine, prompts, answers, *, chunk_tokens=None, kv_tokens=None):
        assert isinstance(engine, _Engine)  # the engine the needles run on
        calls.append(("forced", [len(p) for p in prompts], answers, chunk_tokens, kv_tokens))
        return [
            Generated(list(a), [float(len(p))] * len(a))
            for p, a in zip(prompts, answers, strict=True)
        ]

    def greedy(engine, prompts, max_new_tokens, stop_tokens=frozenset()):
        assert isinstance(engine, _Engine)
        calls.append(("greedy", [len(p) for p in prompts], max_new_tokens, stop_tokens))
        return [Generated([-1] * max_new_tokens, [-float(len(p))]) for p in prompts]

    monkeypatch.setattr(needle_grid, "teacher_forced_with_margins", forced)
    monkeypatch.setattr(needle_grid, "generate_with_margins", greedy)
    return calls


def test_needles_are_forced_where_exact_and_decoded_elsewhere_in_their_order(recorded) -> None:
    items = [
        _item(200, [5, 6, 7], "a"),  # forced (prompt 197 < 300)
        _item(400, [8, 9, 10], "b"),  # decoded (prompt 397)
        _item(64, [3, 4], "c"),  # forced, another answer length: its own batch
        _item(200, [11, 12, 13], "d"),  # joins a's batch
        _item(64, [2, 2, 2], "e"),  # forced: length 64, three answer tokens
    ]
    engine = _Engine(exact_below=300)
    out = needle_grid.run_needles(engine, items, chunk_tokens=32, kv_tokens=512)
    # each needle asked once, with its own prompt and answer lengths and the step width
    assert engine.asked == [(197, 3, 32), (397, 3, 32), (61, 2, 32), (197, 3, 32), (61, 3, 32)]
    # batches in (length, answer tokens, forced) order; each forced batch sees the step shape
    assert recorded == [
        ("forced", [61], [[3, 4]], 32, 512),
        ("forced", [61], [[2, 2, 2]], 32, 512),
        ("forced", [197, 197], [[5, 6, 7], [11, 12, 13]], 32, 512),
        ("greedy", [397], 3, frozenset()),
    ]
    # records come back in the items' order, each from its own path
    assert [g.tokens for g in out] == [[5, 6, 7], [-1, -1, -1], [3, 4], [11, 12, 13], [2, 2, 2]]
    assert [g.margins[0] for g in out] == [197.0, -397.0, 61.0, 197.0, 61.0]


def test_without_teacher_forcing_every_needle_decodes_its_answer_length(recorded) -> None:
    items = [_item(64, [3, 4], "c"), _item(64, [1, 2, 3, 4, 5], "f"), _item(96, [7, 8], "g")]
    engine = _Engine(exact_below=10**6)
    out = needle_grid.run_needles(engine, items, teacher_forced=False)
    assert [c[0] for c in recorded] == ["greedy"] * 3
    # one batch per (length, answer tokens), each decoding exactly its answer's length
    assert [(c[1], c[2]) for c in recorded] == [([61], 2), ([61], 5), ([93], 2)]
    assert [len(g.tokens) for g in out] == [2, 5, 2]


def test_the_default_is_teacher_forced_with_the_engines_own_step() -> None:
    class Engine(_Engine):
        def continuation_logits(self, prompts, answers, *, chunk_tokens=None, kv_tokens=None):
            self.shape = (chunk_tokens, kv_tokens)
            # logits whose argmax is the answer at every step: the needle passes
            return [np.eye(16)[answer] * 5.0 for answer in answers]

    engine = Engine(exact_below=10**6)
    items = [_item(64, [3, 4, 5], "a")]
    (g,) = needle_grid.run_needles(engine, items)
    assert engine.asked == [(61, 3, None)] and engine.shape == (None, None)
    assert g.tokens == [3, 4, 5] and g.margins == [5.0, 5.0, 5.0]
    assert needle_grid.score(items[0], g)


def test_a_needle_passes_only_when_its_first_answer_tokens_all_match() -> None:
    item = _item(64, [4, 8, 2, 1, 3], "a")
    assert needle_grid.score(item, Generated([4, 8, 2, 1, 3], []))
    assert needle_grid.score(item, Generated([4, 8, 2, 1, 3, 9], []))  # more tokens: the first 5
    assert not needle_grid.score(item, Generated([4, 8, 2, 1], []))  # stopped one short
    assert not needle_grid.score(item, Generated([4, 8, 2, 1, 7], []))  # last digit wrong
    assert not needle_grid.score(item, Generated([0, 8, 2, 1, 3], []))  # first digit wrong
    assert not needle_grid.score(item, Generated([], []))


def test_a_path_returning_fewer_records_than_needles_is_an_error(monkeypatch) -> None:
    # a lost record would leave a needle without an answer (None), scored as nothing
    def short(engine, prompts, max_new_tokens, stop_tokens=frozenset()):
        return [Generated([0] * max_new_tokens, [])] * (len(prompts) - 1)

    monkeypatch.setattr(needle_grid, "generate_with_margins", short)
    items = [_item(64, [3, 4], "a"), _item(64, [5, 6], "b")]
    with pytest.raises(ValueError, match="zip"):
        needle_grid.run_needles(_Engine(exact_below=0), items)
