"""Suite-wide test setup: CPU JAX by default, and the `device` marker's skip rule."""

from __future__ import annotations

import os

import pytest

# The driver and the tests run JAX on the CPU unless a device test asks otherwise.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _has_accelerator() -> bool:
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        return False
    try:
        import jax

        return any(d.platform != "cpu" for d in jax.devices())
    except Exception:  # no backend at all: no accelerator
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("device" in item.keywords for item in items) and not _has_accelerator():
        skip = pytest.mark.skip(reason="needs an accelerator (GPU/TPU); JAX sees only CPUs here")
        for item in items:
            if "device" in item.keywords:
                item.add_marker(skip)
