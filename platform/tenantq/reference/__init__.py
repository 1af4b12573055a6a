"""The reference model tenantq ships: a small Llama trained here on the Python stdlib.

No model hub is reachable at run time, so the default run and the tests use this
checkpoint (HF layout, bf16) found inside the installed package. `reference_model_path()`
is the one spelling of its location; the capacity preset `tenantq-ref` points at it
(declared as a `tenantq.model_presets` entry point, and registered on import).
"""

from __future__ import annotations

from pathlib import Path

PRESET_NAME = "tenantq-ref"


def reference_model_path() -> Path:
    """Folder of the shipped checkpoint (config.json, model.safetensors, tokenizer.json)."""
    return Path(__file__).resolve().parent / "model"


def _register() -> None:
    from tenantq.capacity.presets import register_preset

    register_preset(PRESET_NAME, reference_model_path)


_register()
