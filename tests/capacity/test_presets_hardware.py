"""Presets against their published sizes and fields; hardware figures; bad input is explained."""

from __future__ import annotations

import json

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
)
from tenantq.capacity.presets import PUBLISHED_PARAMS
from tenantq.capacity.units import GiB, MiB
from tenantq.quant.plan import QuantPlan


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
