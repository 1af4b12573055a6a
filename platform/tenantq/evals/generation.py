"""Greedy generation through the engine that also records each generated token's margin.

Flips start where the model was unsure: the margin (top-1 minus top-2 log-prob) of every
generated token is kept beside the token, for the baseline and the candidate alike. It runs
on the engine's public `prefill`/`decode`/`release`, so the answer is produced through the
paged pool in the plan's KV formats exactly as `Engine.generate` would produce it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Generated:
    tokens: list[int]  # greedy ids, the stop token excluded
    margins: list[float]  # top-1 minus top-2 log-prob at each generated step (stop included)
    stop: int | None = None  # the stop token that ended it, if one did


def _top2_margin(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """argmax and top-1 minus top-2 log-prob per row of [B, V] logits (float64 on host)."""
    x = logits.astype(np.float64)
    top2 = np.partition(x, -2, axis=-1)[:, -2:]
    return np.argmax(x, axis=-1), top2[:, 1] - top2[:, 0]  # log-softmax cancels in the gap


def generate_with_margins(
    engine,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_tokens: set[int] | frozenset[int] = frozenset(),
) -> list[Generated]:
    """Greedy continuations (at most `max_new_tokens`, ending before a stop token)."""
    out: list[Generated] = []
    step = engine.cache.max_seqs
    for start in range(0, len(prompts), step):
        chunk = prompts[start : start + step]
        batch, logits = engine.prefill(chunk, reserve_tokens=max_new_tokens)
        try:
            tokens = [[] for _ in chunk]
            margins = [[] for _ in chunk]
            done = np.zeros(len(chunk), bool)
            stops: list[int | None] = [None] * len(chunk)
            for i in range(max_new_tokens):
                nxt, gap = _top2_margin(logits)
                for j in range(len(chunk)):
                    if done[j]:
                        continue
                    margins[j].append(float(gap[j]))
                    if int(nxt[j]) in stop_tokens:
                        done[j], stops[j] = True, int(nxt[j])
                    else:
                        tokens[j].append(int(nxt[j]))
                if done.all() or i == max_new_tokens - 1:
                    break
                logits = engine.decode(batch, nxt.tolist())
        finally:
            engine.release(batch)
        out.extend(Generated(*g) for g in zip(tokens, margins, stops, strict=True))
    return out
