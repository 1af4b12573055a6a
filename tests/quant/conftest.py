"""Tiny models for the calibration tests: `tenantq.testing`'s random Llama and the same
written as a checkpoint (`tiny_checkpoint`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tenantq.model.config import ModelConfig
from tenantq.testing import tiny_checkpoint, tiny_config, tiny_params


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


@pytest.fixture(scope="session")
def config() -> ModelConfig:
    return tiny_config(bos_token_id=None)  # the calibration tests' windows carry no BOS


@pytest.fixture(scope="session")
def params(config):
    return tiny_params(config, seed=0)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, config, params) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", config, params)


@pytest.fixture(scope="session")
def windows(config) -> np.ndarray:
    return np.random.default_rng(0).integers(3, config.vocab_size, (4, 32)).astype(np.int32)
