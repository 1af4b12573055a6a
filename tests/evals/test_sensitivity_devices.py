"""`tenantq sensitivity` over two local devices gives the serial run's table, row for row.

Two host devices are forced in a subprocess (XLA_FLAGS must be set before JAX starts). The
bound is equality: each unit runs the same computation on the same inputs whichever CPU device
holds it, and the bootstrap is seeded, so every column must match the one-device run exactly;
both devices must have run at least one unit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import json, sys
import jax
from tenantq.evals import sensitivity
from tenantq.reference import reference_model_path

devices = jax.local_devices()
assert len(devices) == 2, devices
kw = dict(by="block", rows=4, row_tokens=32, resamples=200, progress=False)
used = []
serial = sensitivity.profile(reference_model_path(), "int4", cache_dir=sys.argv[1] + "/serial",
                             devices=devices[:1], **kw)
parallel = sensitivity.profile(reference_model_path(), "int4", cache_dir=sys.argv[1] + "/both",
                               on_unit=lambda unit, device: used.append(device.id), **kw)
print(json.dumps({"serial": serial.to_pylist(), "parallel": parallel.to_pylist(),
                  "used": used}))
"""


@pytest.mark.slow
def test_two_devices_give_the_serial_table(tmp_path: Path) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(out["serial"]) == 4 * 2 + 2  # attn and mlp of 4 layers, embed, lm_head
    assert out["parallel"] == out["serial"]
    assert sorted(set(out["used"])) == [0, 1] and len(out["used"]) == len(out["serial"])
