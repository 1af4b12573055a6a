"""Static KV scales and their cache without a model: `KVScales`'s scales and fingerprint on
statistics of our choosing; `kv_static_scales`'s Parquet cache with the computation replaced
by a stub (unit tests; the statistics themselves: test_kv_statistics.py).
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
import pytest

from tenantq.quant import kv_calibration
from tenantq.quant.kv_calibration import KVScales, kv_static_scales
from tenantq.quant.plan import KVTensorSpec
from tenantq.testing import tiny_config


def _stats(config, seed=0):
    """Distinct figures per layer, tensor, head and statistic."""
    rng = np.random.default_rng(seed)
    shape = (config.num_layers, config.num_kv_heads)
    out = {}
    for tensor in ("keys", "values"):
        absmax = rng.uniform(1, 4, shape).astype(np.float32)
        out[tensor] = {
            "absmax": absmax,
            "min": -rng.uniform(0.5, 1, shape).astype(np.float32) * absmax,
            "max": rng.uniform(0.5, 1, shape).astype(np.float32) * absmax,
            "percentile": rng.uniform(0.3, 0.9, shape).astype(np.float32) * absmax,
            "layer_percentile": rng.uniform(0.5, 1, shape[0]).astype(np.float32),
        }
    return out


def test_the_statistic_a_scale_divides_per_axis_and_choice():
    config = tiny_config()
    stats = _stats(config)
    plain = KVScales("m", "d", 99.0, 10, stats)
    pct = KVScales("m", "d", 99.0, 10, stats, use_percentile=True)
    v = stats["values"]
    np.testing.assert_array_equal(plain.amax(1, "values", "tensor"), [v["absmax"][1].max()])
    np.testing.assert_array_equal(plain.amax(1, "values", "head"), v["absmax"][1])
    np.testing.assert_array_equal(pct.amax(1, "values", "tensor"), [v["layer_percentile"][1]])
    np.testing.assert_array_equal(pct.amax(0, "values", "head"), v["percentile"][0])
    assert plain.amax(0, "keys", "tensor").dtype == np.float32
    wide = {k: {n: v.astype(np.float64) for n, v in s.items()} for k, s in stats.items()}
    for use_percentile in (False, True):  # float32 whatever dtype holds the figures
        s = KVScales("m", "d", 99.0, 10, wide, use_percentile=use_percentile)
        assert s.amax(0, "keys", "tensor").dtype == np.float32


@pytest.mark.parametrize(("fmt", "top"), [("fp8_e4m3", 448.0), ("int8", 127.0)])
def test_symmetric_static_scales_are_amax_over_the_formats_top(fmt, top):
    config = tiny_config()
    stats = _stats(config)
    for use_percentile in (False, True):
        s = KVScales("m", "d", 99.0, 10, stats, use_percentile=use_percentile)
        for layer in (0, 1):
            for axis in ("tensor", "head"):
                scale, zp = s.for_tensor(layer, "keys", KVTensorSpec(fmt, axis))
                assert zp is None
                want = s.amax(layer, "keys", axis) / np.float32(top)
                np.testing.assert_allclose(scale, want, rtol=1e-7)
                assert scale.shape == ((1,) if axis == "tensor" else (config.num_kv_heads,))


def test_int2_static_scales_map_the_calibrated_range_onto_four_codes():
    # KIVI: [min, max] onto codes 0..3, scale (max - min) / 3; code 0 is min. Per head, or
    # over every head of the layer (min of mins, max of maxes) for the tensor axis.
    config = tiny_config()
    stats = _stats(config)
    s = KVScales("m", "d", 99.0, 10, stats)
    lo, hi = stats["values"]["min"][1], stats["values"]["max"][1]
    for axis, want_lo, want_hi in (("head", lo, hi), ("tensor", [lo.min()], [hi.max()])):
        scale, zp = s.for_tensor(1, "values", KVTensorSpec("int2", axis))
        np.testing.assert_allclose(scale, (np.asarray(want_hi) - want_lo) / 3, rtol=1e-6)
        np.testing.assert_allclose((0 - zp) * scale, want_lo, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose((3 - zp) * scale, want_hi, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layer", [-1, 2])
def test_a_layer_outside_the_statistics_is_refused(layer):
    s = KVScales("m", "d", 99.0, 10, _stats(tiny_config()))
    with pytest.raises(ValueError) as err:
        s.for_tensor(layer, "keys", KVTensorSpec("int8", "head"))
    assert str(err.value) == f"KV scales cover layers 0..1, not layer {layer}"


def test_a_dynamic_axis_has_no_static_scale():
    s = KVScales("m", "d", 99.0, 10, _stats(tiny_config()))
    with pytest.raises(ValueError) as err:
        s.for_tensor(0, "keys", KVTensorSpec("int8", "token"))
    assert str(err.value) == "static KV scales apply to axes tensor/head, not 'token'"


def test_the_fingerprint_changes_with_every_figure_and_the_choice_of_statistic():
    config = tiny_config()
    base = KVScales("m", "d", 99.0, 10, _stats(config))
    fp = base.fingerprint()
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert KVScales("x", "y", 99.0, 99, _stats(config), from_cache=True).fingerprint() == fp
    assert KVScales("m", "d", 99.9, 10, _stats(config)).fingerprint() != fp
    assert KVScales("m", "d", 99.0, 10, _stats(config), use_percentile=True).fingerprint() != fp
    # the figures are float32: the same figures held as float64 have the same fingerprint
    wide = {k: {n: v.astype(np.float64) for n, v in s.items()} for k, s in _stats(config).items()}
    assert KVScales("m", "d", 99.0, 10, wide).fingerprint() == fp
    for tensor in ("keys", "values"):
        for name in ("absmax", "min", "max", "percentile", "layer_percentile"):
            stats = _stats(config)
            stats[tensor][name] = stats[tensor][name].copy()
            stats[tensor][name].flat[-1] += 0.5
            changed = KVScales("m", "d", 99.0, 10, stats).fingerprint()
            assert changed != fp, (tensor, name)


def _model_dir(tmp_path, config):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return folder


@pytest.fixture
def stubbed(monkeypatch):
    """compute_kv_statistics replaced: records its calls, returns _stats; 2.5 s per call."""
    calls = []

    def compute(config, params, windows, *, percentile):
        calls.append({"params": params, "percentile": percentile, "shape": np.shape(windows)})
        return _stats(config, seed=len(calls)), int(np.size(windows))

    clock = iter([100.0, 102.5, 200.0, 202.5, 300.0, 302.5])
    monkeypatch.setattr(kv_calibration, "compute_kv_statistics", compute)
    monkeypatch.setattr(kv_calibration.time, "perf_counter", lambda: next(clock))
    return calls


def test_statistics_are_written_once_and_read_back_from_the_cache(tmp_path, stubbed):
    config = tiny_config()
    model, cache = _model_dir(tmp_path, config), tmp_path / "a" / "b"  # made as needed
    windows = np.zeros((3, 5), np.int32)
    params = {"embed": np.zeros(1)}
    first = kv_static_scales(model, windows, model_id="m1", data_hash="d1", cache_dir=cache,
                             percentile=99.5, params=params)  # fmt: skip
    assert len(stubbed) == 1 and stubbed[0]["params"] is params
    assert stubbed[0]["percentile"] == 99.5 and stubbed[0]["shape"] == (3, 5)
    assert (first.model_id, first.data_hash, first.percentile) == ("m1", "d1", 99.5)
    assert (first.tokens, first.seconds, first.from_cache, first.use_percentile) == (
        15,
        2.5,
        False,
        False,
    )
    (path,) = cache.glob("kv-v1-*.parquet")
    meta = json.loads(pq.read_table(path).schema.metadata[b"tenantq.kv"])
    assert meta == {"model_id": "m1", "dataset_hash": "d1", "percentile": 99.5, "tokens": 15,
                    "seconds": 2.5, "windows": [3, 5]}  # fmt: skip
    again = kv_static_scales(model, windows, model_id="m1", data_hash="d1", cache_dir=cache,
                             percentile=99.5, use_percentile=True)  # fmt: skip
    assert len(stubbed) == 1 and again.from_cache and again.use_percentile
    assert (again.model_id, again.data_hash, again.percentile) == ("m1", "d1", 99.5)
    assert (again.tokens, again.seconds) == (15, 2.5)
    for tensor in ("keys", "values"):
        for name, value in first.stats[tensor].items():
            np.testing.assert_array_equal(again.stats[tensor][name], value)
            assert again.stats[tensor][name].shape == value.shape
            assert again.stats[tensor][name].dtype == np.float32
    assert again.fingerprint() != first.fingerprint()  # only the choice of statistic differs
    assert KVScales(**{**again.__dict__, "use_percentile": False}).fingerprint() == (
        first.fingerprint()
    )


@pytest.mark.parametrize("other", [{"model_id": "m2"}, {"data_hash": "d2"}, {"percentile": 99.0}])
def test_another_model_dataset_or_percentile_is_another_cache_entry(tmp_path, stubbed, other):
    config = tiny_config()
    model, windows = _model_dir(tmp_path, config), np.zeros((2, 4), np.int32)
    kw = dict(model_id="m1", data_hash="d1", cache_dir=tmp_path / "c", percentile=99.5, params={})
    kv_static_scales(model, windows, **kw)
    again = kv_static_scales(model, windows, **{**kw, **other})
    assert len(stubbed) == 2 and not again.from_cache
    assert len(list((tmp_path / "c").glob("kv-v1-*.parquet"))) == 2
    assert again.percentile == {**kw, **other}["percentile"]


def test_the_default_percentile_and_cache_folder(tmp_path, stubbed, monkeypatch):
    config = tiny_config()
    monkeypatch.setattr(kv_calibration, "default_cache_dir", lambda: tmp_path / "default")
    got = kv_static_scales(_model_dir(tmp_path, config), np.zeros((1, 4), np.int32),
                           model_id="m", data_hash="d", params={})  # fmt: skip
    assert got.percentile == kv_calibration.DEFAULT_KV_PERCENTILE == 99.99
    assert stubbed[0]["percentile"] == 99.99
    assert len(list((tmp_path / "default").glob("kv-v1-*.parquet"))) == 1


def test_a_checkpoint_is_loaded_in_bf16_only_when_no_params_are_given(
    tmp_path, stubbed, monkeypatch
):
    import tenantq.model.loader as loader

    config = tiny_config()
    loaded = []

    def load(path, cfg, dtype=None):
        loaded.append((path, cfg, dtype))
        return {"embed": "loaded"}

    monkeypatch.setattr(loader, "load_params", load)
    model = _model_dir(tmp_path, config)
    kv_static_scales(model, np.zeros((1, 4), np.int32), model_id="m", data_hash="d",
                     cache_dir=tmp_path / "c")  # fmt: skip
    assert loaded == [(model, config, jnp.bfloat16)]
    assert stubbed[0]["params"] == {"embed": "loaded"}


def test_a_cache_not_every_host_found_is_computed(tmp_path, stubbed):
    config = tiny_config()
    model, windows = _model_dir(tmp_path, config), np.zeros((2, 4), np.int32)
    kw = dict(model_id="m", data_hash="d", cache_dir=tmp_path / "c", params={})
    asked = []
    kv_static_scales(model, windows, agree=lambda found: asked.append(found) or found, **kw)
    again = kv_static_scales(
        model, windows, agree=lambda found: asked.append(found) and False, **kw
    )
    assert asked == [False, True] and not again.from_cache and len(stubbed) == 2
