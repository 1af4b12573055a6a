"""Presets against their published sizes and fields; hardware figures; bad input is explained.

Hardware profiles, the runtime reserve, deployments and model presets by hand (`make
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

from tenantq.capacity import (
    HARDWARE,
    PRESETS,
    Deployment,
    Reserve,
    budget,
    get_hardware,
    get_model_config,
    parse_bytes,
    presets,
)
from tenantq.capacity.hardware import HardwareProfile, hardware_names
from tenantq.capacity.presets import PUBLISHED_PARAMS, model_names, register_preset
from tenantq.capacity.units import MiB
from tenantq.quant.plan import QuantPlan
from tenantq.reference import reference_model_path

GiB = 2**30  # by hand, not tenantq.capacity.units.GiB (the code under test)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_parameter_count_matches_the_published_size(name):
    # Published sizes (model cards; Gemma 3 report table 1, text only) are rounded to 3 or 4
    # digits: 1% is well above rounding, well below a missing block (~2-3% per layer group).
    assert get_model_config(name).param_count() == pytest.approx(PUBLISHED_PARAMS[name], rel=0.01)


def test_presets_cover_the_issue_list():
    want = {"llama-3.1-8b", "llama-3.1-70b", "mistral-7b", "qwen2.5-7b", "qwen3-8b"}
    want |= {"qwen3-32b", "gemma-3-12b", "gemma-3-27b"}
    assert want <= set(PRESETS)


def test_gemma3_layer_pattern_and_published_fields():
    # Gemma 3: every 6th layer global, the others local with a 1,024-token window; tied.
    c = get_model_config("gemma-3-12b")
    assert c.num_layers == 48 and c.head_dim == 256 and c.num_kv_heads == 8
    assert [i for i, t in enumerate(c.layer_types) if t == "full"] == list(range(5, 48, 6))
    assert c.sliding_window == 1024 and c.tie_word_embeddings
    c27 = get_model_config("gemma-3-27b")
    assert c27.num_layers == 62 and c27.layer_types.count("full") == 10 and c27.head_dim == 128


def test_llama_fields():
    c = get_model_config("llama-3.1-70b")
    assert (c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads) == (
        8192,
        28672,
        80,
        64,
        8,
    )
    assert c.rope_scaling["rope_type"] == "llama3" and c.rope_scaling["factor"] == 8.0
    assert not c.tie_word_embeddings


def test_a_config_json_path_reads_like_the_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["qwen2.5-7b"]))
    assert get_model_config(str(tmp_path)) == get_model_config("qwen2.5-7b")
    assert get_model_config(str(tmp_path / "config.json")).attention_bias


def test_a_config_json_missing_a_field_names_it(tmp_path):
    raw = dict(PRESETS["llama-3.1-8b"])
    del raw["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="intermediate_size"):
        get_model_config(str(tmp_path / "config.json"))


def test_unknown_model_lists_the_presets():
    with pytest.raises(ValueError, match="llama-3.1-8b.*gemma-3-27b"):
        get_model_config("llama-9")


def test_reference_model_is_a_registered_preset():
    from tenantq.model.config import ModelConfig
    from tenantq.reference import reference_model_path  # registers tenantq-ref

    want = ModelConfig.from_file(reference_model_path())
    assert get_model_config("tenantq-ref") == want and want.num_layers == 4


def test_hardware_figures():
    # Google's TPU pages (capacity in GiB per the TPU7x table; bandwidth GB/s) and nvidia-smi
    # memory.total for NVIDIA parts.
    assert HARDWARE["tpu-v5e"].hbm_bytes == 16 * GiB
    assert HARDWARE["tpu-v5e"].hbm_bandwidth_bytes_per_s == 819 * 10**9
    assert HARDWARE["tpu-v5p"].hbm_bytes == 95 * GiB
    assert HARDWARE["tpu-v5p"].hbm_bandwidth_bytes_per_s == 2765 * 10**9
    assert HARDWARE["tpu-v6e"].hbm_bytes == 32 * GiB
    assert HARDWARE["tpu-v6e"].hbm_bandwidth_bytes_per_s == 1638 * 10**9
    assert HARDWARE["tpu-v7"].hbm_bytes == 192 * GiB
    assert HARDWARE["h100-sxm"].hbm_bytes == 81559 * MiB
    assert HARDWARE["h200"].hbm_bytes == 143771 * MiB
    assert HARDWARE["b200"].hbm_bytes == 183359 * MiB


def test_cpu_takes_a_memory_size():
    assert get_hardware("cpu", memory_bytes="64GiB").hbm_bytes == 64 * GiB
    assert get_hardware("cpu:512MB").hbm_bytes == 512 * 10**6
    with pytest.raises(ValueError, match="--memory"):
        get_hardware("cpu")


def test_unknown_hardware_lists_the_valid_names():
    with pytest.raises(ValueError, match="tpu-v5e.*tpu-v6e.*h200.*cpu"):
        get_hardware("tpu-v9")


def test_bytes_parse_decimal_and_binary_units_apart():
    assert parse_bytes("16GB") == 16 * 10**9
    assert parse_bytes("16GiB") == 16 * 2**30
    assert parse_bytes("1.5 KiB") == 1536
    assert parse_bytes("1e9") == 10**9
    for bad in ("12 parsecs", "-4GiB", "0.5"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_reserve_forms():
    hbm = 32 * GiB
    assert Reserve.parse(None).bytes_for(hbm) == hbm // 10  # default: 10% of HBM, floored
    assert Reserve.parse("0.1").bytes_for(hbm) == hbm // 10
    assert Reserve.parse("10%").bytes_for(hbm) == hbm // 10
    assert Reserve.parse("4GiB").bytes_for(hbm) == 4 * GiB
    assert Reserve.parse(0).bytes_for(hbm) == 0
    for bad in ("1.5", "-0.1", "many"):
        with pytest.raises(ValueError):
            Reserve.parse(bad).bytes_for(hbm)


@pytest.mark.parametrize("context", [0, -5])
def test_context_must_be_positive(context):
    with pytest.raises(ValueError, match="positive"):
        budget(get_model_config("llama-3.1-8b"), QuantPlan(), Deployment.of("h100", 1), context)


def test_chips_must_divide_the_heads():
    # Llama-70B has 8 KV heads and 64 heads: 3 chips cannot split them; 1, 2, 4, 8 can.
    with pytest.raises(ValueError, match="valid chip counts are 1, 2, 4, 8"):
        budget(get_model_config("llama-3.1-70b"), QuantPlan(), Deployment.of("tpu-v6e", 3), 8)
    # Qwen2.5-7B has 4 KV heads: 8 chips would need to replicate them.
    with pytest.raises(ValueError, match="num_key_value_heads=4"):
        budget(get_model_config("qwen2.5-7b"), QuantPlan(), Deployment.of("tpu-v6e", 8), 8)


@pytest.mark.parametrize("chips", [0, -1])
def test_chips_must_be_positive(chips):
    with pytest.raises(ValueError, match="chips"):
        Deployment.of("tpu-v6e", chips)


def test_deployment_defaults():
    # A bare Deployment: one chip, 16-token pages, the default 10% reserve.
    dep = Deployment(HARDWARE["h200"])
    assert (dep.chips, dep.page_tokens) == (1, 16)
    assert dep.reserve_bytes_per_chip == 143771 * MiB // 10


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
