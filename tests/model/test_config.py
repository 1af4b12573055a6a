"""ModelConfig reads HF config.json faithfully and rejects what it cannot describe."""

from __future__ import annotations

import json

import pytest

from tenantq.model.config import ModelConfig

LLAMA = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "tie_word_embeddings": True,
}


def test_reads_fields_and_derives_head_dim() -> None:
    cfg = ModelConfig.from_hf_dict(LLAMA)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (2, 4, 2)
    assert cfg.head_dim == 64 // 4  # head_dim absent: hidden / heads, as HF does
    assert cfg.rope_scaling["factor"] == 8.0
    assert cfg.q_per_kv == 2


def test_round_trip_through_hf_dict() -> None:
    cfg = ModelConfig.from_hf_dict(LLAMA)
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg


def test_tensor_inventory_counts_tied_embedding_once() -> None:
    cfg = ModelConfig.from_hf_dict(LLAMA)
    tensors = cfg.tensors()
    assert "lm_head" not in tensors  # tied: the embedding serves both ends
    assert tensors["layers/1/attn/k_proj"].shape == (64, 2 * 16)  # [in, out], kv_heads*head_dim
    assert tensors["embed"].quant_axis == 1 and tensors["layers/0/mlp/down_proj"].quant_axis == 0
    # embed + 2 layers x (4 attn + 3 mlp + 2 norms) + final norm
    assert len(tensors) == 1 + 2 * 9 + 1
    untied = ModelConfig.from_hf_dict({**LLAMA, "tie_word_embeddings": False})
    assert untied.param_count() - cfg.param_count() == 128 * 64


def test_qwen2_has_qkv_bias_and_qwen3_has_qk_norm() -> None:
    qwen2 = ModelConfig.from_hf_dict({**LLAMA, "model_type": "qwen2", "rope_scaling": None})
    t2 = qwen2.tensors()
    assert "layers/0/attn/q_bias" in t2 and "layers/0/attn/o_bias" not in t2
    qwen3 = ModelConfig.from_hf_dict({**LLAMA, "model_type": "qwen3", "rope_scaling": None})
    t3 = qwen3.tensors()
    assert "layers/0/attn/k_norm" in t3 and "layers/0/attn/q_bias" not in t3


def test_gemma3_pattern_and_window_cap() -> None:
    raw = {
        "model_type": "gemma3",
        "text_config": {
            **{k: v for k, v in LLAMA.items() if k not in ("model_type", "rope_scaling")},
            "model_type": "gemma3_text",
            "num_hidden_layers": 12,
            "sliding_window": 32,
            "head_dim": 16,
        },
    }
    cfg = ModelConfig.from_hf_dict(raw)
    # 5 local : 1 global (sliding_window_pattern 6): layers 5 and 11 are global.
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full"] == [5, 11]
    assert cfg.layer_kv_tokens(0, 1000) == 32 and cfg.layer_kv_tokens(5, 1000) == 1000


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
        ({"hidden_size": None}, "missing required field 'hidden_size'"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
    ],
)
def test_bad_configs_name_the_problem(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict({**LLAMA, **change})


def test_from_file_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)


def test_every_known_model_type_has_exactly_one_architecture_adapter() -> None:
    # from_hf_dict reads what differs by model_type from ARCHITECTURES; a type known to the
    # planner without an adapter would fail with a KeyError instead of a config error.
    from tenantq.model.config import ARCHITECTURES, KNOWN_MODEL_TYPES

    assert tuple(ARCHITECTURES) == KNOWN_MODEL_TYPES


@pytest.mark.parametrize(
    ("model_type", "tied", "bias", "qk_norm"),
    [  # the defaults of transformers' config classes for a field config.json leaves out
        ("llama", False, False, False),
        ("mistral", False, False, False),
        ("qwen2", False, True, False),  # Qwen2's q/k/v projections always carry biases
        ("qwen3", False, False, True),
        ("gemma3_text", True, False, True),  # Gemma3TextConfig(tie_word_embeddings=True)
    ],
)
def test_each_architecture_fills_the_fields_a_file_leaves_out_its_own_way(
    model_type: str, tied: bool, bias: bool, qk_norm: bool
) -> None:
    raw = {k: v for k, v in LLAMA.items() if k not in ("tie_word_embeddings", "rope_scaling")}
    cfg = ModelConfig.from_hf_dict({**raw, "model_type": model_type})
    assert (cfg.tie_word_embeddings, cfg.attention_bias, cfg.qk_norm) == (tied, bias, qk_norm)
    # the file's own value wins over the architecture's default
    flipped = ModelConfig.from_hf_dict(
        {
            **raw,
            "model_type": model_type,
            "tie_word_embeddings": not tied,
            "attention_bias": not bias,
        }
    )
    assert (flipped.tie_word_embeddings, flipped.attention_bias) == (not tied, not bias)


@pytest.mark.parametrize(
    ("model_type", "extra", "sliding"),
    [  # which layers slide when config.json has a sliding_window but no layer_types
        ("llama", {}, []),  # llama ignores sliding_window
        ("mistral", {}, [0, 1, 2, 3, 4, 5]),  # every layer
        ("mistral", {"sliding_window": None}, []),  # Mistral v0.2+: null, no sliding
        ("qwen2", {}, []),  # use_sliding_window absent: off
        ("qwen2", {"use_sliding_window": True, "max_window_layers": 4}, [4, 5]),
        ("qwen3", {"use_sliding_window": True}, []),  # max_window_layers absent: all full
        ("gemma3_text", {}, [0, 1, 2, 3, 4]),  # 5 local : 1 global
        ("gemma3_text", {"sliding_window_pattern": 3}, [0, 1, 3, 4]),
    ],
)
def test_each_architecture_says_which_layers_slide_without_layer_types(
    model_type: str, extra: dict, sliding: list[int]
) -> None:
    raw = {k: v for k, v in LLAMA.items() if k != "rope_scaling"}
    raw = {**raw, "model_type": model_type, "num_hidden_layers": 6, "sliding_window": 32}
    cfg = ModelConfig.from_hf_dict({**raw, **extra})
    assert [i for i, t in enumerate(cfg.layer_types) if t == "sliding"] == sliding


def test_rope_scaling_is_checked_only_for_architectures_the_engine_runs() -> None:
    linear = {"rope_type": "linear", "factor": 8.0}  # Gemma 3 4B+'s global layers
    for model_type in ("llama", "mistral", "qwen2", "qwen3"):
        with pytest.raises(ValueError, match=r"rope_scaling type 'linear' is not supported"):
            ModelConfig.from_hf_dict({**LLAMA, "model_type": model_type, "rope_scaling": linear})
    gemma = ModelConfig.from_hf_dict({**LLAMA, "model_type": "gemma3_text", "rope_scaling": linear})
    assert gemma.rope_scaling["rope_type"] == "linear"  # planned, not run by the engine
