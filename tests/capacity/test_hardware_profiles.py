"""Hardware profiles, the runtime reserve, deployments and model presets by hand (`make
mutation TARGETS=capacity-rest`): every refusal's one-line message, aliases and spellings,
the reserve's floor and its description, and how presets are found (built in, registered,
entry point, path). Expected figures are the profiles' cited capacities and plain
arithmetic (1 GiB = 2^30 B).
"""

from __future__ import annotations

import json
import re
from fractions import Fraction

import pytest

from tenantq.capacity import presets
from tenantq.capacity.hardware import (
    HARDWARE,
    Deployment,
    HardwareProfile,
    Reserve,
    get_hardware,
    hardware_names,
)
from tenantq.capacity.presets import get_model_config, model_names, register_preset
from tenantq.reference import reference_model_path

GiB = 2**30


def _raises(message: str):
    return pytest.raises(ValueError, match=f"^{re.escape(message)}$")


# ----------------------------------------------------------------------- profiles
@pytest.mark.parametrize("bad", [0, -1, 1.5, "16GiB"])
def test_a_profile_needs_a_positive_byte_count(bad):
    with _raises("hardware x: memory must be a positive byte count"):
        HardwareProfile("x", bad, None, "")
    assert HardwareProfile("x", 1, None, "").hbm_bytes == 1


def test_names_aliases_and_spellings():
    assert hardware_names() == [
        "tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu-v7", "h100-sxm", "h200", "b200", "cpu",
    ]  # fmt: skip
    assert get_hardware("  TPU-v6e ") is HARDWARE["tpu-v6e"]
    for alias, name in (("ironwood", "tpu-v7"), ("tpu-v7x", "tpu-v7"), ("Trillium", "tpu-v6e")):
        assert get_hardware(alias) is HARDWARE[name]
    assert get_hardware("H100") is HARDWARE["h100-sxm"]
    message = (
        "unknown hardware 'tpu-v9'; valid: tpu-v5e, tpu-v5p, tpu-v6e, tpu-v7, h100-sxm, h200, "
        "b200, cpu (cpu with a memory size)"
    )
    with _raises(message):
        get_hardware("tpu-v9")


def test_cpu_profiles():
    cpu = get_hardware(" CPU ", memory_bytes=64 * GiB)
    assert cpu == HardwareProfile("cpu", 64 * GiB, None, "host memory 64.00 GiB")
    assert get_hardware("Cpu:2GiB").hbm_bytes == 2 * GiB
    with _raises("hardware cpu needs a memory size: --memory 64GiB (or cpu:64GiB)"):
        get_hardware("cpu")
    with _raises("cpu memory must be positive"):
        get_hardware("cpu", memory_bytes=0)
    assert get_hardware("cpu", memory_bytes=1).hbm_bytes == 1  # the smallest memory
    message = "cpu memory: cannot read 'lots' as bytes; write e.g. 4GiB, 512MiB, 16GB or 1000000"
    with _raises(message):
        get_hardware("cpu:lots")


def test_a_memory_size_is_for_cpu_only():
    # H200: nvidia-smi's 143,771 MiB = 140.40 GiB.
    with _raises("a memory size applies to cpu only; h200 has 140.40 GiB per chip"):
        get_hardware("h200", memory_bytes="64GiB")


# ----------------------------------------------------------------------- reserve
def test_reserve_is_a_fraction_or_bytes_never_both():
    for kw in ({}, {"fraction": Fraction(1, 10), "fixed_bytes": 5}):
        with _raises("a reserve is either a fraction of HBM or a byte count"):
            Reserve(**kw)
    for bad in (Fraction(1), Fraction(-1, 10)):
        with _raises(f"reserve fraction must be in [0, 1), got {float(bad)}"):
            Reserve(fraction=bad)
    with _raises("reserve bytes must not be negative"):
        Reserve(fixed_bytes=-1)
    assert Reserve(fraction=Fraction(0)).bytes_for(100) == 0
    assert Reserve(fixed_bytes=0).bytes_for(100) == 0


def test_reserve_bytes_and_description():
    # A fraction is exact and floors: 1/3 of 100 B is 33 B; 10% of 16 GiB is 1,717,986,918.
    assert Reserve(fraction=Fraction(1, 3)).bytes_for(100) == 33
    assert Reserve(fraction=Fraction(1, 10)).bytes_for(16 * GiB) == 1_717_986_918
    assert Reserve(fixed_bytes=4 * GiB).bytes_for(100) == 4 * GiB
    assert Reserve(fixed_bytes=4 * GiB).describe() == "fixed 4,294,967,296 B"
    assert Reserve(fraction=Fraction(1, 10)).describe() == "10% of HBM, default"
    assert Reserve(fraction=Fraction(1, 8)).describe() == "12.5% of HBM"


