"""Llama 3.1 RoPE frequency scaling checked against the published formula, without torch.

Meta's Llama 3.1 reference (`apply_scaling` in meta-llama/llama-models' model code; the
same rule HF calls rope_type "llama3") rescales each inverse frequency f_j of RoPE
(f_j = theta^(-2j/d), Su et al. 2021) by its wavelength w = 2 pi / f:
  w < L / high_freq_factor   -> f                      (short wavelengths kept)
  w > L / low_freq_factor    -> f / factor             (long wavelengths slowed)
  otherwise                  -> (1 - s) f / factor + s f,  s = (L / w - low) / (high - low)
with L = original_max_position_embeddings. The transformers parity test covers this only
with the torch extra; this one needs only numpy, and is evaluated per frequency with the
branches as written, independent of the engine's vectorised form.
"""

from __future__ import annotations

import math

import numpy as np

from tenantq.model.config import ModelConfig
from tenantq.model.layers import rope_inv_freq

# Llama-3.1-8B's published config: head_dim 128, theta 500,000, factor 8, low 1, high 4,
# original context 8,192 (so the band edges are wavelengths 2,048 and 8,192).
SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# Float32 rounding: theta^(-2j/d) and the interpolation computed in float32 (as HF does)
# differ from float64 by a few ulps, 2^-23 ~ 1.2e-7 each; the band choices differ by
# factors between 1 and 8, so 2e-6 relative separates right from wrong by 5 orders.
RTOL = 2e-6


def _config(scaling=SCALING) -> ModelConfig:
    return ModelConfig.from_hf_dict(
        {
            "model_type": "llama", "vocab_size": 64, "hidden_size": 256,
            "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 128, "max_position_embeddings": 131072,
            "rope_theta": 500000.0, "rope_scaling": scaling,
        }
    )  # fmt: skip


def _meta_llama3(freq: float, factor: float, low: float, high: float, old: float) -> float:
    wavelen = 2 * math.pi / freq
    if wavelen < old / high:
        return freq
    if wavelen > old / low:
        return freq / factor
    smooth = (old / wavelen - low) / (high - low)
    return (1 - smooth) * freq / factor + smooth * freq


def test_llama3_scaled_inverse_frequencies_follow_the_published_formula() -> None:
    got = rope_inv_freq(_config())
    assert got.shape == (64,) and got.dtype == np.float32
    want = [_meta_llama3(500000.0 ** (-2 * j / 128), 8.0, 1.0, 4.0, 8192.0) for j in range(64)]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=0)


def test_hand_computed_frequencies_on_each_band() -> None:
    got = rope_inv_freq(_config())
    # j = 0: f = 1, w = 2 pi < 2,048: kept.
    # j = 28: f = 5e5^(-56/128) = 3.21145e-3, w = 1,956.5 < 2,048: kept.
    # j = 29: f = 2.61610e-3, w = 2,401.7: s = (8192/2401.7 - 1)/3 = 0.803621,
    #         f' = f (0.196379/8 + 0.803621) = 2.16657e-3.
    # j = 32: f = 5e5^(-1/2) = 1.41421e-3, w = 4,442.9: s = 0.281283,
    #         f' = f (0.718717/8 + 0.281283) = 5.24846e-4.
    # j = 34: f = 9.38474e-4, w = 6,695.1: s = 0.0745266, f' = 1.78508e-4.
    # j = 35: f = 7.64497e-4, w = 8,218.7 > 8,192: f / 8 = 9.55621e-5.
    # j = 63: f = 5e5^(-126/128) = 2.45514e-6, w ~ 2.56e6: f / 8 = 3.06893e-7.
    hand = {0: 1.0, 28: 3.21145e-3, 29: 2.16657e-3, 32: 5.24846e-4, 34: 1.78508e-4,
            35: 9.55621e-5, 63: 3.06893e-7}  # fmt: skip
    for j, value in hand.items():
        assert math.isclose(got[j], value, rel_tol=1e-5), (j, float(got[j]), value)


def test_no_scaling_is_plain_rope() -> None:
    got = rope_inv_freq(_config(None))
    want = [500000.0 ** (-2 * j / 128) for j in range(64)]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=0)
