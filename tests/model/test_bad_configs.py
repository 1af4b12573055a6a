"""config.json boundary: each impossible or mistyped value is one `ValueError` naming the
file, the field as config.json spells it, and its valid range; none loads silently.

The ranges come from the arithmetic the values feed: RoPE computes theta^(-2j/d) (theta
must be > 0), RMSNorm divides by sqrt(mean + eps) (eps >= 0), heads divide the width, token
ids index the vocabulary, and Llama 3.1 scaling divides by factor and by
high_freq_factor - low_freq_factor (Meta's `apply_scaling`).
"""

from __future__ import annotations

import json

import pytest
from hand_checkpoint import CONFIG

from tenantq.model.config import ModelConfig

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

# (case id, fields changed, regex: the field named and its valid range)
CASES = [
    ("rope_theta 0", {"rope_theta": 0}, r"rope_theta must be a finite number > 0.*got 0"),
    ("rope_theta negative", {"rope_theta": -1e4}, r"rope_theta must be a finite number > 0"),
    ("rope_theta a string", {"rope_theta": "1e4"}, r"rope_theta must be a finite number > 0"),
    (
        "rms_norm_eps negative",
        {"rms_norm_eps": -1e-5},
        r"rms_norm_eps must be a finite number >= 0",
    ),
    ("rms_norm_eps a string", {"rms_norm_eps": "1e-5"}, r"rms_norm_eps must be a finite number"),
    (
        "num_attention_heads 0",
        {"num_attention_heads": 0},
        r"num_attention_heads must be an integer >= 1, got 0",
    ),
    (
        "num_key_value_heads negative",
        {"num_key_value_heads": -2},
        r"num_key_value_heads must be an integer >= 1, got -2",
    ),
    (
        "num_hidden_layers 0",
        {"num_hidden_layers": 0},
        r"num_hidden_layers must be an integer >= 1, got 0",
    ),
    ("hidden_size fractional", {"hidden_size": 6.5}, r"hidden_size must be an integer >= 1"),
    ("vocab_size a string", {"vocab_size": "16"}, r"vocab_size must be an integer >= 1.*string"),
    (
        "max_position_embeddings negative",
        {"max_position_embeddings": -1},
        r"max_position_embeddings must be an integer >= 1, got -1",
    ),
    (
        "tie_word_embeddings a string",
        {"tie_word_embeddings": "false"},
        r"tie_word_embeddings must be true or false, got 'false' \(string\)",
    ),
    (
        "eos_token_id outside the vocabulary",
        {"eos_token_id": 16},
        r"eos_token_id 16 is not a token id; valid ids are integers 0\.\.15",
    ),
    (
        "bos_token_id negative",
        {"bos_token_id": -1},
        r"bos_token_id -1 is not a token id; valid ids are integers 0\.\.15",
    ),
    (
        "llama3 factor 0",
        {"rope_scaling": {**LLAMA3, "factor": 0}},
        r"rope_scaling factor must be a finite number > 0",
    ),
    (
        "llama3 high <= low frequency factor",
        {"rope_scaling": {**LLAMA3, "high_freq_factor": 1.0}},
        r"high_freq_factor must exceed low_freq_factor",
    ),
    (
        "llama3 field missing",
        {"rope_scaling": {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}},
        r"llama3 rope_scaling lacks \['low_freq_factor'\]; it needs",
    ),
    (
        "rope_scaling a string",
        {"rope_scaling": "llama3"},
        r"rope_scaling must be an object such as \{\"rope_type\": \"llama3\"",
    ),
    (
        "mistral sliding_window negative",
        {"model_type": "mistral", "sliding_window": -4},
        r"sliding layers need sliding_window, an integer >= 1 \(tokens\), got -4",
    ),
    (
        "heads not a multiple of KV heads",
        {"num_key_value_heads": 3, "num_attention_heads": 4},
        r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)",
    ),
]


@pytest.mark.parametrize(("change", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_config_value_names_field_and_range(tmp_path, change, message):
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, **change}))
    with pytest.raises(ValueError, match=rf"config\.json: .*(?:{message})"):
        ModelConfig.from_file(tmp_path)


@pytest.mark.parametrize(
    ("text", "kind"),
    [("[" + json.dumps(CONFIG) + "]", "array"), ('"llama"', "string"), ("7", "number")],
    ids=["JSON list", "JSON string", "JSON number"],
)
def test_config_that_is_not_an_object_is_named(tmp_path, text, kind):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(
        ValueError,
        match=rf"config\.json: expected a JSON object of model fields .* got a JSON {kind}",
    ):
        ModelConfig.from_file(tmp_path)


def test_nan_in_config_json_is_refused(tmp_path):
    # Python's json module reads the non-standard literal NaN: it must not reach RoPE.
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "rope_theta": float("nan")}))
    assert "NaN" in (tmp_path / "config.json").read_text()
    with pytest.raises(ValueError, match=r"rope_theta must be a finite number > 0.*nan"):
        ModelConfig.from_file(tmp_path)


def test_the_hand_written_config_itself_is_valid():
    # The table above changes one field at a time from this config, so each error is due to
    # that field alone.
    config = ModelConfig.from_hf_dict(CONFIG)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (2, 1, 4)
