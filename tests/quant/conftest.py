"""Tiny models for the calibration tests: a random Llama and the same written as a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from tenantq.model.config import ModelConfig


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(
        model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128, eos_token_ids=(2,),
    )  # fmt: skip
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.fixture(scope="session")
def reference_float32():
    """The shipped reference model: (path, config, float32 host params, tokenizer)."""
    from tenantq.model.loader import load_params
    from tenantq.model.tokenizer import load_tokenizer
    from tenantq.reference import reference_model_path

    path = reference_model_path()
    config = ModelConfig.from_file(path)
    params = {k: np.asarray(v, np.float32) for k, v in load_params(path, config).items()}
    return path, config, params, load_tokenizer(path)


def write_checkpoint(folder: Path, config: ModelConfig, params) -> Path:
    """HF layout (bf16 safetensors + config.json) of `params` (our [in, out] layout)."""
    from tenantq.model.loader import hf_names

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, (name, transpose) in hf_names(config).items():
        value = np.asarray(params[path], np.float32)
        tensors[name] = np.ascontiguousarray(value.T if transpose else value).astype(
            ml_dtypes.bfloat16
        )
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return folder


@pytest.fixture(scope="session")
def config() -> ModelConfig:
    return tiny_config()


@pytest.fixture(scope="session")
def params(config):
    from tenantq.model.decoder import init_params

    return init_params(config, seed=0)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, config, params) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "model", config, params)


@pytest.fixture(scope="session")
def windows(config) -> np.ndarray:
    return np.random.default_rng(0).integers(3, config.vocab_size, (4, 32)).astype(np.int32)
