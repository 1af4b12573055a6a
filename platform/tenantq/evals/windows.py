"""Token windows: how every measurement turns text into rows of ids, BOS first.

One reading for all: documents become one stream (`model.tokenizer.token_stream`: EOS after
each, as the trainer saw text), the stream is cut into disjoint windows at random slots, and
each row is BOS + a window. The suite's fidelity rows, sensitivity's windows and the
calibration set (the weights' statistics, static KV scales, the benches) are all drawn here,
so two callers asking for the same text, seed and shape get the same rows.
"""

from __future__ import annotations

import numpy as np

from tenantq.evals import data
from tenantq.model.config import ModelConfig
from tenantq.model.tokenizer import token_stream

__all__ = ["bos_windows", "calibration_windows", "text_windows", "token_stream", "token_windows"]


def token_windows(
    stream: np.ndarray,
    rows: int,
    window_tokens: int,
    rng: np.random.Generator,
    *,
    asker: str = "the dataset half has {tokens}: {slots} windows of {window}, the suite "
    "asks for {rows}; use fewer rows or shorter ones",
) -> np.ndarray:
    """`rows` disjoint windows of `window_tokens` ids, slots chosen at random, in order;
    `asker` words the error of a stream too short (the suite's rows, calibration's windows)."""
    slots = len(stream) // window_tokens
    if slots < rows:
        raise ValueError(
            asker.format(
                tokens=f"{len(stream):,} tokens", slots=slots, window=window_tokens, rows=rows
            )
        )
    chosen = np.sort(rng.choice(slots, rows, replace=False))
    return np.stack([stream[s * window_tokens : (s + 1) * window_tokens] for s in chosen])


def bos_windows(
    stream: np.ndarray,
    config: ModelConfig,
    rows: int,
    row_tokens: int,
    rng: np.random.Generator,
    **asker: str,
) -> np.ndarray:
    """int32 [rows, row_tokens]: the model's BOS (1 where its config names none), then a
    `token_windows` draw of `row_tokens - 1` ids."""
    body = token_windows(stream, rows, row_tokens - 1, rng, **asker)
    bos = config.bos_token_id if config.bos_token_id is not None else 1
    return np.concatenate([np.full((rows, 1), bos, np.int32), body], axis=1).astype(np.int32)


def _texts(source: str | None) -> list[str]:
    if source is None:  # the reference model's train split (calibration must not see test)
        from tenantq.reference.corpus import load_corpus

        return load_corpus().texts("train")
    return data.load_documents(source)


def text_windows(
    tokenizer,
    config: ModelConfig,
    *,
    source: str | None = None,
    rows: int,
    row_tokens: int,
    seed: int = 0,
) -> np.ndarray:
    """int32 [rows, row_tokens]: BOS plus disjoint random windows of `source`'s token stream.

    `source`: None for the reference train split, `data.REFERENCE_TEST`, or a user's
    .txt/.jsonl/.parquet. Documents are tokenized only until the stream holds 4x what
    is drawn (the slots still vary with the seed).
    """
    need = rows * (row_tokens - 1)
    parts, held = [], 0
    for doc in _texts(source):
        ids = token_stream(tokenizer, [doc])
        parts.append(ids)
        held += len(ids)
        if held >= 4 * need:
            break
    stream = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return bos_windows(
        stream, config, rows, row_tokens, np.random.default_rng([seed, 1]),
        asker=f"{source or 'the train split'} has {{tokens}}: {{slots}} windows of "
        f"{{window}} (+ BOS), {{rows}} asked for; give more text, or fewer or shorter windows",
    )  # fmt: skip


def calibration_windows(
    tokenizer,
    config: ModelConfig,
    *,
    source: str | None = None,
    num_sequences: int = 128,
    seq_tokens: int = 512,
    held_out: int = 0,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """(calibration windows, held-out windows): disjoint draws from one stream."""
    rows = text_windows(
        tokenizer, config, source=source, rows=num_sequences + held_out, row_tokens=seq_tokens,
        seed=seed,
    )  # fmt: skip
    order = np.random.default_rng([seed, 2]).permutation(len(rows))
    return rows[order[:num_sequences]], rows[order[num_sequences:]]
