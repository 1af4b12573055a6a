"""Loading Hugging Face folders: name mapping, dtypes, streaming quantization, clear errors."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from tenantq.engine import Engine
from tenantq.model.loader import iter_checkpoint, load_params
from tenantq.numerics import QArray
from tenantq.quant.apply import apply_plan, load_quantized
from tenantq.quant.plan import QuantPlan, Rule
from tenantq.testing import hf_tensors, tiny_checkpoint


def test_bf16_checkpoint_loads_exactly(tmp_path, config, params):
    tiny_checkpoint(tmp_path, config, tensors=hf_tensors(config, params), shards=3)  # no index file
    loaded = load_params(tmp_path, config, dtype=jnp.bfloat16)
    assert set(loaded) == set(config.tensors())
    for path, value in params.items():
        assert loaded[path].dtype == jnp.bfloat16
        np.testing.assert_array_equal(
            np.asarray(loaded[path]), np.asarray(value.astype(jnp.bfloat16))
        )


def test_tensors_stream_one_at_a_time(tmp_path, make_config):
    # 8 layers of 256x256 MLP/attention weights (f32: 256 KiB each, 32 of them + embeddings):
    # peak traced memory while the stream is consumed stays within a few tensors, far below
    # the ~10 MiB the whole checkpoint holds, because each tensor is read only when asked for.
    import tracemalloc

    from tenantq.model.decoder import init_params

    config = make_config(
        hidden_size=256, intermediate_size=256, num_layers=8, num_heads=8, head_dim=32
    )
    params = init_params(config, seed=0)
    tiny_checkpoint(tmp_path, config, tensors=hf_tensors(config, params, dtype=np.float32))
    total_bytes = sum(int(np.prod(t.shape)) * 4 for t in config.tensors().values())
    largest_bytes = max(int(np.prod(t.shape)) * 4 for t in config.tensors().values())
    tracemalloc.start()
    for _path, array in iter_checkpoint(tmp_path, config):
        assert not array.flags.writeable
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert total_bytes > 9 * 2**20
    assert peak < 4 * largest_bytes, (peak, largest_bytes, total_bytes)


def test_streaming_quantized_load_equals_apply_plan(tmp_path, config, params):
    tiny_checkpoint(tmp_path, config, tensors=hf_tensors(config, params))
    plan = QuantPlan(
        rules=(Rule("layers/.*/mlp/.*", "int4", group_size=16), Rule(".*", "fp8_e4m3"))
    )
    streamed = load_quantized(tmp_path, config, plan)
    applied = apply_plan(load_params(tmp_path, config), plan, config)
    for path, value in applied.items():
        if isinstance(value, QArray):
            assert isinstance(streamed[path], QArray) and streamed[path].fmt == value.fmt
            np.testing.assert_array_equal(np.asarray(streamed[path].data), np.asarray(value.data))
            np.testing.assert_array_equal(np.asarray(streamed[path].scale), np.asarray(value.scale))


@pytest.mark.parametrize("model_type", ["gemma3_text", "phi3"])
def test_unsupported_model_type_names_the_supported_ones(tmp_path, config, params, model_type):
    tiny_checkpoint(
        tmp_path,
        config,
        tensors=hf_tensors(config, params),
        config_overrides={"model_type": model_type},
    )
    with pytest.raises(ValueError, match=rf"unsupported model_type '{model_type}'.*llama.*qwen3"):
        Engine.from_checkpoint(tmp_path)


def test_missing_tensor_names_it_and_the_files_searched(tmp_path, config, params):
    tensors = hf_tensors(config, params)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tiny_checkpoint(tmp_path, config, tensors=tensors)
    with pytest.raises(
        ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing.*model\.safetensors"
    ):
        load_params(tmp_path, config)


def test_misshaped_tensor_names_expected_and_found(tmp_path, config, params):
    tensors = hf_tensors(config, params)
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = np.ascontiguousarray(tensors[name].T)  # [in, out] instead of HF's [out, in]
    tiny_checkpoint(tmp_path, config, tensors=tensors)
    with pytest.raises(ValueError, match=r"k_proj.*shape \[32, 16\], expected \[16, 32\]"):
        load_params(tmp_path, config)


def test_unreadable_dtype_names_it_and_the_readable_ones(tmp_path, config, params):
    tensors = hf_tensors(config, params)
    tensors["model.norm.weight"] = np.ones(32, np.int8)
    tiny_checkpoint(tmp_path, config, tensors=tensors)
    with pytest.raises(
        ValueError, match=r"model\.norm\.weight has dtype I8.*readable: F64, F32, F16, BF16"
    ):
        load_params(tmp_path, config)


def test_unexpected_tensors_are_an_error_not_silently_dropped(tmp_path, config, params):
    tensors = hf_tensors(config, params)
    tensors["model.layers.0.mlp.up_proj.bias"] = np.zeros(64, np.float32)
    tiny_checkpoint(tmp_path, config, tensors=tensors)
    with pytest.raises(ValueError, match=r"does not use.*up_proj\.bias"):
        load_params(tmp_path, config)


def test_pickle_checkpoints_are_never_read(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match="no \\*.safetensors.*never read"):
        Engine.from_checkpoint(tmp_path)


def test_tokenizer_is_optional(tmp_path, config, params):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tiny_checkpoint(tmp_path, config, tensors=hf_tensors(config, params))
    engine = Engine.from_checkpoint(tmp_path, dtype="float32", max_seqs=1, max_seq_tokens=16)
    assert engine.tokenizer is None
    with pytest.raises(ValueError, match="no tokenizer.json"):
        engine.encode("hello")
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 5, "world": 9}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    engine = Engine.from_checkpoint(tmp_path, dtype="float32", max_seqs=1, max_seq_tokens=16)
    assert engine.encode("hello world") == [5, 9]
    assert engine.decode_text([9, 5]) == "world hello"
