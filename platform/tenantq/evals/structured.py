"""Structured output on real code: completions whose correctness a parser can check.

Every example is a line of held-out Python cut part-way, after up to `context_tokens` tokens
of the file before it; the model completes the line greedily (up to the first newline) and
passes when the completed line satisfies its check, whatever its exact spelling:
- `close_line`: the line is cut before its trailing closing brackets (moved back to a token
  boundary, often into a string literal); the completed line must parse (`ast.parse`), so
  brackets and string literals have to be closed; `close_brackets`: only the cuts that fall
  exactly before the closing brackets (nothing else left open);
- `repeat_identifier`: a `return NAME` whose NAME was assigned in the lines just before; the
  completion must start with NAME (an identifier defined earlier, repeated exactly);
- `indent_block`: a block opener (`def`, `class`, `if`, `for`, `while`, `with`, `try` line
  ending in `:`, whose file indents the next line deeper) cut after its colon; the first
  non-blank generated line must be indented deeper than the opener, as Python requires
  (anything else is an IndentationError). Generated without a newline stop, since the
  tokenizer carries indentation inside its newline tokens (`"\n   "`).
A dict-literal task (`ast.literal_eval` on a completed display) was tried and dropped: the
reference model's held-out split has one single-line dict display of literals in 31 files.
"""

from __future__ import annotations

import ast
import dataclasses
import keyword
import re
import weakref
from dataclasses import dataclass

import numpy as np

from tenantq.evals.generation import Generated, generate_with_margins

_CLOSERS = ")]}"
_OPENER = re.compile(r"(\s*)(async\s+)?(def|class|if|for|while|with|try)\b[^#]*:\s*$")
INDENT_TOKENS = 8  # enough for the newline, the indentation and the next line's first word
_IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{5,}\b")
_LOOKBACK_LINES = 30


@dataclass(frozen=True)
class StructuredItem:
    task_name: str
    example_id: str
    prompt: list[int]
    line_prefix: str  # the cut line's text in the prompt (cut at a token boundary)
    expect: str  # repeat_identifier: the identifier to repeat
    task: str = "structured"

    @property
    def length(self) -> int:
        return len(self.prompt)


def _close_line_cut(line: str) -> str | None:
    body = line.strip()
    if not 16 <= len(body) <= 100 or body.startswith(("#", "@")) or body[-1] not in _CLOSERS:
        return None
    try:
        ast.parse(body)
    except SyntaxError:
        return None
    cut = len(line.rstrip())
    while cut > 0 and line[cut - 1] in _CLOSERS:
        cut -= 1
    prefix = line[:cut]
    return prefix if prefix.strip() and any(ch in prefix for ch in "([{") else None


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _candidates(task: str, lines: list[str]):
    """(line index, line prefix, expectation) for every line of `lines` usable by `task`."""
    for i, line in enumerate(lines):
        if task == "indent_block":
            m = _OPENER.fullmatch(line)
            after = next((x for x in lines[i + 1 :] if x.strip()), None)
            if m and "\t" not in line and after is not None and _indent(after) > _indent(line):
                yield i, line.rstrip(), str(_indent(line))
        elif task in ("close_line", "close_brackets"):
            prefix = _close_line_cut(line)
            if prefix is not None:
                yield i, prefix, ""
        else:
            for m in _IDENT.finditer(line):
                name = m.group(0)
                if keyword.iskeyword(name) or m.start() == 0 or line[m.start() - 1] == ".":
                    continue
                recent = "\n".join(lines[max(0, i - _LOOKBACK_LINES) : i])
                if re.search(rf"\b{name}\b", recent):
                    # cut before the last character; build_items moves it to a token boundary
                    yield i, line[: m.end() - 1], f"{m.start()}:{name}"
                    break