def test_reserve_parse_forms():
    assert Reserve.parse() == Reserve(fraction=Fraction(1, 10))
    given = Reserve(fixed_bytes=7)
    assert Reserve.parse(given) is given
    assert Reserve.parse(4096) == Reserve(fixed_bytes=4096)  # a Python int: bytes
    assert Reserve.parse("5%") == Reserve(fraction=Fraction(1, 20))
    assert Reserve.parse(0.25) == Reserve(fraction=Fraction(1, 4))
    assert Reserve.parse("2GiB") == Reserve(fixed_bytes=2 * GiB)
    with pytest.raises(ValueError):
        Reserve.parse(True)  # not the int 1: text "True", which is no reserve


# ----------------------------------------------------------------------- deployment
@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_deployment_chips_must_be_positive_integers(bad):
    with _raises(f"chips must be a positive integer, got {bad!r}"):
        Deployment(HARDWARE["h200"], chips=bad)


@pytest.mark.parametrize("bad", [0, -16, 1.5])
def test_deployment_page_tokens_must_be_positive_integers(bad):
    with _raises(f"page_tokens must be a positive integer, got {bad!r}"):
        Deployment(HARDWARE["h200"], page_tokens=bad)


def test_deployment_of_and_its_reserve():
    d = Deployment.of("cpu", 2, memory_bytes="8GiB", page_tokens=32, reserve="1GiB")
    assert (d.hardware.name, d.hardware.hbm_bytes, d.chips, d.page_tokens) == (
        "cpu", 8 * GiB, 2, 32,
    )  # fmt: skip
    assert d.reserve == Reserve(fixed_bytes=GiB) and d.reserve_bytes_per_chip == GiB
    profile = HARDWARE["tpu-v5e"]
    d = Deployment.of(profile)
    assert d.hardware is profile and (d.chips, d.page_tokens) == (1, 16)
    assert d.reserve_bytes_per_chip == 16 * GiB // 10  # the default 10%
    assert Deployment(profile, reserve="25%").reserve == Reserve(fraction=Fraction(1, 4))
    assert Deployment(profile, page_tokens=1).page_tokens == 1  # one-token pages are pages


# ----------------------------------------------------------------------- presets
def _config_json(folder, **overrides) -> None:
    body = {
        "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "max_position_embeddings": 128,
    }  # fmt: skip
    body.update(overrides)
    (folder / "config.json").write_text(json.dumps(body))


def test_registered_presets(tmp_path, monkeypatch):
    monkeypatch.setattr(presets, "_FOLDER_PRESETS", {})
    _config_json(tmp_path)
    register_preset("  My-Model ", tmp_path)  # a folder: read when asked for
    calls = []
    register_preset("lazy", lambda: calls.append(1) or tmp_path)
    assert calls == []  # a callable is called lazily, on use
    assert model_names()[: len(presets.PRESETS)] == list(presets.PRESETS)
    assert model_names()[len(presets.PRESETS) :] == ["lazy", "my-model", "tenantq-ref"]
    assert get_model_config("MY-MODEL ").num_layers == 3
    assert get_model_config("lazy").num_layers == 3 and calls == [1]
    with _raises("preset 'llama-3.1-8b' is built in; choose another name"):
        register_preset(" Llama-3.1-8B", tmp_path)


def test_a_registered_preset_wins_over_an_entry_point(tmp_path, monkeypatch):
    # tenantq's pyproject declares `tenantq-ref` as an entry point; a preset registered under
    # that name first keeps its own folder.
    monkeypatch.setattr(presets, "_FOLDER_PRESETS", {})
    _config_json(tmp_path, num_hidden_layers=5)
    register_preset("tenantq-ref", tmp_path)
    assert get_model_config("tenantq-ref").num_layers == 5


def test_entry_point_presets_load_their_folder(monkeypatch):
    # Nothing registered in this process: `tenantq-ref` comes from the entry point that
    # tenantq's pyproject declares (tenantq.reference:reference_model_path), called on use.
    monkeypatch.setattr(presets, "_FOLDER_PRESETS", {})
    assert presets._folder_presets()["tenantq-ref"]() == reference_model_path()
    assert get_model_config("tenantq-ref").num_layers == 4  # the shipped reference model


def test_model_lookup_by_name_or_path(tmp_path):
    config = get_model_config(" LLAMA-3.1-8B ")
    assert (config.num_layers, config.vocab_size) == (32, 128256)
    _config_json(tmp_path, num_hidden_layers=7)
    assert get_model_config(tmp_path).num_layers == 7  # a folder
    assert get_model_config(str(tmp_path / "config.json")).num_layers == 7
    for missing in ("nowhere.json", "no/such/folder"):  # path-like: the reader's error
        with pytest.raises(ValueError, match=f"^no config.json at {re.escape(missing)}: "):
            get_model_config(missing)
    names = ", ".join(model_names())
    with _raises(
        f"unknown model 'llama-9'; valid presets: {names} (or a path to a config.json / "
        "checkpoint folder)"
    ):
        get_model_config(" llama-9 ")
