"""The reference model tenantq ships: a small Llama trained here on the Python stdlib.

No model hub is reachable at run time, so the default run and the tests use this
checkpoint (HF layout, bf16) found inside the installed package.
"""

from __future__ import annotations

from pathlib import Path


def reference_model_path() -> Path:
    """Folder of the shipped checkpoint (config.json, model.safetensors, tokenizer.json)."""
    return Path(__file__).resolve().parent / "model"
