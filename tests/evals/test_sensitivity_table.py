"""Sensitivity profiles without a model: the units, the windows, the table's figures, its
cache, the devices path and the matrix text.

A tiny config (2 layers, vocabulary 64) is written as a checkpoint folder; the engine is a
stand-in whose logits depend on the fed tokens, plus noise whose size depends on which KV
layer the plan quantizes, so every unit has its own KL. Reference: KL(p || q) per token by
direct numpy, averaged per window, and the paired bootstrap of `evals.stats` on those means.
The stand-ins (engine, params loader, tokenizer, `jax.device_put`, progress bar) bind every
call to the real callee's signature and record its arguments, so a call the real one would
refuse, or one handed the wrong value, fails here; two named stand-in devices check the
parallel path without a second real device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tenantq.engine
import tenantq.model.loader
import tenantq.model.tokenizer
from tenantq.evals import data, fidelity, sensitivity, stats, windows
from tenantq.evals.identity import cache_key, model_identity
from tenantq.model import terminal
from tenantq.model.config import ModelConfig
from tenantq.quant.plan import FORMAT_NAMES, KV_FORMAT_NAMES, QuantPlan

# The real callees whose signatures the stand-ins bind their calls to: a call the real
# function would refuse (an argument missing, one too many) fails the stand-in too.
REAL_ENGINE = tenantq.engine.Engine
REAL_LOAD_PARAMS = tenantq.model.loader.load_params
REAL_TOKENIZER = tenantq.model.tokenizer.require_tokenizer
REAL_DEVICE_PUT = jax.device_put
REAL_BASELINE = fidelity.compute_baseline


def _bound(real, *args, **kwargs) -> dict:
    """The call's arguments by parameter name, defaults filled in, as `real` takes them."""
    call = inspect.signature(real).bind(*args, **kwargs)
    call.apply_defaults()
    return dict(call.arguments)


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


_WHERE = threading.local()  # the device a stand-in `jax.default_device` entered


def _default_device():
    """The device `jax.default_device` made current in this thread (stand-in's or JAX's)."""
    return getattr(_WHERE, "device", jax.config.jax_default_device)


class _Engine:
    """`device_logits` in batches of `max_seqs`: W[token] + scale * NOISE[token]. Records
    each construction: its arguments bound to the real `Engine`'s signature, the default
    device and the thread it was built in."""

    made: list[dict] = []

    def __init__(self, *args, **kwargs):
        bound = _bound(REAL_ENGINE, *args, **kwargs)
        options = bound["pool_options"]
        self.scale, self.batch = _scale(bound["plan"]), options["max_seqs"]
        _Engine.made.append(
            {"plan": bound["plan"], "options": options, "params": bound["params"],
             "config": bound["config"], "bound": bound, "device": _default_device(),
             "thread": threading.current_thread(), "engine": self}
        )  # fmt: skip

    def device_logits(self, rows, kv_tokens=None):
        rows = np.asarray(rows)
        for start in range(0, len(rows), self.batch):
            part = rows[start : start + self.batch]
            logits = W[part] + self.scale * NOISE[part]
            yield start, jnp.asarray(logits), jnp.zeros(part.shape, jnp.float32)


CALLS: dict[str, list] = {}  # what the checkpoint's stand-ins were called with


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_config().to_hf_dict()))
    source = tmp_path / "text.txt"
    source.write_text(TEXT)
    _Engine.made = []
    CALLS.clear()
    CALLS.update(load_params=[], tokenizer=[], params=[], baseline=[], kl=[])

    def load_params(*args, **kwargs):
        CALLS["load_params"].append(_bound(REAL_LOAD_PARAMS, *args, **kwargs))
        CALLS["params"].append(params := {"w": np.ones(2)})
        return params

    def require_tokenizer(*args, **kwargs):
        CALLS["tokenizer"].append(_bound(REAL_TOKENIZER, *args, **kwargs))
        return _Tok()

    real_kl = fidelity.kl_against_baseline

    def compute_baseline(*args, **kwargs):
        bound = _bound(REAL_BASELINE, *args, **kwargs)
        base = REAL_BASELINE(*args, **kwargs)
        CALLS["baseline"].append({**bound, "returned": base})
        return base

    def kl_against_baseline(*args, **kwargs):
        CALLS["kl"].append(_bound(real_kl, *args, **kwargs))
        return real_kl(*args, **kwargs)

    monkeypatch.setattr("tenantq.engine.Engine", _Engine)
    monkeypatch.setattr("tenantq.model.loader.load_params", load_params)
    monkeypatch.setattr("tenantq.model.tokenizer.require_tokenizer", require_tokenizer)
    monkeypatch.setattr(fidelity, "compute_baseline", compute_baseline)
    monkeypatch.setattr(fidelity, "kl_against_baseline", kl_against_baseline)
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
    with pytest.raises(ValueError) as empty:
        sensitivity.profile(folder, "int8", cache_dir=tmp_path / "c", devices=[], **kw)
    assert str(empty.value) == "devices is empty; pass at least one jax device (or None for all)"


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


