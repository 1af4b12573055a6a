"""The calibration set, described once: which text calibrates, and how much of it.

A study spec's `[calibration]` table (`search.spec.CalibrationSpec`) extends this schema with
the algorithm, the evaluator's `Calibrator` draws its windows by it, and a worker is sent
its fields: one schema, one set of names. Pydantic only (no JAX), so a spec can be checked
without accelerator libraries.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_NUM_SEQUENCES = 128  # calibration windows (issue 11)
DEFAULT_SEQ_TOKENS = 512  # tokens per window
# The names CalibrationData's fields had before it took the spec's (old -> new).
RENAMED = {"source": "data", "num_sequences": "sequences", "seq_tokens": "sequence_tokens"}


class CalibrationData(BaseModel):
    """The calibration set, described once (a study spec's `[calibration]` table extends it
    with the algorithm): `sequences` windows of `sequence_tokens` tokens of `data` (a
    .txt/.jsonl/.parquet file; None: the reference model's train split), drawn with `seed`.
    `sequential`: each plan's statistics are taken layer by layer through its own
    already-quantized layers (`quant.site_inputs.site_inputs_sequential`; per plan, not cached)
    instead of once from the full-precision model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: str | None = Field(None, description="calibration text file; None: train split")
    sequences: int = Field(
        DEFAULT_NUM_SEQUENCES, ge=1, description="calibration windows (issue 11: 128)"
    )
    sequence_tokens: int = Field(DEFAULT_SEQ_TOKENS, ge=2, description="tokens per window")
    seed: int = Field(0, ge=0, description="seed of the window draw")
    sequential: bool = Field(
        False,
        description="statistics per plan through its own quantized layers (GPTQ paper, sec. 4)",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, raw: Any) -> Any:
        """An old field name is refused naming its new one (not only listed among the keys)."""
        if isinstance(raw, dict):
            for old, new in RENAMED.items():
                if old in raw:
                    raise ValueError(f"{old!r} is now {new!r}")
        return raw
