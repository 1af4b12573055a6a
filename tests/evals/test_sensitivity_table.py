"""Sensitivity profiles without a model: the units, the windows, the table's figures, its
cache, the devices path and the matrix text.

A tiny config (2 layers, vocabulary 64) is written as a checkpoint folder; the engine is a
stand-in whose logits depend on the fed tokens, plus noise whose size depends on which KV
layer the plan quantizes, so every unit has its own KL. Reference: KL(p || q) per token by
direct numpy, averaged per window, and the paired bootstrap of `evals.stats` on those means.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pytest

from tenantq.evals import sensitivity, stats, windows
from tenantq.model.config import ModelConfig
from tenantq.quant.plan import QuantPlan

VOCAB = 64


def _config(**kw) -> ModelConfig:
    fields = dict(
        model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128, eos_token_ids=(2,),
        bos_token_id=1,
    )  # fmt: skip
    fields.update(kw)
    return ModelConfig(**fields)


class _Tok:
    """Characters to ids 3..62; `<|eos|>` is 2."""

    vocab_size = VOCAB

    def token_id(self, token: str) -> int | None:
        return {"<|eos|>": 2, "<|bos|>": 1}.get(token)

    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) % 60 for c in text]


TEXT = "".join(f"line {i}: value = compute({i}, {i * 7 % 13})\n" for i in range(40))
W = np.random.default_rng(0).normal(scale=2.0, size=(VOCAB, VOCAB)).astype(np.float32)
NOISE = np.random.default_rng(1).normal(size=(VOCAB, VOCAB)).astype(np.float32)


def _scale(plan: QuantPlan) -> float:
    """The stand-in's damage: none for bf16; by KV layer (and keys more than values)."""
    if plan.kv is None or not plan.kv.layer_formats:
        return 0.0
    layer, key_format, _ = plan.kv.layer_formats[0]
    return 0.3 * (layer + 1) + (0.4 if key_format != "bf16" else 0.0)


class _Engine:
    """`device_logits` in batches of `max_seqs`: W[token] + scale * NOISE[token]."""

    made: list[dict] = []

    def __init__(self, config, params, plan, **options):
        self.scale, self.batch = _scale(plan), options["max_seqs"]
        _Engine.made.append({"plan": plan, "options": options, "params": params})

    def device_logits(self, rows, kv_tokens=None):
        rows = np.asarray(rows)
        for start in range(0, len(rows), self.batch):
            part = rows[start : start + self.batch]
            logits = W[part] + self.scale * NOISE[part]
            yield start, jnp.asarray(logits), jnp.zeros(part.shape, jnp.float32)


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_config().to_hf_dict()))
    source = tmp_path / "text.txt"
    source.write_text(TEXT)
    _Engine.made = []
    monkeypatch.setattr("tenantq.engine.Engine", _Engine)
    monkeypatch.setattr("tenantq.model.loader.load_params", lambda *a, **k: {"w": np.ones(2)})
    monkeypatch.setattr("tenantq.model.tokenizer.require_tokenizer", lambda *a: _Tok())
    return folder, source