def build_items(tokenizer, docs: list[str], spec, seed: int) -> list[StructuredItem]:
    """`per_task` examples of each task, drawn (seeded) from every usable line of `docs`."""
    bos = tokenizer.token_id("<|bos|>")
    items = []
    for t, task in enumerate(spec.tasks):
        found = []
        for d, doc in enumerate(docs):
            lines = doc.split("\n")
            for i, prefix, expect in _candidates(task, lines):
                found.append((d, i, prefix, expect))
        rng = np.random.default_rng([seed, 100 + t])
        chosen: list[StructuredItem] = []
        for k in rng.permutation(len(found)):  # seeded order; keep the first usable per_task
            d, i, prefix, expect = found[k]
            lines = docs[d].split("\n")
            context = "\n".join(lines[max(0, i - 200) : i]) + "\n"
            ids, line_prefix = _cut_at_token(tokenizer, context, lines[i], len(prefix))
            if task == "repeat_identifier" and len(line_prefix) <= int(expect.split(":")[0]):
                continue  # the identifier is one token: nothing of it is left to repeat
            if task in ("close_brackets", "indent_block") and len(line_prefix) != len(prefix):
                continue  # the cut fell inside a token (often a string literal): close_line
            ids = ids[-(spec.context_tokens - 1) :]
            chosen.append(StructuredItem(task, "", [bos, *ids], line_prefix, expect))
            if len(chosen) == spec.per_task:
                break
        if len(chosen) < spec.per_task:
            raise ValueError(
                f"structured task {task!r}: the dataset half has {len(chosen)} usable lines, "
                f"the suite asks for {spec.per_task}"
            )
        items += [
            dataclasses.replace(item, example_id=f"structured/{task}/{n}")
            for n, item in enumerate(chosen)
        ]
    return items


def _cut_at_token(tokenizer, context: str, line: str, cut: int) -> tuple[list[int], str]:
    """Token ids of `context + line` up to the last token boundary at or before `cut` chars
    into the line, and the line's text they cover. Cutting inside a BPE token (e.g. after a
    trailing space that belongs to the next word) would show the model a split it never saw."""
    ids = tokenizer.encode(context + line)
    ends = np.cumsum([len(tokenizer.decode([t])) for t in ids])
    keep = int(np.searchsorted(ends, len(context) + cut, side="right"))
    return ids[:keep], line[: max(0, int(ends[keep - 1]) - len(context))] if keep else ""


_NEWLINE_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def newline_tokens(tokenizer) -> frozenset[int]:
    """Ids whose text contains a newline: a line's completion stops at the first of them."""
    cached = _NEWLINE_IDS.get(tokenizer)
    if cached is None:
        cached = frozenset(i for i in range(tokenizer.vocab_size) if "\n" in tokenizer.decode([i]))
        _NEWLINE_IDS[tokenizer] = cached
    return cached


def run_items(engine, items: list[StructuredItem], max_new_tokens: int) -> list[Generated]:
    """Greedy completions in `items`' order: to the end of the line, or for `indent_block`
    `INDENT_TOKENS` tokens past the opener (its answer is on the next line)."""
    stops = newline_tokens(engine.tokenizer)
    out: list[Generated | None] = [None] * len(items)
    for block in (False, True):
        index = [k for k, i in enumerate(items) if (i.task_name == "indent_block") == block]
        if not index:
            continue
        prompts = [items[k].prompt for k in index]
        gens = (
            generate_with_margins(engine, prompts, INDENT_TOKENS)
            if block
            else generate_with_margins(engine, prompts, max_new_tokens, stops)
        )
        for k, g in zip(index, gens, strict=True):
            out[k] = g
    return out  # type: ignore[return-value]


def completion_text(generated: Generated, tokenizer) -> str:
    """The generated text up to the end of the line (a stop token's text before its newline)."""
    text = tokenizer.decode(generated.tokens)
    if generated.stop is not None:
        text += tokenizer.decode([generated.stop]).split("\n", 1)[0]
    return text.split("\n", 1)[0]


def score(item: StructuredItem, generated: Generated, tokenizer) -> bool:
    if item.task_name == "indent_block":
        body = [x for x in tokenizer.decode(generated.tokens).split("\n")[1:] if x.strip()]
        return bool(body) and _indent(body[0]) > int(item.expect)
    completion = completion_text(generated, tokenizer)
    if item.task_name in ("close_line", "close_brackets"):
        try:
            ast.parse((item.line_prefix + completion).strip())
        except SyntaxError:
            return False
        return True
    start, name = item.expect.split(":", 1)
    text = (item.line_prefix + completion)[int(start) :]
    return re.match(rf"{re.escape(name)}\b", text) is not None
