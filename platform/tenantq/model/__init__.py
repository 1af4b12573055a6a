"""tenantq.model: model config, the Flax NNX decoder, safetensors loading, tokenizer.

`tenantq.model.config` is pure Python (the capacity planner imports it without JAX), so
the JAX-side names here are imported lazily on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from tenantq.model.config import ModelConfig, TensorInfo

_LAZY = {
    "Decoder": "tenantq.model.decoder",
    "init_params": "tenantq.model.decoder",
    "forward": "tenantq.model.decoder",
    "load_params": "tenantq.model.loader",
    "iter_checkpoint": "tenantq.model.loader",
    "Tokenizer": "tenantq.model.tokenizer",
    "load_tokenizer": "tenantq.model.tokenizer",
}

__all__ = ["ModelConfig", "TensorInfo", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tenantq.model' has no attribute {name!r}")
