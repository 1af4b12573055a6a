"""Built-in model configs, as the `config.json` bodies their publishers ship.

Each preset is the published file's shape-bearing fields, so it goes through the same
`ModelConfig.from_hf_dict` as a checkpoint folder would and cannot drift from it. Where a
published file leaves a field to the transformers default (Gemma 3's text_config omits
vocab_size, max_position_embeddings and, for 12B, head_dim), the default is written out
and marked. Other packages add presets that are checkpoint folders (the reference model
registers `tenantq-ref`) with `register_preset` or the `tenantq.model_presets` entry-point
group; this module reads the folder it is given and knows no package by path.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from tenantq.model.config import ModelConfig

_LLAMA31_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}

PRESETS: dict[str, dict[str, Any]] = {
    # huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json (8.03B parameters).
    "llama-3.1-8b": {
        "_name_or_path": "meta-llama/Llama-3.1-8B",
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA31_ROPE,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json (70.6B parameters).
    "llama-3.1-70b": {
        "_name_or_path": "meta-llama/Llama-3.1-70B",
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA31_ROPE,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # huggingface.co/mistralai/Mistral-7B-v0.3/blob/main/config.json (7.25B parameters);
    # v0.3 has no sliding window (sliding_window: null) and a 32,768-token vocabulary.
    "mistral-7b": {
        "_name_or_path": "mistralai/Mistral-7B-v0.3",
        "model_type": "mistral",
        "vocab_size": 32768,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json (7.61B parameters); q/k/v carry
    # biases (Qwen2), use_sliding_window is false so every layer attends in full.
    "qwen2.5-7b": {
        "_name_or_path": "Qwen/Qwen2.5-7B",
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "max_window_layers": 28,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    },
    # huggingface.co/Qwen/Qwen3-8B/blob/main/config.json (8.2B parameters, 6.95B non-embedding).
    "qwen3-8b": {
        "_name_or_path": "Qwen/Qwen3-8B",
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "use_sliding_window": False,
        "max_window_layers": 36,
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # huggingface.co/Qwen/Qwen3-32B/blob/main/config.json (32.8B parameters).
    "qwen3-32b": {
        "_name_or_path": "Qwen/Qwen3-32B",
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "use_sliding_window": False,
        "max_window_layers": 64,
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # huggingface.co/google/gemma-3-12b-it/blob/main/config.json: the decoder sits under
    # text_config. Gemma 3 technical report, table 1: 12B = 1,012M embedding + 10,759M
    # non-embedding parameters (+417M vision encoder, not counted here). Five local
    # (sliding, 1,024-token window) layers to one global, tied embeddings.
    "gemma-3-12b": {
        "_name_or_path": "google/gemma-3-12b-it",
        "model_type": "gemma3",
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 3840,
            "intermediate_size": 15360,
            "num_hidden_layers": 48,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "sliding_window": 1024,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            # transformers Gemma3TextConfig defaults, omitted by the published file:
            "head_dim": 256,
            "vocab_size": 262208,
            "max_position_embeddings": 131072,
            "rope_theta": 1000000.0,
            "sliding_window_pattern": 6,
            "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-6,
        },
        "tie_word_embeddings": True,
    },
    # huggingface.co/google/gemma-3-27b-it/blob/main/config.json (text_config). Gemma 3
    # technical report, table 1: 27B = 1,416M embedding + 25,600M non-embedding parameters.
    "gemma-3-27b": {
        "_name_or_path": "google/gemma-3-27b-it",
        "model_type": "gemma3",
        "text_config": {
            "model_type": "gemma3_text",
            "head_dim": 128,
            "hidden_size": 5376,
            "intermediate_size": 21504,
            "num_hidden_layers": 62,
            "num_attention_heads": 32,
            "num_key_value_heads": 16,
            "query_pre_attn_scalar": 168,
            "sliding_window": 1024,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            # transformers Gemma3TextConfig defaults, omitted by the published file:
            "vocab_size": 262208,
            "max_position_embeddings": 131072,
            "rope_theta": 1000000.0,
            "sliding_window_pattern": 6,
            "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-6,
        },
        "tie_word_embeddings": True,
    },
}

# Published parameter counts (decoder only) the presets are checked against, with sources.
PUBLISHED_PARAMS: dict[str, float] = {
    "llama-3.1-8b": 8.03e9,  # HF model page, "Model size 8.03B params"
    "llama-3.1-70b": 70.6e9,  # HF model page, "Model size 70.6B params"
    "mistral-7b": 7.25e9,  # HF model page, "Model size 7.25B params"
    "qwen2.5-7b": 7.61e9,  # Qwen2.5-7B model card, "Number of Parameters: 7.61B"
    "qwen3-8b": 8.2e9,  # Qwen3-8B model card, "Number of Parameters: 8.2B"
    "qwen3-32b": 32.8e9,  # Qwen3-32B model card, "Number of Parameters: 32.8B"
    "gemma-3-12b": 1.012e9 + 10.759e9,  # Gemma 3 tech report, table 1 (text only)
    "gemma-3-27b": 1.416e9 + 25.600e9,  # Gemma 3 tech report, table 1 (text only)
}

# Entry points in this group name a preset and point at a callable returning its folder
# (or config.json); tenantq's own pyproject declares `tenantq-ref` there.
ENTRY_POINT_GROUP = "tenantq.model_presets"
# name -> callable giving the checkpoint folder (or config.json) of a registered preset.
_FOLDER_PRESETS: dict[str, Callable[[], str | Path]] = {}


def register_preset(name: str, folder: Callable[[], str | Path] | str | Path) -> None:
    """Make `name` a preset read from a checkpoint folder (a callable is called lazily)."""
    key = name.strip().lower()
    if key in PRESETS:
        raise ValueError(f"preset {key!r} is built in; choose another name")
    _FOLDER_PRESETS[key] = folder if callable(folder) else (lambda: folder)


def _folder_presets() -> dict[str, Callable[[], str | Path]]:
    """Registered presets, plus those installed packages declare as entry points."""
    found = {ep.name.lower(): ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    for name, ep in found.items():
        _FOLDER_PRESETS.setdefault(name, lambda ep=ep: ep.load()())
    return _FOLDER_PRESETS


def model_names() -> list[str]:
    """Built-in preset names, then registered ones."""
    return [*PRESETS, *sorted(_folder_presets())]


def get_model_config(name_or_path: str | Path) -> ModelConfig:
    """A preset by name (built in or registered), or any HF `config.json` (or its folder)."""
    key = str(name_or_path).strip()
    if key.lower() in PRESETS:
        return ModelConfig.from_hf_dict(PRESETS[key.lower()], source=f"preset {key.lower()}")
    registered = _folder_presets().get(key.lower())
    if registered is not None:
        return ModelConfig.from_file(registered())
    path = Path(key).expanduser()
    if path.exists() or key.endswith(".json") or "/" in key:
        return ModelConfig.from_file(path)
    raise ValueError(
        f"unknown model {key!r}; valid presets: {', '.join(model_names())} "
        "(or a path to a config.json / checkpoint folder)"
    )
