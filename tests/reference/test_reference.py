"""The shipped reference model: its layout, its data pipeline, and that it really learned.

Tests load the shipped checkpoint and never retrain it; one trains a tiny model a few
steps to show the trainer runs and its loss falls.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from tenantq import testing
from tenantq.model.config import ModelConfig
from tenantq.model.decoder import forward as _forward
from tenantq.reference import corpus, needles, reference_model_path
from tenantq.reference.export import read_hf_checkpoint, write_hf_checkpoint
from tenantq.reference.train import init_params

MODEL = reference_model_path()
# The model package's cacheless forward, compiled (config is a frozen, hashable dataclass).
forward = jax.jit(_forward, static_argnums=(1,))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(MODEL / "tokenizer.json"))


@pytest.fixture(scope="module")
def valid_ids(tokenizer) -> np.ndarray:
    from tenantq.reference.evaluate import split_ids

    return split_ids(tokenizer, "valid")


def tiny_config(**overrides) -> ModelConfig:
    """The shared tiny model with the shipped tokenizer's 2,048-id vocabulary."""
    return testing.tiny_config(**{"vocab_size": 2048, "rms_norm_eps": 1e-5, **overrides})


# ------------------------------------------------------------------ corpus and needles
def test_split_is_by_file_disjoint_and_covers_the_stdlib():
    c = corpus.load_corpus()
    files = [f for s in corpus.SPLITS for f in c.files[s]]
    assert len(files) == len(set(files)) == len(corpus.stdlib_files())
    # 5% / 5% of ~700 files: each held-out split has a few dozen files (binomial spread).
    for split in ("valid", "test"):
        assert 10 <= len(c.files[split]) <= 80
    # Every listed file sits in the split the rule gives it, and the rule itself is pinned: if
    # the seeded hash changed, the card's held-out figures would be measured on training files.
    for split in corpus.SPLITS:
        assert all(corpus.split_of(f) == split for f in c.files[split]), split
    pinned = {
        "asyncio/windows_events.py": "valid",
        "argparse.py": "test",
        "asyncio/__init__.py": "test",
        "json/decoder.py": "train",
        "typing.py": "train",
    }
    assert {f: corpus.split_of(f) for f in pinned} == pinned  # fmt: skip
    assert not any("/test/" in f or f.startswith("test/") for f in files)


def test_needle_prompt_has_exact_length_and_ends_with_the_needle_prefix(tokenizer, valid_ids):
    rng = np.random.default_rng(0)
    for length, depth in ((64, 0.0), (300, 0.5), (1024, 1.0)):
        prompt, answer = needles.make_needle_example(tokenizer, valid_ids, length, depth, rng)
        assert prompt.shape == (length,) and prompt[0] == tokenizer.token_to_id("<|bos|>")
        assert len(answer) == needles.VALUE_DIGITS  # one token per digit
        text = tokenizer.decode(prompt.tolist())
        key = text.rsplit("\n", 1)[-1]  # "PASSKEY_XXXX = "
        value = tokenizer.decode(answer.tolist())
        assert f"{key}{value}\n" in text
        # The query repeats the needle's tokens exactly up to the value: pure retrieval.
        needle = tokenizer.encode(needles.needle_text(key[8:12], int(value))).ids
        query = tokenizer.encode(key).ids
        assert needle[: len(query)] == query
    assert needles.needle_correct(np.r_[answer, 7], answer)
    assert not needles.needle_correct(answer[:-1], answer)


