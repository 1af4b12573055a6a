"""The needle grid: passkeys at lengths x depths, answered greedily through the quantized cache.

Prompts come from `tenantq.reference.needles` (single needles and the RULER-style variants)
with haystacks from the suite's held-out half; every cell is one exact-match example, paired
with the bf16 baseline on the very same prompt. Depths are spread evenly over 0-100% per length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tenantq.evals.generation import Generated, generate_with_margins
from tenantq.reference import needles

TASK_NAMES = {
    "single": "needle",
    "multikey": "needle_multikey",
    "multivalue": "needle_multivalue",
    "vartrack": "needle_vartrack",
}


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
    items = []
    variant_index = needles.VARIANTS.index(spec.variant)
    task = TASK_NAMES[spec.variant]
    for length in spec.lengths:
        rng = np.random.default_rng([seed, variant_index, length])
        for i, depth in enumerate(np.linspace(0.0, 1.0, spec.per_length)):
            ex = needles.make_example(
                tokenizer, stream, length, float(depth), rng, spec.variant, count=spec.count
            )
            items.append(
                NeedleItem(task, f"{task}/len{length}/{i}", length, float(depth),
                           ex.prompt_ids.tolist(), ex.answer_ids)
            )  # fmt: skip
    return items


def run_needles(engine, items: list[NeedleItem]) -> list[Generated]:
    """Greedy answers, exactly as many tokens as each answer has (the needles' stop rule)."""
    out: list[Generated | None] = [None] * len(items)
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, item in enumerate(items):
        by_shape.setdefault((item.length, len(item.answer)), []).append(i)
    for (_, answer_tokens), idx in sorted(by_shape.items()):
        gens = generate_with_margins(engine, [items[i].prompt for i in idx], answer_tokens)
        for i, g in zip(idx, gens, strict=True):
            out[i] = g
    return out  # type: ignore[return-value]


def score(item: NeedleItem, generated: Generated) -> bool:
    return needles.needle_correct(np.asarray(generated.tokens, np.int64), item.answer)
