"""Shared helpers for the capacity tests: tiny model configs and an in-process CLI runner."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from tenantq.model.config import ModelConfig


def tiny_config(**overrides) -> ModelConfig:
    """A 2-layer Llama-shaped config with odd sizes (packing pads, groups run partial)."""
    fields = dict(
        model_type="llama",
        vocab_size=11,
        hidden_size=8,
        intermediate_size=13,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        max_position_embeddings=256,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """Run `tenantq capacity ...` the way the lead's dispatcher does (ValueError -> exit 2)."""
    from tenantq.cli import capacity

    parser = argparse.ArgumentParser(prog="tenantq")
    sub = parser.add_subparsers(dest="command", required=True)
    capacity.add_parser(sub)
    args = parser.parse_args(["capacity", *argv])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = capacity.run(args)
        except ValueError as exc:
            print(f"tenantq capacity: error: {exc}", file=err)
            rc = 2
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def tiny():
    return tiny_config
