"""`tenantq-ref` reaches the capacity planner without `tenantq.capacity` importing the
reference package: through the `tenantq.model_presets` entry point that pyproject.toml
declares (what an installed tenantq provides), or `register_preset` on import."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from tenantq.capacity.presets import ENTRY_POINT_GROUP, get_model_config, register_preset
from tenantq.model.config import ModelConfig
from tenantq.reference import PRESET_NAME, reference_model_path

ROOT = Path(__file__).resolve().parents[2]


def _declared() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["entry-points"][ENTRY_POINT_GROUP]


def test_pyproject_declares_the_reference_preset():
    assert _declared() == {PRESET_NAME: "tenantq.reference:reference_model_path"}


def test_an_installed_entry_point_is_found_without_importing_the_reference_package(tmp_path):
    # A dist-info folder on sys.path is what `pip install` writes; this one carries exactly
    # the entry points pyproject.toml declares. A fresh interpreter imports tenantq.capacity
    # only, and must find the preset with tenantq.reference still unimported.
    dist = tmp_path / "tenantq_probe-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tenantq-probe\nVersion: 0.0\n")
    lines = [f"{name} = {target}" for name, target in _declared().items()]
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n" + "\n".join(lines) + "\n")
    script = textwrap.dedent(
        """
        import sys
        from tenantq.capacity import get_model_config, model_names
        assert "tenantq.reference" not in sys.modules
        assert "tenantq-ref" in model_names()
        config = get_model_config("tenantq-ref")
        print(config.num_layers, config.hidden_size, config.vocab_size)
        """
    )
    env_path = f"{tmp_path}:{ROOT / 'platform'}"
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={"PYTHONPATH": env_path, "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    want = ModelConfig.from_file(reference_model_path())
    assert done.stdout.split() == [
        str(want.num_layers),
        str(want.hidden_size),
        str(want.vocab_size),
    ]


def test_register_preset_reads_the_folder_it_is_given(tmp_path, monkeypatch):
    from tenantq.capacity import presets

    monkeypatch.setattr(presets, "_FOLDER_PRESETS", dict(presets._FOLDER_PRESETS))  # undo after
    (tmp_path / "config.json").write_text((reference_model_path() / "config.json").read_text())
    register_preset("probe-model", tmp_path)
    assert get_model_config("Probe-Model") == ModelConfig.from_file(reference_model_path())
    with pytest.raises(ValueError, match="preset 'llama-3.1-8b' is built in; choose another"):
        register_preset("llama-3.1-8b", tmp_path)
