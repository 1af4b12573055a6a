"""Structured-output examples without a model: which lines are usable, where they are cut,
how prompts are built and completions read, and how each task's batch is generated.

A word tokenizer (identifiers, runs of spaces and single other characters are tokens)
gives real token boundaries inside a line, so the cut-at-a-token rule is exercised.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from tenantq.evals import structured
from tenantq.evals.generation import Generated
from tenantq.evals.suite import StructuredSpec

# "data_values" and "z)" are single tokens (as a BPE merges them); other identifiers split
# into pieces of up to three characters, so most cuts inside a name land on a boundary.
# A colon with trailing spaces at a line's end is one token too.
_TOKEN = re.compile(r"data_values|z\)|: +(?=\n|$)|[A-Za-z0-9_]{1,3}| +|\n +|.|\n", re.S)


class _WordTokenizer:
    """Tokens: `_TOKEN`'s pieces (a newline with its indentation is one)."""

    def __init__(self, texts: list[str]):
        words = sorted({t for text in texts for t in _TOKEN.findall(text)} | {"\n", "x"})
        self.vocab = ["<pad>", "<|bos|>", *words]
        self.ids = {w: i for i, w in enumerate(self.vocab)}
        self.vocab_size = len(self.vocab)

    def token_id(self, token: str) -> int | None:
        return self.ids.get(token)

    def encode(self, text: str) -> list[int]:
        return [self.ids[t] for t in _TOKEN.findall(text)]

    def decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] for i in ids)


def test_a_cut_moves_back_to_the_last_token_boundary() -> None:
    context, line = "a = 1\n", "result = compute(value"
    tok = _WordTokenizer([context + line])
    # 11 characters end inside "com|put|e": the cut falls back to the space before it
    ids, prefix = structured._cut_at_token(tok, context, line, 11)
    assert prefix == "result = "
    assert tok.decode(ids) == context + prefix
    # a cut on a boundary stays there
    ids, prefix = structured._cut_at_token(tok, context, line, 16)
    assert prefix == "result = compute" and tok.decode(ids) == context + prefix
    ids, prefix = structured._cut_at_token(tok, context, line, len(line))
    assert prefix == line and tok.decode(ids) == context + line
    ids, prefix = structured._cut_at_token(tok, context, line, 0)
    assert prefix == "" and tok.decode(ids) == context
    ids, prefix = structured._cut_at_token(tok, "", line, 2)  # inside the first token
    assert (ids, prefix) == ([], "")


@pytest.mark.parametrize(
    ("line", "prefix"),
    [
        ("    result = compute(value, other[1])", "    result = compute(value, other[1"),
        ("x = f(aaaaaaaa)", None),  # 15 characters: too short
        ("x = f(aaaaaaaaa)", "x = f(aaaaaaaaa"),  # 16: long enough
        ("    x = f(" + "a" * 93 + ")", "    x = f(" + "a" * 93),  # 100 stripped: kept
        ("x = f(" + "a" * 94 + ")", None),  # 101: too long
        ("# note(abcdefgh, ijk)", None),  # a comment
        ("@decorate(abcdefgh, ijk)", None),  # a decorator
        # a matrix product is no decorator, whatever its first name
        ("XX@XX_weights(rows, cols)", "XX@XX_weights(rows, cols"),
        ("value = compute(abc) + 1", None),  # does not end in a closer
        ("value = 12345  # see)", None),  # its closer is in a comment: nothing to close
        ("value = 12345  # See X)", None),
        ("value = [compute(abc)]  ", "value = [compute(abc"),  # trailing spaces ignored
        ("value = compute(abc, def)", None),  # ends in a closer but does not parse
        ("value = thing_one_two()", "value = thing_one_two("),
        ("()" + " " * 16 + "()", "()" + " " * 16 + "("),
        ("((((((((()))))))))", "((((((((("),  # only its closers are cut
        ("print_everything ()", "print_everything ("),
    ],
)
def test_close_line_cuts_keep_an_opener_and_drop_only_the_closers(line, prefix) -> None:
    assert structured._close_line_cut(line) == prefix


def test_close_line_needs_an_open_bracket_left_in_the_prefix() -> None:
    # a line ending in a closer whose prefix opens nothing cannot be asked to close
    assert structured._close_line_cut('text = "a" + "bcdefghijk)"') is None
    assert structured._close_line_cut("xs = {1: 2, 33: 44, 555: 6}") == "xs = {1: 2, 33: 44, 555: 6"


