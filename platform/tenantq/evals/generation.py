"""Greedy generation through the engine that also records each generated token's margin.

Flips start where the model was unsure: the margin (top-1 minus top-2 log-prob) of every
generated token is kept beside the token, for the baseline and the candidate alike.
`generate_with_margins` runs the engine's public `prefill`/`decode`/`release` (the paged pool
in the plan's KV formats, as `Engine.generate`). `teacher_forced_with_margins` checks a known
answer in one prefill instead: greedy emits the answer iff every argmax along it is right, and
its record is greedy's up to and including the first wrong token (greedy's later tokens, which
follow a wrong prefix, are not computed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Generated:
    """Greedy ids (the stop token excluded) and the top-1 minus top-2 log-prob at each
    generated step (stop included). Teacher-forced records end at the first wrong token."""

    tokens: list[int]
    margins: list[float]
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


def teacher_forced_with_margins(
    engine,
    prompts: list[list[int]],
    answers: list[list[int]],
    *,
    chunk_tokens: int | None = None,
    kv_tokens: int | None = None,
) -> list[Generated]:
    """Greedy's record on each prompt while it follows `answers` (no stop tokens): tokens
    and margins up to and including the first token that differs from the answer, from one
    teacher-forced prefill of prompt + answer[:-1] (`Engine.continuation_logits`)."""
    logits = engine.continuation_logits(
        prompts, answers, chunk_tokens=chunk_tokens, kv_tokens=kv_tokens
    )
    out: list[Generated] = []
    for answer, rows in zip(answers, logits, strict=True):
        top1, gap = _top2_margin(rows)
        wrong = np.flatnonzero(top1 != np.asarray(answer))
        stop_at = int(wrong[0]) + 1 if wrong.size else len(answer)
        out.append(Generated(top1[:stop_at].tolist(), gap[:stop_at].astype(float).tolist()))
    return out