# ------------------------------------------------------------------ export layout
def _numpy_llama(hf: dict, config: ModelConfig, ids: np.ndarray) -> np.ndarray:
    """Independent float64 reference reading the HF-layout tensors ([out, in])."""

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + config.rms_norm_eps) * w

    f = {k: np.asarray(v, np.float64) for k, v in hf.items()}
    seq, hd, nh, nkv = len(ids), config.head_dim, config.num_heads, config.num_kv_heads
    inv = 1.0 / config.rope_theta ** (np.arange(0, hd, 2) / hd)
    ang = np.arange(seq)[:, None] * inv
    cos, sin = np.cos(np.r_["1", ang, ang]), np.sin(np.r_["1", ang, ang])

    def rope(x):  # [seq, heads, hd]
        rot = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
        return x * cos[:, None] + rot * sin[:, None]

    x = f["model.embed_tokens.weight"][ids]
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        h = norm(x, f[f"{p}.input_layernorm.weight"])
        q = rope((h @ f[f"{p}.self_attn.q_proj.weight"].T).reshape(seq, nh, hd))
        k = rope((h @ f[f"{p}.self_attn.k_proj.weight"].T).reshape(seq, nkv, hd))
        v = (h @ f[f"{p}.self_attn.v_proj.weight"].T).reshape(seq, nkv, hd)
        k, v = np.repeat(k, nh // nkv, 1), np.repeat(v, nh // nkv, 1)
        s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        s = np.where(np.tril(np.ones((seq, seq), bool)), s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", pr, v).reshape(seq, nh * hd)
        x = x + o @ f[f"{p}.self_attn.o_proj.weight"].T
        h = norm(x, f[f"{p}.post_attention_layernorm.weight"])
        g = h @ f[f"{p}.mlp.gate_proj.weight"].T
        u = h @ f[f"{p}.mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ f[f"{p}.mlp.down_proj.weight"].T
    return norm(x, f["model.norm.weight"]) @ f["lm_head.weight"].T


def test_export_round_trips_and_matches_an_independent_hf_layout_reference(tmp_path, tokenizer):
    config = tiny_config()
    params = init_params(config, seed=3)
    params = {k: v * 5 if v.ndim == 2 else v + 0.1 for k, v in params.items()}  # non-trivial
    write_hf_checkpoint(tmp_path, params, config, tokenizer)
    back, config_back, _ = read_hf_checkpoint(tmp_path)
    assert config_back == config
    for k, v in params.items():  # bf16 storage: exact to bf16 rounding, nothing else
        expect = np.asarray(v).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(back[k]), expect)
    ids = np.random.default_rng(0).integers(0, 2048, 40)
    ours = np.asarray(forward(back, config, jnp.asarray(ids)[None]))[0]
    ref = _numpy_llama(load_file(str(tmp_path / "model.safetensors")), config, ids)
    # float32 vs float64 over 2 layers: agreement to ~1e-5 relative of logit scale.
    np.testing.assert_allclose(ours, ref, atol=1e-4 * np.abs(ref).max(), rtol=0)


def test_packed_segments_equal_separate_documents():
    config = tiny_config()
    params = init_params(config, seed=1)
    a, b = np.arange(3, 13), np.arange(20, 26)
    packed = forward(
        params,
        config,
        jnp.asarray(np.r_[a, b])[None],
        segments=jnp.asarray(np.r_[[1] * 10, [2] * 6])[None],
        positions=jnp.asarray(np.r_[np.arange(10), np.arange(6)])[None],
    )
    alone_b = forward(params, config, jnp.asarray(b)[None])
    alone_a = forward(params, config, jnp.asarray(a)[None])
    # Same float32 ops on the same values, only extra masked keys: ~1e-6 of the logit scale.
    np.testing.assert_allclose(np.asarray(packed[0, 10:]), np.asarray(alone_b[0]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(packed[0, :10]), np.asarray(alone_a[0]), atol=1e-5)
    # Without the segment mask the second document would see the first: the mask matters.
    leaky = forward(
        params,
        config,
        jnp.asarray(np.r_[a, b])[None],
        positions=jnp.asarray(np.r_[np.arange(10), np.arange(6)])[None],
    )
    assert np.abs(np.asarray(leaky[0, 10:]) - np.asarray(alone_b[0])).max() > 1e-3


# ------------------------------------------------------------------ the shipped model
def test_shipped_checkpoint_layout():
    cfg_raw = json.loads((MODEL / "config.json").read_text())
    config = ModelConfig.from_hf_dict(cfg_raw)
    assert config.model_type == "llama" and config.num_layers >= 4
    assert config.num_kv_heads < config.num_heads  # grouped-query attention
    assert config.max_position_embeddings >= 1024
    assert (MODEL / "model.safetensors").stat().st_size <= 20 * 2**20
    tensors = load_file(str(MODEL / "model.safetensors"))
    assert {v.dtype for v in tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
    assert sum(v.size for v in tensors.values()) == config.param_count()
    gen = json.loads((MODEL / "generation_config.json").read_text())
    assert gen["eos_token_id"] == Tokenizer.from_file(str(MODEL / "tokenizer.json")).token_to_id(
        "<|eos|>"
    )
    assert (MODEL / "MODEL_CARD.md").exists()


@pytest.fixture(scope="module")
def shipped_engine():
    from tenantq.engine import Engine

    return Engine.from_checkpoint(MODEL, dtype="bfloat16", max_seqs=8)


@pytest.mark.slow
def test_shipped_model_is_far_better_than_unigram(tokenizer, shipped_engine):
    from tenantq.reference.evaluate import mean_nll, split_ids, unigram_nll

    test = split_ids(tokenizer, "test")
    nll = mean_nll(shipped_engine, test, 511, max_windows=8)
    uni = unigram_nll(split_ids(tokenizer, "train"), test, shipped_engine.config.vocab_size)
    # "Far below": at least 3x lower perplexity than token frequencies alone. The card
    # measures 7.3x over the whole test split; 8 windows of 511 vary by tens of percent.
    assert math.exp(nll) < math.exp(uni) / 3, (math.exp(nll), math.exp(uni))


def _card_needle_accuracy(length: int) -> float:
    path = MODEL / "eval.json"
    return json.loads(path.read_text())["needles"][str(length)]["accuracy"] if path.exists() else 0


@pytest.mark.slow
@pytest.mark.xfail(
    _card_needle_accuracy(256) < 0.9,
    reason="the shipped checkpoint does not yet meet the 90% needle target (see MODEL_CARD.md)",
    strict=True,
)
def test_shipped_model_retrieves_passkeys_at_256_tokens(tokenizer, shipped_engine):
    from tenantq.reference.evaluate import needle_grid, split_ids

    grid = needle_grid(shipped_engine, tokenizer, split_ids(tokenizer, "test"), (256,), 40)
    # Card target 90% over 200 needles; 40 needles: allow ~3 binomial sd below that.
    assert grid[256]["accuracy"] >= 0.75, grid


def test_engine_logits_match_the_cacheless_forward():
    # The paged pool (K/V written, then read back) against the same modules attending over
    # their own tokens: same float32 math in a different order, ~1e-5 of the logit scale.
    from tenantq.engine import Engine

    params, config, _ = read_hf_checkpoint(MODEL)
    ids = np.random.default_rng(0).integers(3, config.vocab_size, (1, 48))
    engine = Engine.from_checkpoint(str(MODEL), dtype="float32")
    got = np.asarray(engine.logits(ids))
    want = np.asarray(forward(params, config, jnp.asarray(ids)))
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)


# ------------------------------------------------------------------ the trainer
@pytest.mark.slow
def test_trainer_loss_falls_in_a_few_steps(tmp_path, tokenizer, valid_ids):
    from tenantq.reference import train

    config = tiny_config()
    s = train.TrainSettings(
        out=str(tmp_path),
        steps=40,
        tokens_per_step=512,
        peak_lr=1e-2,
        warmup_steps=5,
        eval_every=20,
        eval_needle_lengths=(),
    )
    curriculum = (train.Phase(1.0, 64, 16),)
    ids = {"train": valid_ids, "valid": valid_ids}
    log = train.train(s, tokenizer, ids, config, curriculum=curriculum, progress=False)
    initial = train.validation_loss(init_params(config, s.seed), config, valid_ids)
    final = log[-1]["val_loss"]
    # An untrained model sits at ~ln(2048) = 7.6 nats; 40 steps of 512 tokens learn at
    # least the token statistics (unigram entropy here ~6 nats): a fall of over a nat.
    assert final < initial - 1.0, (initial, final)
    assert (tmp_path / "checkpoint.npz").exists()
    # Resuming a finished run does nothing more.
    assert train.train(s, tokenizer, ids, config, curriculum=curriculum, progress=False) == []


def test_a_tokenized_split_killed_while_written_leaves_no_cache(tmp_path, monkeypatch):
    """prepare_data's caches are written whole or not at all: a writer that dies mid-file
    leaves nothing at the cache's name, and the next run tokenizes again (a half-written
    train_ids.npy used to be read back as the corpus)."""
    from tenantq.model.tokenizer import token_stream
    from tenantq.reference import train

    class Tiny:
        def texts(self, split):
            return [f"def {split}_{i}(x):\n    return x + {i}\n" for i in range(3)]

        def describe(self):
            return {"files": 3}

    monkeypatch.setattr(train, "load_corpus", Tiny)
    tok = Tokenizer.from_file(str(reference_model_path() / "tokenizer.json"))
    tok.save(str(tmp_path / "tokenizer.json"))

    def dies_halfway(f, array):
        if not hasattr(f, "write"):  # np.save(path, ...): it opens the file itself
            f = open(f, "wb")  # noqa: SIM115 (left open, as a killed process leaves it)
        f.write(b"\x93NUMPY partial")
        f.flush()
        raise KeyboardInterrupt

    monkeypatch.setattr(train.np, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        train.prepare_data(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json"]
    monkeypatch.undo()
    monkeypatch.setattr(train, "load_corpus", Tiny)
    _, ids, _ = train.prepare_data(tmp_path)
    for split in ("train", "valid", "test"):
        assert np.array_equal(ids[split], token_stream(tok, Tiny().texts(split)))
        assert np.array_equal(np.load(tmp_path / f"{split}_ids.npy"), ids[split])