LINES = [
    "import os",
    "",
    "def load_config(path):",
    "    settings = read_settings(path)",
    "    return settings",
    "    handle = open(path)",
    "    value = handle.settings",
    "    return helper_fn(settings)",
]


def test_repeat_identifier_asks_a_name_assigned_just_before() -> None:
    # names of 6+ characters, not at column 0, not after a dot, seen in the 30 lines
    # before; one per line (its first); cut before the name's last character
    assert list(structured._candidates("repeat_identifier", LINES)) == [
        (4, "    return setting", "11:settings"),
        (6, "    value = handl", "12:handle"),  # handle.settings: the attribute is not asked
        (7, "    return helper_fn(setting", "21:settings"),
    ]
    far = ["    settings = 1", *[""] * 30, "    return settings"]
    assert list(structured._candidates("repeat_identifier", far)) == []  # 31 lines back
    near = ["    settings = 1", *[""] * 29, "    return settings"]
    assert list(structured._candidates("repeat_identifier", near)) == [
        (30, "    return setting", "11:settings")
    ]
    # a name ending the line it was seen on, or opening the next, is still seen
    ends = ["    x = settings", "helper_fn(y)", "    return settings"]
    assert list(structured._candidates("repeat_identifier", ends)) == [
        (2, "    return setting", "11:settings")
    ]
    kw = ["    nonlocal_value = 1", "    global_ = nonlocal_value"]
    assert list(structured._candidates("repeat_identifier", kw)) == [
        (1, "    global_ = nonlocal_valu", "14:nonlocal_value")
    ]
    attr = ["    helper = 1", "    x.helper = other.helper(helper)"]
    assert list(structured._candidates("repeat_identifier", attr)) == [
        (1, "    x.helper = other.helper(helpe", "28:helper")
    ]
    col0 = ["helper = 1", "helper = helper"]
    assert list(structured._candidates("repeat_identifier", col0)) == [
        (1, "helper = helpe", "9:helper")
    ]


def test_close_line_candidates_are_the_cuttable_lines() -> None:
    found = list(structured._candidates("close_line", LINES))
    assert found == [
        (3, "    settings = read_settings(path", ""),
        (5, "    handle = open(path", ""),
        (7, "    return helper_fn(settings", ""),
    ]
    assert list(structured._candidates("close_brackets", LINES)) == found


DOC = "\n".join(
    [
        "import os",
        "",
        "def load_config(path):",
        "    settings = read_settings(path)",
        "    handle = open_file(path)",
        "    if settings:",
        "        return settings",
        "    for item in handle:",
        "        keep(item)",
        "    values = compute_values(handle, settings)",
        "    return values_of(settings)",
        "",
        "class Holder:",
        "    def method(self):",
        "        return self.value",
    ]
)


def _spec(**kw) -> StructuredSpec:
    return StructuredSpec(**{"tasks": ("close_line",), "per_task": 2, "context_tokens": 16, **kw})


def test_items_are_seeded_draws_whose_prompts_end_at_the_cut() -> None:
    tok = _WordTokenizer([DOC])
    spec = _spec(tasks=("close_line", "indent_block", "repeat_identifier"), context_tokens=24)
    items = structured.build_items(tok, [DOC, DOC], spec, seed=5)
    assert [i.example_id for i in items] == [
        f"structured/{t}/{n}" for t in spec.tasks for n in range(2)
    ]
    assert [i.task_name for i in items] == [t for t in spec.tasks for _ in range(2)]
    lines = DOC.split("\n")
    for item in items:
        assert item.prompt[0] == tok.token_id("<|bos|>") and item.task == "structured"
        assert len(item.prompt) <= spec.context_tokens  # BOS + at most the last 23 tokens
        text = tok.decode(item.prompt[1:])
        # the prompt is the tail of the file up to the cut line's prefix
        (i,) = [
            k for k, line in enumerate(lines)
            if line.startswith(item.line_prefix)
            and ("\n".join(lines[:k]) + "\n" + item.line_prefix).endswith(text)
            and text.endswith("\n" + item.line_prefix)
        ]  # fmt: skip
        if item.task_name == "indent_block":
            assert item.line_prefix == lines[i] and item.expect == str(structured._indent(lines[i]))
        if item.task_name == "repeat_identifier":
            start, name = item.expect.split(":")
            assert len(item.line_prefix) > int(start)  # part of the name is in the prompt
            assert lines[i][int(start) :].startswith(name)
    # a cut with more before it than fits is BOS + exactly the last 23 tokens
    assert any(len(i.prompt) == spec.context_tokens for i in items)
    long = structured.build_items(tok, [DOC], _spec(context_tokens=200), seed=5)
    # a long context reaches back to the document's start (up to 200 lines)
    assert tok.decode(long[0].prompt[1:]).startswith("import os\n")
    assert items == structured.build_items(tok, [DOC, DOC], spec, seed=5)
    others = [structured.build_items(tok, [DOC, DOC], spec, seed=s) for s in range(6, 12)]
    assert any(o != items for o in others)  # another seed draws other lines


