"""Engine-test fixtures: the shared tiny model of `tenantq.testing`."""

from __future__ import annotations

import pytest

from tenantq.model.config import ModelConfig
from tenantq.testing import tiny_config, tiny_params, tiny_tokenizer


@pytest.fixture(scope="session")
def make_config():
    """`make_config(**overrides)`: the tiny config with some fields changed."""
    return tiny_config


@pytest.fixture(scope="session")
def config() -> ModelConfig:
    return tiny_config()


@pytest.fixture(scope="session")
def params(config):
    return tiny_params(config, seed=0)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()
