"""The needle grid: passkeys at lengths x depths, answered greedily through the quantized cache.

A needle's greedy answer is checked teacher-forced (one prefill of prompt + answer) where
that is exact, so the needles run through the same executable as the fidelity windows.
Prompts come from `tenantq.reference.needles` (single needles and the RULER-style variants)
with haystacks from the suite's held-out half; every cell is one exact-match example, paired
with the bf16 baseline on the very same prompt. Depths are spread evenly over 0-100% per length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tenantq.evals.generation import Generated, generate_with_margins, teacher_forced_with_margins
from tenantq.evals.suite import NEEDLE_TASK_NAMES
from tenantq.reference import needles

TASK_NAMES = NEEDLE_TASK_NAMES  # variant -> task name (shared with the suite's metric names)


@dataclass(frozen=True)
class NeedleItem:
    task: str
    example_id: str
    length: int
    depth: float
    prompt: list[int]
    answer: np.ndarray


def build_needles(tokenizer, stream: np.ndarray, spec, seed: int) -> list[NeedleItem]:
    """Every cell of one `NeedleSpec`: `per_length` needles per length, depths evenly spaced."""
    task = TASK_NAMES[spec.variant]
    cells = needles.needle_grid(
        tokenizer, stream, spec.lengths, spec.per_length,
        (seed, needles.VARIANTS.index(spec.variant)), spec.variant, count=spec.count,
    )  # fmt: skip
    return [
        NeedleItem(task, f"{task}/len{c.length}/{c.index}", c.length, c.example.depth_fraction,
                   c.example.prompt_ids.tolist(), c.example.answer_ids)
        for c in cells
    ]  # fmt: skip


def run_needles(
    engine,
    items: list[NeedleItem],
    *,
    chunk_tokens: int | None = None,
    kv_tokens: int | None = None,
    teacher_forced: bool = True,
) -> list[Generated]:
    """Greedy answers, exactly as many tokens as each answer has (the needles' stop rule).

    With `teacher_forced` (default) a needle is checked in one prefill of prompt + answer
    (steps of `chunk_tokens` at a KV window of `kv_tokens`, so it shares the fidelity windows'
    executable) wherever the engine says that equals decoding (`teacher_forcing_exact`); the
    rest, and all with `teacher_forced=False`, decode token by token. The pass/fail verdict is
    the same either way; a failed needle's record ends at its first wrong token."""
    out: list[Generated | None] = [None] * len(items)
    by_shape: dict[tuple[int, int, bool], list[int]] = {}
    for i, item in enumerate(items):
        n = len(item.answer)
        forced = teacher_forced and engine.teacher_forcing_exact(len(item.prompt), n, chunk_tokens)
        by_shape.setdefault((item.length, n, forced), []).append(i)
    for (_, answer_tokens, forced), idx in sorted(by_shape.items()):
        prompts = [items[i].prompt for i in idx]
        if forced:
            answers = [items[i].answer.tolist() for i in idx]
            gens = teacher_forced_with_margins(
                engine, prompts, answers, chunk_tokens=chunk_tokens, kv_tokens=kv_tokens
            )
        else:
            gens = generate_with_margins(engine, prompts, answer_tokens)
        for i, g in zip(idx, gens, strict=True):
            out[i] = g
    return out  # type: ignore[return-value]


def score(item: NeedleItem, generated: Generated) -> bool:
    return needles.needle_correct(np.asarray(generated.tokens, np.int64), item.answer)