def test_a_cut_inside_a_token_is_skipped_where_the_task_needs_an_exact_cut() -> None:
    # "data_values" is one token: repeat_identifier's cut before its last character falls
    # back to the token's start, leaving nothing of the name to repeat: skipped
    doc = "    data_values = 1\n    return data_values\n    return data_values + 1"
    tok = _WordTokenizer([doc])
    with pytest.raises(ValueError, match="'repeat_identifier': the dataset half has 0 usable"):
        structured.build_items(tok, [doc], _spec(tasks=("repeat_identifier",)), seed=0)
    # close_brackets needs the cut exactly before the closers: inside the token "z)" it is not
    quoted = "    result = compute_all(x, g(z))\n    result = compute_all(x, y)"
    tok = _WordTokenizer([quoted])
    items = structured.build_items(tok, [quoted], _spec(tasks=("close_line",), per_task=2), 0)
    assert sorted(i.line_prefix for i in items) == [
        "    result = compute_all(x, g(", "    result = compute_all(x, y"
    ]  # fmt: skip
    spec = _spec(tasks=("close_brackets",), per_task=1)
    (only,) = structured.build_items(tok, [quoted], spec, seed=0)
    assert only.line_prefix == "    result = compute_all(x, y"
    with pytest.raises(ValueError, match="has 1 usable lines, the suite asks for 2"):
        structured.build_items(tok, [quoted], _spec(tasks=("close_brackets",)), seed=0)


def test_newline_tokens_are_the_ids_whose_text_holds_a_newline() -> None:
    tok = _WordTokenizer(["a\n    b\nc"])
    stops = structured.newline_tokens(tok)
    assert stops == frozenset(i for i, w in enumerate(tok.vocab) if "\n" in w)
    assert {tok.vocab[i] for i in stops} == {"\n", "\n    "}
    assert structured.newline_tokens(tok) is stops  # computed once per tokenizer


def test_completion_text_ends_at_the_line_end() -> None:
    tok = _WordTokenizer(["ab)\n  cd"])
    ids = tok.encode
    assert structured.completion_text(Generated(ids("ab)"), [], None), tok) == "ab)"
    # a stop token's text before its newline belongs to the line
    assert structured.completion_text(Generated(ids("ab"), [], ids(")")[0]), tok) == "ab)"
    assert structured.completion_text(Generated(ids("ab"), [], ids("\n  ")[0]), tok) == "ab"
    assert structured.completion_text(Generated(ids("ab\n  cd"), [], None), tok) == "ab"
    # the first line, however many follow
    assert structured.completion_text(Generated(ids("ab\n  cd\n  ab"), [], None), tok) == "ab"


def test_structured_scoring_counts_the_stop_tokens_text() -> None:
    tok = _WordTokenizer(["f(a)\n", "value", "e", "ea"])
    item = structured.StructuredItem("close_brackets", "x", [1], "    f(a", "")
    assert structured.score(item, Generated([], [], tok.encode(")")[0]), tok)
    assert not structured.score(item, Generated([], [], tok.encode("\n")[0]), tok)
    ident = structured.StructuredItem("repeat_identifier", "y", [1], "return valu", "7:value")
    assert structured.score(ident, Generated(tok.encode("e"), [], None), tok)
    assert not structured.score(ident, Generated(tok.encode("ea"), [], None), tok)


class _Engine:
    tokenizer = _WordTokenizer(["a\nb"])


def test_run_items_decodes_lines_to_their_end_and_blocks_a_fixed_width(monkeypatch) -> None:
    calls = []

    def generate(engine, prompts, max_new_tokens, stop_tokens=frozenset()):
        assert isinstance(engine, _Engine)  # the engine the items run on
        calls.append(([p[0] for p in prompts], max_new_tokens, stop_tokens))
        return [Generated([p[0]] * 2, [0.0]) for p in prompts]

    monkeypatch.setattr(structured, "generate_with_margins", generate)
    items = [
        structured.StructuredItem(task, "", [k], "", "")
        for k, task in enumerate(
            ["close_line", "indent_block", "repeat_identifier", "indent_block"]
        )
    ]
    out = structured.run_items(_Engine(), items, max_new_tokens=9)
    stops = structured.newline_tokens(_Engine.tokenizer)
    assert calls == [([0, 2], 9, stops), ([1, 3], structured.INDENT_TOKENS, frozenset())]
    assert [g.tokens for g in out] == [[0, 0], [1, 1], [2, 2], [3, 3]]  # the items' order
    calls.clear()
    out = structured.run_items(_Engine(), items[1:2], max_new_tokens=9)
    assert len(calls) == 1 and calls[0][1] == structured.INDENT_TOKENS and out[0].tokens == [1, 1]
    assert structured.INDENT_TOKENS == 8
    assert np.all([g is not None for g in out])