def test_windows_read_documents_only_until_four_times_what_is_drawn(monkeypatch):
    # eight documents of 101 tokens (100 characters and EOS); a draw of `rows` windows of
    # `row_tokens - 1` ids reads documents until it holds at least 4x that many ids
    docs = [chr(ord("a") + i) * 100 for i in range(8)]
    monkeypatch.setattr(windows.data, "load_documents", lambda s: docs)
    read = []
    real = windows.token_stream
    monkeypatch.setattr(windows, "token_stream", lambda t, d: read.append(d) or real(t, d))
    for rows, row_tokens, documents in (
        (1, 102, 4),  # 4 x 101 = 404: held reaches it exactly with the fourth (>=, not >)
        (1, 77, 4),  # 4 x 76 = 304: three hold 303, one short
        (1, 76, 3),  # 4 x 75 = 300: three hold 303
        (2, 39, 4),  # 4 x 2 x 38 = 304
    ):
        read.clear()
        got = windows.text_windows(_Tok(), _config(), source="x.txt", rows=rows,
                                   row_tokens=row_tokens)  # fmt: skip
        assert got.shape == (rows, row_tokens)
        assert read == [[d] for d in docs[:documents]], (rows, row_tokens)
    monkeypatch.setattr(windows.data, "load_documents", lambda s: [])
    with pytest.raises(ValueError) as empty:
        windows.text_windows(_Tok(), _config(), source="x.txt", rows=1, row_tokens=5)
    assert str(empty.value) == (
        "x.txt has 0 tokens: 0 windows of 4 (+ BOS), 1 asked for; give more text, or fewer "
        "or shorter windows"
    )


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
    with pytest.raises(ValueError) as kv_error:
        sensitivity.units(config, "int3", kv=True)
    assert str(kv_error.value) == f"KV format 'int3' unknown; valid: {', '.join(KV_FORMAT_NAMES)}"
    with pytest.raises(ValueError) as weight_error:
        sensitivity.units(config, "int3")
    valid = [f for f in FORMAT_NAMES if f != "bf16"]
    assert str(weight_error.value) == (
        f"format 'int3' is not a quantized weight format; valid: {', '.join(valid)}"
    )
    assert "int8" in valid and "bf16" not in valid
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


def test_a_profile_gives_the_model_its_own_folder_config_dtype_and_windows(checkpoint, tmp_path):
    folder, source = checkpoint
    sensitivity.profile(
        str(folder), "int8", kv=True, source=str(source), rows=5, row_tokens=9, resamples=300,
        cache_dir=tmp_path / "c", progress=False,
    )  # fmt: skip
    config = ModelConfig.from_file(folder)
    rows9 = windows.text_windows(_Tok(), config, source=str(source), rows=5, row_tokens=9)
    # the folder's tokenizer, checked against the model's vocabulary; its params in bf16
    assert CALLS["tokenizer"] == [{"folder": folder, "vocab_size": VOCAB}]
    (load,) = CALLS["load_params"]
    assert (load["folder"], load["config"]) == (folder, config)
    assert jnp.dtype(load["dtype"]) == jnp.bfloat16
    (params,) = CALLS["params"]
    # one device: every engine holds the loaded params themselves (no second copy of the
    # model), is built on the calling thread, and each unit's under that device
    assert len(_Engine.made) == 1 + 4
    for made in _Engine.made:
        assert made["config"] == config and made["params"] is params
        assert made["thread"] is threading.current_thread()
    assert [m["device"] for m in _Engine.made[1:]] == [jax.local_devices()[0]] * 4
    # the baseline: exact (vocabulary 64 is under the limit) on the drawn windows
    (base,) = CALLS["baseline"]
    assert base["engine"] is _Engine.made[0]["engine"]
    assert (base["exact"], base["top_k"], base["kv_tokens"]) == (True, sensitivity.TOP_K, None)
    np.testing.assert_array_equal(base["rows"], rows9)
    # each unit's KL: its own engine against that baseline, `resamples` draws
    assert len(CALLS["kl"]) == 4
    for call, made in zip(CALLS["kl"], _Engine.made[1:], strict=True):
        assert call["engine"] is made["engine"] and call["base"] is base["returned"]
        assert (call["resamples"], call["seed"], call["kv_tokens"]) == (300, 0, None)
        np.testing.assert_array_equal(call["rows"], rows9)


