"""Dropping the process's compiled executables (`engine.steps.release_compiled`): a long pass
over many plans compiles one set per plan and must be able to let them go (issue 25)."""

from __future__ import annotations

import jax
import numpy as np

from tenantq.engine import steps


def test_release_compiled_drops_the_engine_executables_and_jax_jit_caches():
    jitted = jax.jit(lambda x: x + 1)
    jitted(np.ones(3, np.float32))
    steps._EXECUTABLES[("test-release", 0)] = object()  # a stand-in entry of the engine's LRU
    held = steps.compiled_count()
    assert held >= 1 and jitted._cache_size() == 1
    assert steps.release_compiled() == held  # the count it dropped
    assert steps.compiled_count() == 0 and jitted._cache_size() == 0