def test_a_batch_returning_fewer_records_than_items_is_an_error(monkeypatch) -> None:
    # a lost record would leave an item without a completion (None)
    monkeypatch.setattr(
        structured, "generate_with_margins", lambda e, prompts, *a: [Generated([], [])]
    )
    items = [structured.StructuredItem("close_line", "", [k], "", "") for k in range(2)]
    with pytest.raises(ValueError, match="zip"):
        structured.run_items(_Engine(), items, max_new_tokens=3)
    blocks = [structured.StructuredItem("indent_block", "", [k], "", "") for k in range(2)]
    with pytest.raises(ValueError, match="zip"):
        structured.run_items(_Engine(), blocks, max_new_tokens=3)


def test_indent_block_skips_tabbed_openers_and_bodies_not_deeper() -> None:
    assert list(structured._candidates("indent_block", ["if x:", "    y = 1"])) == [
        (0, "if x:", "0")
    ]
    assert list(structured._candidates("indent_block", ["if\tx:", "    y = 1"])) == []
    assert list(structured._candidates("indent_block", ["    if x:", "    y = 1"])) == []
    assert list(structured._candidates("indent_block", ["    if x:", "", "     y"])) == [
        (0, "    if x:", "4")
    ]


def test_each_task_draws_its_lines_in_its_own_seeded_order() -> None:
    doc = "\n".join(f"    value_{k} = compute_{k}(a, b_{k})" for k in range(12))
    tok = _WordTokenizer([doc])
    spec = _spec(tasks=("indent_block", "close_line"), per_task=4)
    doc2 = doc + "\n" + "\n".join(f"if x_{k}:\n    pass" for k in range(6))
    tok = _WordTokenizer([doc2])
    items = structured.build_items(tok, [doc2], spec, seed=3)
    lines = doc2.split("\n")
    for t, task in enumerate(spec.tasks):
        found = list(structured._candidates(task, lines))
        order = np.random.default_rng([3, 100 + t]).permutation(len(found))
        want = [found[k][1] for k in order[:4]]
        assert [i.line_prefix for i in items if i.task_name == task] == want, task


def test_a_prompt_reaches_back_two_hundred_lines_at_most() -> None:
    lines = [f"a{k} = {k}" for k in range(230)] + ["    result = compute_all(x, y)"]
    doc = "\n".join(lines)
    tok = _WordTokenizer([doc])
    (item,) = structured.build_items(tok, [doc], _spec(per_task=1, context_tokens=10_000), seed=0)
    assert tok.decode(item.prompt[1:]) == "\n".join(lines[30:230]) + "\n" + item.line_prefix


def test_a_one_token_identifier_is_skipped_and_the_draw_goes_on() -> None:
    # five lines whose name is one token (nothing of it left to repeat) and one usable:
    # whatever the seeded order, the usable one is found
    doc = "\n".join(
        ["    data_values = 1", *["    x = data_values"] * 5, "    helper = 2", "    y = helper"]
    )
    tok = _WordTokenizer([doc])
    spec = _spec(tasks=("repeat_identifier",), per_task=1)
    for seed in range(8):
        (item,) = structured.build_items(tok, [doc], spec, seed=seed)
        assert item.expect == "8:helper", seed


def test_an_indent_block_cut_inside_a_token_is_skipped() -> None:
    # "    if x:  " ends in the token ":  ": its cut after the colon falls inside it
    doc = "    if x:  \n        y = 1\n    for i in z:\n        pass"
    tok = _WordTokenizer([doc])
    (item,) = structured.build_items(tok, [doc], _spec(tasks=("indent_block",), per_task=1), 0)
    assert item.line_prefix == "    for i in z:"
    with pytest.raises(ValueError, match="'indent_block': the dataset half has 1 usable lines"):
        structured.build_items(tok, [doc], _spec(tasks=("indent_block",), per_task=2), seed=0)