def _logsm(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _kl_per_window(windows: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    fed = windows[:, :-1]
    p, q = _logsm(W[fed]), _logsm(W[fed] + scale * NOISE[fed])
    kl = (np.exp(p) * (p - q)).sum(-1)
    return kl.mean(axis=1), (p.argmax(-1) == q.argmax(-1))


def test_each_kv_units_row_is_its_mean_kl_with_the_paired_bootstrap_ci(checkpoint, tmp_path):
    folder, source = checkpoint
    seen = []
    kw = dict(kv=True, source=str(source), rows=5, row_tokens=9, resamples=300,
              cache_dir=tmp_path / "cache", progress=False)  # fmt: skip
    table = sensitivity.profile(folder, "int8", on_unit=lambda u, d: seen.append((u, d)), **kw)
    assert table.schema == sensitivity.SCHEMA
    rows9 = windows.text_windows(_Tok(), _config(), source=str(source), rows=5, row_tokens=9)
    rows = table.to_pylist()
    assert [(r["tensor"], r["tensor_class"]) for r in rows] == [
        ("kv/0", "keys"), ("kv/0", "values"), ("kv/1", "keys"), ("kv/1", "values")
    ]  # fmt: skip
    for r in rows:
        layer = int(r["tensor"].split("/")[1])
        scale = 0.3 * (layer + 1) + (0.4 if r["tensor_class"] == "keys" else 0.0)
        kl_seq, agree = _kl_per_window(rows9, scale)
        ci = stats.paired_bootstrap(np.zeros(5), kl_seq, resamples=300)
        assert r["kl_mean"] == pytest.approx(kl_seq.mean(), rel=1e-4)
        assert r["kl_ci_low"] == pytest.approx(ci.ci_low, rel=1e-4)
        assert r["kl_ci_high"] == pytest.approx(ci.ci_high, rel=1e-4)
        assert r["kl_ci_low"] < r["kl_mean"] < r["kl_ci_high"]
        assert r["top1_agree"] == pytest.approx(agree.mean())
        assert (r["format"], r["kind"], r["layer"]) == ("int8", "kv", layer)
        assert (r["rows"], r["tokens"]) == (5, 5 * 8)
    # each unit ran once, in order, on the one device; the baseline engine came first
    assert [u.tensor_class for u, _ in seen] == ["keys", "values"] * 2
    assert {d for _, d in seen} == {jax.local_devices()[0]}
    assert len(_Engine.made) == 1 + 4 and _Engine.made[0]["plan"] == QuantPlan()
    assert _Engine.made[0]["options"] == {"max_seqs": 5, "max_seq_tokens": 9}
    assert [e["plan"] for e in _Engine.made[1:]] == [u.plan for u, _ in seen]
    # written once under the cache folder, read back without an engine
    files = list((tmp_path / "cache").iterdir())
    assert len(files) == 1 and files[0].name.startswith("sensitivity-")
    _Engine.made = []
    again = sensitivity.profile(folder, "int8", **kw)
    assert again.equals(table) and _Engine.made == []
    # another format is another table (and another file)
    other = sensitivity.profile(folder, "int4", **kw)
    assert (
        len(list((tmp_path / "cache").iterdir())) == 2
        and other.column("format")[0].as_py() == "int4"
    )


def test_profiles_differing_in_kind_unit_or_resamples_are_cached_apart(checkpoint, tmp_path):
    # int8 is both a KV and a weight format: a KV table must never answer a weight profile,
    # nor a block profile a tensor one, nor one bootstrap size another's
    folder, source = checkpoint
    kw = dict(source=str(source), rows=4, row_tokens=9, cache_dir=tmp_path / "c", progress=False)
    kv = sensitivity.profile(folder, "int8", kv=True, resamples=200, **kw)
    weights = sensitivity.profile(folder, "int8", resamples=200, **kw)
    blocks = sensitivity.profile(folder, "int8", by="block", resamples=200, **kw)
    more = sensitivity.profile(folder, "int8", kv=True, resamples=300, **kw)
    assert set(kv.column("kind").to_pylist()) == {"kv"}
    assert set(weights.column("kind").to_pylist()) == {"weight"}
    assert "layers/0/mlp" in blocks.column("tensor").to_pylist()
    assert "layers/0/mlp" not in weights.column("tensor").to_pylist()
    assert more.column("kl_ci_low") != kv.column("kl_ci_low")
    assert len(list((tmp_path / "c").iterdir())) == 4


def test_a_profile_batches_at_most_sixteen_windows(checkpoint, tmp_path):
    # the engine is sized for 16 sequences at most, however many windows are profiled
    folder, source = checkpoint
    sensitivity.profile(
        folder, "int8", kv=True, source=str(source), rows=20, row_tokens=9, resamples=100,
        cache_dir=tmp_path / "c", progress=False,
    )  # fmt: skip
    assert {e["options"]["max_seqs"] for e in _Engine.made} == {16}
    assert _Engine.made[0]["options"]["max_seq_tokens"] == 9


def test_a_profile_shows_its_progress_unless_told_not_to(checkpoint, tmp_path, capsys):
    folder, source = checkpoint
    kw = dict(kv=True, source=str(source), rows=4, row_tokens=9, resamples=100)
    sensitivity.profile(folder, "int8", cache_dir=tmp_path / "a", **kw)
    assert "sensitivity int8" in capsys.readouterr().err
    sensitivity.profile(folder, "int8", cache_dir=tmp_path / "b", progress=False, **kw)
    assert "sensitivity int8" not in capsys.readouterr().err


def test_units_spread_over_devices_give_the_serial_table(checkpoint, tmp_path):
    folder, source = checkpoint
    kw = dict(kv=True, source=str(source), rows=4, row_tokens=9, resamples=200, progress=False)
    serial = sensitivity.profile(folder, "int8", cache_dir=tmp_path / "a", **kw)
    device = jax.local_devices()[0]
    seen = []
    spread = sensitivity.profile(
        folder, "int8", cache_dir=tmp_path / "b", devices=[device, device],
        on_unit=lambda u, d: seen.append((u.tensor_class, d)), **kw,
    )  # fmt: skip
    assert spread.equals(serial)
    assert sorted(seen) == [("keys", device)] * 2 + [("values", device)] * 2  # named devices
    # each device's engines get the model's params (copied there), not nothing
    for made in _Engine.made[-4:]:
        np.testing.assert_array_equal(np.asarray(made["params"]["w"]), np.ones(2))
    with pytest.raises(ValueError, match="devices is empty"):
        sensitivity.profile(folder, "int8", cache_dir=tmp_path / "c", devices=[], **kw)


def test_the_first_error_on_a_device_stops_the_others_and_is_raised():
    device = jax.local_devices()[0]
    ran = []

    def measure(unit, dev, params, base):
        ran.append(unit)
        if unit == 1:
            raise RuntimeError("unit 1 failed")
        return {"unit": unit}

    base = sensitivity.fidelity.FidelityBaseline(
        np.zeros((1, 1), np.int32), np.zeros((1, 1)), np.zeros((1, 1)), np.zeros((1, 1))
    )
    with pytest.raises(RuntimeError, match="unit 1 failed"):
        sensitivity._over_devices(list(range(50)), [device, device], {}, base, measure)
    assert len(ran) < 50
    out = sensitivity._over_devices([0, 2, 3], [device, device], {}, base, lambda u, *a: u * 10)
    assert out == [0, 20, 30]


def test_a_baseline_moves_its_device_arrays_and_keeps_the_rest():
    device = jax.local_devices()[0]
    base = sensitivity.fidelity.FidelityBaseline(
        np.zeros((1, 2), np.int32), np.ones((1, 2)), np.zeros((1, 2)), np.ones((1, 2)),
        topk_ids=np.ones((1, 2, 3), np.int32), tail_logp=np.full((1, 2), -3.0),
    )  # fmt: skip
    moved = sensitivity._baseline_on(base, device)
    assert isinstance(moved.topk_ids, jax.Array) and isinstance(moved.tail_logp, jax.Array)
    assert moved.logp is None and moved.topk_logp is None and not moved.exact
    np.testing.assert_array_equal(np.asarray(moved.tail_logp), base.tail_logp)
    assert moved.tokens is base.tokens and moved.margin is base.margin


def test_windows_are_bos_then_disjoint_draws_of_the_text(tmp_path):
    source = tmp_path / "t.txt"
    source.write_text(TEXT)
    w = windows.text_windows(_Tok(), _config(), source=str(source), rows=6, row_tokens=11)
    assert w.shape == (6, 11) and w.dtype == np.int32 and (w[:, 0] == 1).all()
    stream = np.asarray(_Tok().encode(TEXT) + [2], np.int32)
    # disjoint 10-token slots drawn with the generator [seed, 1]
    want = windows.token_windows(stream, 6, 10, np.random.default_rng([0, 1]))
    np.testing.assert_array_equal(w[:, 1:], want)
    assert not np.array_equal(
        w, windows.text_windows(_Tok(), _config(), source=str(source), rows=6, row_tokens=11,
                                    seed=1)
    )  # fmt: skip
    no_bos = windows.text_windows(
        _Tok(), _config(bos_token_id=None), source=str(source), rows=2, row_tokens=11
    )
    assert (no_bos[:, 0] == 1).all()
    seven = windows.text_windows(
        _Tok(), _config(bos_token_id=7), source=str(source), rows=2, row_tokens=11
    )
    assert (seven[:, 0] == 7).all()
    slots = (len(TEXT) + 1) // 10
    with pytest.raises(ValueError, match=rf"t\.txt has {len(TEXT) + 1:,} tokens: {slots} windows "
                       rf"of 10 \(\+ BOS\), {slots + 1} asked for; give more text"):  # fmt: skip
        windows.text_windows(_Tok(), _config(), source=str(source), rows=slots + 1, row_tokens=11)


def test_windows_read_the_stream_only_to_four_times_what_is_drawn(tmp_path, monkeypatch):
    docs = [TEXT[i * 100 : (i + 1) * 100] for i in range(len(TEXT) // 100)]
    monkeypatch.setattr(windows.data, "load_documents", lambda s: docs)
    read = []
    real = windows.token_stream
    monkeypatch.setattr(windows, "token_stream", lambda t, d: read.append(d) or real(t, d))
    windows.text_windows(_Tok(), _config(), source="x.txt", rows=2, row_tokens=51)
    # 2 x 50 drawn: documents of 101 tokens are read until 400 are held, i.e. four
    assert len(read) == 4
    read.clear()
    windows.text_windows(_Tok(), _config(), source="x.txt", rows=2, row_tokens=50)
    assert len(read) == 4  # 2 x 49 = 98: 392 < 4 x 98 = 392? no: 404 >= 392 after four
    monkeypatch.setattr(windows.data, "load_documents", lambda s: [])
    with pytest.raises(ValueError, match="x.txt has 0 tokens"):
        windows.text_windows(_Tok(), _config(), source="x.txt", rows=1, row_tokens=5)


def test_calibration_and_held_out_windows_are_disjoint_seeded_draws(tmp_path):
    source = tmp_path / "t.txt"
    source.write_text(TEXT)
    cal, held = windows.calibration_windows(
        _Tok(), _config(), source=str(source), num_sequences=5, seq_tokens=9, held_out=3
    )
    assert cal.shape == (5, 9) and held.shape == (3, 9)
    allw = windows.text_windows(_Tok(), _config(), source=str(source), rows=8, row_tokens=9)
    order = np.random.default_rng([0, 2]).permutation(8)
    np.testing.assert_array_equal(cal, allw[order[:5]])
    np.testing.assert_array_equal(held, allw[order[5:]])
    cal1, _ = windows.calibration_windows(
        _Tok(), _config(), source=str(source), num_sequences=5, seq_tokens=9, seed=1
    )
    assert not np.array_equal(cal1, cal[:5])
    # the seed draws the windows as well as their split
    allw1 = windows.text_windows(
        _Tok(), _config(), source=str(source), rows=5, row_tokens=9, seed=1
    )
    np.testing.assert_array_equal(cal1, allw1[np.random.default_rng([1, 2]).permutation(5)])


def test_calibration_defaults_are_128_windows_of_512_tokens_none_held_out(tmp_path):
    source = tmp_path / "t.txt"
    source.write_text(TEXT * 60)  # ~86K tokens: 128 x 511 fit
    cal, held = windows.calibration_windows(_Tok(), _config(), source=str(source))
    assert cal.shape == (128, 512) and held.shape == (0, 512)


def test_unit_errors_name_what_is_valid():
    config = _config()
    with pytest.raises(ValueError, match="unit kind 'layer' unknown; use one of tensor, block"):
        sensitivity.units(config, "int4", by="layer")
    with pytest.raises(ValueError, match=r"KV format 'int3' unknown; valid: .*int8"):
        sensitivity.units(config, "int3", kv=True)
    with pytest.raises(
        ValueError, match=r"format 'int3' is not a quantized weight format; valid: "
    ):
        sensitivity.units(config, "int3")
    with pytest.raises(ValueError, match=r"valid: (?!bf16)"):
        sensitivity.units(config, "bf16")
    kv = sensitivity.units(config, "int8", kv=True, by="block")  # by is moot for KV
    assert [u.kind for u in kv] == ["kv"] * 4 and [u.layer for u in kv] == [0, 0, 1, 1]
    assert kv[0].plan.kv.layer_formats == ((0, "int8", "bf16"),)
    assert kv[3].plan.kv.layer_formats == ((1, "bf16", "int8"),)


def test_weight_units_name_their_layer_and_class():
    config = _config()
    tensors = sensitivity.units(config, "int4")
    by_name = {u.tensor: u for u in tensors}
    q = by_name["layers/1/attn/q_proj"]
    assert (q.layer, q.tensor_class, q.kind) == (1, "q_proj", "weight")
    assert q.plan.rules[0].format == "int4" and q.plan.rules[0].pattern == r"layers/1/attn/q_proj"
    head = by_name["lm_head"]
    assert (head.layer, head.tensor_class) == (None, "lm_head")
    blocks = {u.tensor: u for u in sensitivity.units(config, "int4", by="block")}
    mlp = blocks["layers/0/mlp"]
    assert (mlp.layer, mlp.tensor_class, mlp.kind) == (0, "mlp", "weight")
    assert mlp.plan.rules[0].pattern == "layers/0/mlp/.*"
    assert blocks["embed"].layer is None and blocks["embed"].plan.rules[0].pattern == "embed"


def test_matrix_text_is_layers_by_class_then_the_rest():
    table = pa.Table.from_pylist(
        [
            {"tensor": "kv/0", "tensor_class": "keys", "layer": 0, "kl_mean": 0.0123},
            {"tensor": "kv/0", "tensor_class": "values", "layer": 0, "kl_mean": 1.5},
            {"tensor": "kv/1", "tensor_class": "keys", "layer": 1, "kl_mean": 250.0},
            {"tensor": "embed", "tensor_class": "embed", "layer": None, "kl_mean": 0.25},
        ]
    )
    assert sensitivity.matrix_text(table) == (
        "layer      keys    values\n"
        "    0    0.0123       1.5\n"
        "    1       250         -\n"
        "embed: 0.25"
    )
    wide = pa.Table.from_pylist(
        [{"tensor": "x", "tensor_class": "a_long_class_name", "layer": 3, "kl_mean": 2.0}]
    )
    assert sensitivity.matrix_text(wide).splitlines() == [
        "layer a_long_class_name",
        f"    3 {'2':>17}",
    ]