class _Stop(Exception):
    """Raised by a stand-in to end a profile once what the test needs is recorded."""


def test_the_baseline_is_exact_up_to_the_vocabulary_limit_then_top_k(
    checkpoint, tmp_path, monkeypatch
):
    # EXACT_VOCAB_LIMIT is the largest vocabulary still compared exactly (<=, as the suite)
    folder, source = checkpoint
    asked = []

    def compute_baseline(*args, **kwargs):
        asked.append(_bound(REAL_BASELINE, *args, **kwargs))
        raise _Stop

    monkeypatch.setattr(fidelity, "compute_baseline", compute_baseline)
    for limit in (VOCAB, VOCAB - 1):
        monkeypatch.setattr(sensitivity, "EXACT_VOCAB_LIMIT", limit)
        with pytest.raises(_Stop):
            sensitivity.profile(folder, "int8", kv=True, source=str(source), rows=2,
                                row_tokens=9, cache_dir=tmp_path, progress=False)  # fmt: skip
    assert [(a["exact"], a["top_k"]) for a in asked] == [(True, 64), (False, 64)]


def test_the_cache_file_is_named_by_every_input_of_the_table(checkpoint, tmp_path):
    # the model's identity, the format, unit kind, KV or not, the windows drawn and the
    # bootstrap size, under the cache's version: any of them changed is another file
    folder, source = checkpoint
    sensitivity.profile(
        folder, "int8", kv=True, source=str(source), rows=5, row_tokens=9, resamples=300,
        cache_dir=tmp_path / "c", progress=False,
    )  # fmt: skip
    rows9 = windows.text_windows(_Tok(), _config(), source=str(source), rows=5, row_tokens=9)
    key = cache_key(
        version=sensitivity.CACHE_VERSION, model=model_identity(folder), format="int8",
        by="tensor", kv=True, dataset=data.array_hash(rows9), resamples=300,
    )  # fmt: skip
    assert [f.name for f in (tmp_path / "c").iterdir()] == [f"sensitivity-{key}.parquet"]


def test_a_cached_table_reads_back_in_the_tables_schema(checkpoint, tmp_path):
    # a cache file whose integers were written narrower (int32) reads back as SCHEMA says
    folder, source = checkpoint
    kw = dict(kv=True, source=str(source), rows=4, row_tokens=9, resamples=100,
              cache_dir=tmp_path / "c", progress=False)  # fmt: skip
    table = sensitivity.profile(folder, "int8", **kw)
    (path,) = (tmp_path / "c").iterdir()
    narrow = pa.schema(
        [f.with_type(pa.int32()) if f.type == pa.int64() else f for f in sensitivity.SCHEMA]
    )
    pq.write_table(table.cast(narrow), path)
    _Engine.made = []
    again = sensitivity.profile(folder, "int8", **kw)
    assert _Engine.made == [] and again.schema == sensitivity.SCHEMA and again.equals(table)


def test_a_profile_makes_its_cache_folder_and_the_folders_above(checkpoint, tmp_path):
    folder, source = checkpoint
    deep = tmp_path / "a" / "b"
    sensitivity.profile(folder, "int8", kv=True, source=str(source), rows=4, row_tokens=9,
                        resamples=100, cache_dir=deep, progress=False)  # fmt: skip
    assert [f.name.startswith("sensitivity-") for f in deep.iterdir()] == [True]


