"""A one-layer Llama checkpoint written by hand in the Hugging Face layout.

Names and shapes are spelled out here, not derived from the loader's `hf_names()`, so a
loader that maps or transposes a tensor wrongly cannot agree with this fixture by
construction. HF stores every linear weight `[out, in]`; the shapes are chosen so that no
projection is square (hidden 6, 2 heads x 4 = 8 attention width, 1 KV head, MLP 12) and a
wrong transpose shows both as a shape and as values.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

CONFIG = {
    "model_type": "llama",
    "vocab_size": 16,
    "hidden_size": 6,
    "intermediate_size": 12,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "max_position_embeddings": 32,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# HF name -> HF shape ([out, in] for linear weights).
HF_SHAPES = {
    "model.embed_tokens.weight": (16, 6),
    "model.layers.0.input_layernorm.weight": (6,),
    "model.layers.0.self_attn.q_proj.weight": (8, 6),
    "model.layers.0.self_attn.k_proj.weight": (4, 6),
    "model.layers.0.self_attn.v_proj.weight": (4, 6),
    "model.layers.0.self_attn.o_proj.weight": (6, 8),
    "model.layers.0.post_attention_layernorm.weight": (6,),
    "model.layers.0.mlp.gate_proj.weight": (12, 6),
    "model.layers.0.mlp.up_proj.weight": (12, 6),
    "model.layers.0.mlp.down_proj.weight": (6, 12),
    "model.norm.weight": (6,),
    "lm_head.weight": (16, 6),
}

# Engine path -> (HF name, the engine holds the HF tensor transposed), written out by hand.
ENGINE_FROM_HF = {
    "embed": ("model.embed_tokens.weight", False),
    "layers/0/input_norm": ("model.layers.0.input_layernorm.weight", False),
    "layers/0/attn/q_proj": ("model.layers.0.self_attn.q_proj.weight", True),
    "layers/0/attn/k_proj": ("model.layers.0.self_attn.k_proj.weight", True),
    "layers/0/attn/v_proj": ("model.layers.0.self_attn.v_proj.weight", True),
    "layers/0/attn/o_proj": ("model.layers.0.self_attn.o_proj.weight", True),
    "layers/0/post_attn_norm": ("model.layers.0.post_attention_layernorm.weight", False),
    "layers/0/mlp/gate_proj": ("model.layers.0.mlp.gate_proj.weight", True),
    "layers/0/mlp/up_proj": ("model.layers.0.mlp.up_proj.weight", True),
    "layers/0/mlp/down_proj": ("model.layers.0.mlp.down_proj.weight", True),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}

NP_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


def hf_tensors(seed: int = 0, dtype: str = "BF16") -> dict[str, np.ndarray]:
    """Distinct random values per tensor (norms near 1), stored in `dtype`."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in HF_SHAPES.items():
        value = rng.standard_normal(shape).astype(np.float32)
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * value
        out[name] = value.astype(NP_DTYPES[dtype])
    return out


def raw_file(tensors: dict[str, np.ndarray], dtype: str = "BF16") -> tuple[dict, bytes]:
    """(header dict, data buffer) of a safetensors file, built by hand from the spec."""
    header, chunks, cursor = {}, [], 0
    for name, value in tensors.items():
        data = np.ascontiguousarray(value).tobytes()
        header[name] = {
            "dtype": dtype,
            "shape": list(value.shape),
            "data_offsets": [cursor, cursor + len(data)],
        }
        chunks.append(data)
        cursor += len(data)
    return header, b"".join(chunks)


def write_raw(path: Path, header, data: bytes, *, header_len: int | None = None) -> Path:
    """Write a safetensors file byte by byte: `header` is JSON-encoded unless it is bytes."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(text) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", length) + text + data)
    return path


def write_checkpoint(folder: Path, *, seed: int = 0, config: dict | None = None) -> dict:
    """config.json + model.safetensors in `folder`; returns the HF tensors written."""
    tensors = hf_tensors(seed)
    header, data = raw_file(tensors)
    write_raw(folder / "model.safetensors", header, data)
    (folder / "config.json").write_text(json.dumps(config or CONFIG))
    return tensors
