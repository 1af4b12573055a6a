"""Logits parity with the `transformers` reference, in float32, for every architecture.

Each case builds a tiny random model with `transformers` (weights widened from the
default init so that logits are O(1) and errors are visible), saves it as safetensors,
loads the folder with tenantq and compares logits on the same token ids: a full batched
prefill of ragged rows, and token-by-token decode through the engine's cache. The bound
1e-4 is float32 round-off accumulated over a few layers (the issue's figure).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="parity needs CPU torch (the `parity` extra)")
transformers = pytest.importorskip("transformers", reason="parity needs `transformers`")

from tenantq.engine import Engine  # noqa: E402

pytestmark = pytest.mark.parity

TOLERANCE = 1e-4
SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 500000.0,
}
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3_tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True},
    ),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 5}),
    "qwen2_bias": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1e6}),
    "qwen3_qk_norm": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "num_hidden_layers": 3}),
}
PROMPTS = [[5, 17, 99, 3, 64, 12, 7, 88, 41, 2, 120, 33], [9, 45, 101, 6, 77, 30, 14]]


def build_reference(case: str, folder, **save_options):
    """A random float32 `transformers` model for `case`, saved to `folder`; returns it."""
    config_cls, model_cls, extra = CASES[case]
    config = getattr(transformers, config_cls)(**{**SMALL, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval().to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(folder, **save_options)
    return model


def reference_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_and_decode_match_transformers(case, tmp_path):
    model = build_reference(case, tmp_path)
    engine = Engine.from_checkpoint(tmp_path, dtype="float32", max_seqs=2, max_seq_tokens=32)
    assert engine.tokenizer is None  # no tokenizer.json saved: ids in, logits out
    expected = [reference_logits(model, p) for p in PROMPTS]

    got = engine.logits(PROMPTS)  # ragged batch: right padding, per-row positions
    for row, want in enumerate(expected):
        np.testing.assert_allclose(got[row, : len(want)], want, atol=TOLERANCE, rtol=0)

    start = 3  # prefill 3 tokens, then decode the rest one at a time through the cache
    batch, last = engine.prefill([p[:start] for p in PROMPTS], reserve_tokens=len(PROMPTS[0]))
    try:
        for row, want in enumerate(expected):
            np.testing.assert_allclose(last[row], want[start - 1], atol=TOLERANCE, rtol=0)
        for t in range(start, len(PROMPTS[0])):
            live = [p[t] if t < len(p) else 0 for p in PROMPTS]
            step = engine.decode(batch, live)
            for row, want in enumerate(expected):
                if t < len(PROMPTS[row]):
                    np.testing.assert_allclose(step[row], want[t], atol=TOLERANCE, rtol=0)
    finally:
        engine.release(batch)


def test_sharded_checkpoint_loads_the_same(tmp_path):
    model = build_reference("llama", tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    engine = Engine.from_checkpoint(tmp_path, dtype="float32", max_seqs=1, max_seq_tokens=16)
    got = engine.logits([PROMPTS[1]])[0]
    np.testing.assert_allclose(got, reference_logits(model, PROMPTS[1]), atol=TOLERANCE, rtol=0)