def test_the_progress_bar_counts_the_units_one_step_each(checkpoint, tmp_path, monkeypatch):
    folder, source = checkpoint
    bars = []

    class _Bar:
        def __init__(self, args):
            self.args, self.steps, self.closed = args, [], False

        def update(self, n=1):
            self.steps.append(n)

        def close(self):
            self.closed = True

    def progress_bar(*args, **kwargs):
        bars.append(_Bar(_bound(terminal.progress_bar, *args, **kwargs)))
        return bars[-1]

    monkeypatch.setattr(sensitivity, "progress_bar", progress_bar)
    for progress in (True, False):
        sensitivity.profile(
            folder, "int8", kv=True, source=str(source), rows=4, row_tokens=9, resamples=100,
            cache_dir=tmp_path / str(progress), progress=progress,
        )  # fmt: skip
    # four units (keys and values of two layers): a bar of 4 "unit"s, one step each
    for bar, progress in zip(bars, (True, False), strict=True):
        assert bar.args == {
            "total": 4, "enabled": progress, "initial": 0,
            "options": {"desc": "sensitivity int8", "unit": "unit"},
        }  # fmt: skip
        assert bar.steps == [1, 1, 1, 1] and bar.closed


@dataclasses.dataclass(frozen=True, order=True)
class _Device:
    """A named stand-in device; JAX refuses it, so `device_put` and `default_device` are
    stand-ins wherever it is used."""

    name: str


@pytest.fixture
def two_devices(monkeypatch):
    """Two stand-in devices. `jax.device_put` (bound to its real signature) records what was
    put where and returns arrays as they are, a dict (the params) with its device under
    "on"; `jax.default_device` records the device entered for `_default_device`."""
    placed = []

    def device_put(*args, **kwargs):
        bound = _bound(REAL_DEVICE_PUT, *args, **kwargs)
        x, device = bound["x"], bound["device"]
        placed.append((x, device))
        return {**x, "on": device} if isinstance(x, dict) else x

    @contextlib.contextmanager
    def default_device(device):
        _WHERE.device = device
        try:
            yield
        finally:
            del _WHERE.device

    monkeypatch.setattr(jax, "device_put", device_put)
    monkeypatch.setattr(jax, "default_device", default_device)
    return [_Device("dev0"), _Device("dev1")], placed


def test_units_on_two_devices_use_that_devices_copy_of_the_model_and_baseline(
    checkpoint, tmp_path, two_devices
):
    folder, source = checkpoint
    devices, placed = two_devices
    kw = dict(kv=True, source=str(source), rows=4, row_tokens=9, resamples=200, progress=False)
    serial = sensitivity.profile(folder, "int8", cache_dir=tmp_path / "a", **kw)
    CALLS["params"].clear(), CALLS["baseline"].clear(), CALLS["kl"].clear()
    _Engine.made = []
    seen = []
    spread = sensitivity.profile(
        folder, "int8", cache_dir=tmp_path / "b", devices=devices,
        on_unit=lambda u, d: seen.append(d), **kw,
    )  # fmt: skip
    assert spread.equals(serial)
    (params,) = CALLS["params"]
    base = CALLS["baseline"][0]["returned"]
    # each device got its own copy of the params and of the baseline's log-probs (exact mode)
    assert sorted(d for x, d in placed if x is params) == devices
    assert sorted(d for x, d in placed if x is base.logp) == devices
    # each unit's engine: built under a device with that device's params, in a daemon
    # thread (an interrupted caller is not held up by units still running)
    units = _Engine.made[1:]
    assert len(units) == 4 and sorted(seen) == sorted(m["device"] for m in units)
    for made in units:
        assert made["device"] in devices and made["params"]["on"] == made["device"]
        assert made["params"]["w"] is params["w"]
        assert made["thread"] is not threading.current_thread() and made["thread"].daemon
    for call in CALLS["kl"]:
        assert call["base"] is not base and call["base"].logp is base.logp


