"""Tiny models shared by the engine tests (shapes small enough to compile in about a second)."""

from __future__ import annotations

import pytest

from tenantq.model.config import ModelConfig


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(
        model_type="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        eos_token_ids=(2,),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.fixture(scope="session")
def make_config():
    """`make_config(**overrides)`: the tiny config with some fields changed."""
    return tiny_config


@pytest.fixture(scope="session")
def config() -> ModelConfig:
    return tiny_config()


@pytest.fixture(scope="session")
def params(config):
    from tenantq.model.decoder import init_params

    return init_params(config, seed=0)
