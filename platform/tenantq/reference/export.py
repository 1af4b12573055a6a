"""Hugging Face layout for the reference model: write it (bf16) and read it back.

Our linear weights are `[in, out]`; HF stores `[out, in]`, so every projection and the
LM head are transposed on the way out and back in (both through the loader's `hf_names`).
Reading back goes through the engine's loader, so it gets the same checks as any checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from tenantq.model.config import ModelConfig
from tenantq.model.loader import hf_names, load_params


def write_hf_checkpoint(out_dir, params, config: ModelConfig, tokenizer: Tokenizer) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, (name, transpose) in hf_names(config).items():
        value = np.asarray(params[path], np.float32)
        value = value.T if transpose else value
        tensors[name] = np.ascontiguousarray(value).astype(ml_dtypes.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    generation = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_ids[0],
        "pad_token_id": tokenizer.token_to_id("<|pad|>"),
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    for f in out.iterdir():  # safetensors writes 0600; package data must be readable
        f.chmod(0o644)
    return out


def read_hf_checkpoint(model_dir) -> tuple[dict, ModelConfig, Tokenizer]:
    """Params (float32, our layout; values exactly the stored bf16), config, tokenizer.

    Read through the engine's loader, with its header, shape and finiteness checks.
    """
    model_dir = Path(model_dir)
    config = ModelConfig.from_file(model_dir)
    params = load_params(model_dir, config, dtype="float32")
    return params, config, Tokenizer.from_file(str(model_dir / "tokenizer.json"))