def test_a_baseline_is_put_field_by_field_on_the_device_asked(two_devices):
    devices, placed = two_devices
    base = sensitivity.fidelity.FidelityBaseline(
        np.zeros((1, 2), np.int32), np.ones((1, 2)), np.zeros((1, 2)), np.ones((1, 2)),
        topk_ids=np.ones((1, 2, 3), np.int32), tail_logp=np.full((1, 2), -3.0),
    )  # fmt: skip
    moved = sensitivity._baseline_on(base, devices[1])
    assert [d for x, d in placed if x is base.topk_ids] == [devices[1]]
    assert [d for x, d in placed if x is base.tail_logp] == [devices[1]]
    assert moved.topk_ids is base.topk_ids and moved.logp is None


def test_matrix_text_lists_layers_in_numeric_order():
    # layer 10 after layer 9 (numbers, not strings: "10" < "9")
    table = pa.Table.from_pylist(
        [{"tensor": f"kv/{i}", "tensor_class": "keys", "layer": i, "kl_mean": 1.0}
         for i in (10, 2, 9, 0)]
    )  # fmt: skip
    lines = sensitivity.matrix_text(table).splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["0", "2", "9", "10"]


def test_token_windows_asking_for_every_slot_cut_the_whole_stream_in_order():
    # rows == slots is allowed, and the slots are drawn without replacement: all of them
    stream = np.arange(23, dtype=np.int32)  # 7 slots of 3, 2 ids left over
    got = windows.token_windows(stream, 7, 3, np.random.default_rng(5))
    np.testing.assert_array_equal(got, np.arange(21).reshape(7, 3))


def test_token_windows_are_the_seeded_slots_in_stream_order():
    # reference: the generator's draw of distinct slots, sorted, each slot's ids sliced
    stream = np.arange(100, 200, dtype=np.int32)
    got = windows.token_windows(stream, 4, 7, np.random.default_rng([0, 1]))
    slots = sorted(np.random.default_rng([0, 1]).choice(100 // 7, 4, replace=False))
    want = np.stack([np.arange(100 + 7 * s, 107 + 7 * s) for s in slots])
    np.testing.assert_array_equal(got, want)


def test_a_stream_too_short_for_the_windows_is_one_line_naming_its_size():
    with pytest.raises(ValueError) as err:
        windows.token_windows(np.zeros(1234, np.int32), 3, 500, np.random.default_rng(0))
    assert str(err.value) == (
        "the dataset half has 1,234 tokens: 2 windows of 500, the suite asks for 3; use "
        "fewer rows or shorter ones"
    )


def test_a_bos_id_of_zero_is_the_models_own_not_the_default():
    got = windows.bos_windows(
        np.arange(3, 40, dtype=np.int32), _config(bos_token_id=0), 2, 5, np.random.default_rng(0)
    )
    assert got.shape == (2, 5) and (got[:, 0] == 0).all()


def test_a_bos_id_past_int32_is_refused_not_wrapped():
    # rows are int32: a BOS id that does not fit must not become a negative id
    config = _config(vocab_size=2**32, bos_token_id=2**31)
    with pytest.raises(OverflowError):
        windows.bos_windows(
            np.arange(3, 40, dtype=np.int32), config, 2, 5, np.random.default_rng(0)
        )


def test_without_a_source_windows_come_from_the_reference_train_split(monkeypatch):
    import tenantq.reference.corpus as corpus

    asked = []

    class _Corpus:
        def texts(self, *args, **kwargs):
            split = _bound(corpus.Corpus.texts, self, *args, **kwargs)["split"]
            asked.append(split)
            return [TEXT] if split == "train" else ["z" * 2000]

    monkeypatch.setattr(corpus, "load_corpus", lambda *a, **k: _Corpus())
    got = windows.text_windows(_Tok(), _config(), rows=3, row_tokens=11)
    assert asked == ["train"]
    stream = np.asarray(_Tok().encode(TEXT) + [2], np.int32)
    want = windows.token_windows(stream, 3, 10, np.random.default_rng([0, 1]))
    np.testing.assert_array_equal(got[:, 1:], want)
    with pytest.raises(ValueError) as err:
        windows.text_windows(_Tok(), _config(), rows=1000, row_tokens=11)
    assert str(err.value).startswith(f"the train split has {len(TEXT) + 1:,} tokens: ")
