"""Calibration statistics: windows from text, per-site figures against numpy, the Parquet cache."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from tenantq.evals.data import array_hash
from tenantq.evals.identity import model_identity
from tenantq.quant import input_stats as cal


def _rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def test_layer0_statistics_match_numpy(config, params, windows):
    # Layer 0's attention input is rmsnorm(embed[ids]) * w: independent of attention, so
    # numpy computes it exactly. float32 compute: the bound 1e-4 relative is float32
    # accumulation over 128 tokens, far below any real disagreement (a wrong norm or a
    # missing token moves the Gram by > 1%).
    sites, seconds = cal.compute_statistics(config, params, windows, dtype=jnp.float32)
    x = np.asarray(params["embed"])[windows].reshape(-1, config.hidden_size)
    h = _rmsnorm(x, np.asarray(params["layers/0/input_norm"]), config.rms_norm_eps)
    s = sites["layers/0/attn/in"]
    assert s.paths == ("layers/0/attn/q_proj", "layers/0/attn/k_proj", "layers/0/attn/v_proj")
    assert s.tokens == windows.size
    np.testing.assert_allclose(s.gram, h.T.astype(np.float64) @ h, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(s.absmax, np.abs(h).max(0), rtol=1e-5)
    np.testing.assert_allclose(s.mean_abs, np.abs(h).mean(0), rtol=1e-4)
    # Percentile 99.9 of one batch (4 windows < BATCH_SEQUENCES) of 128 tokens:
    # k = ceil(128 * 0.001) = 1, the largest |x| of the batch, i.e. the absmax.
    np.testing.assert_allclose(s.percentile, np.abs(h).max(0), rtol=1e-5)
    assert len(seconds) == config.num_layers
    assert set(sites) == {
        *(n for i in range(config.num_layers) for n in cal.input_sites(config, i)),
        "head/in",
    }
    # Every Gram is symmetric positive semi-definite (XᵀX).
    for site in sites.values():
        assert np.linalg.eigvalsh(site.gram).min() > -1e-3 * np.trace(site.gram)


def test_percentile_is_the_order_statistic():
    # 1000 tokens, p = 99: k = ceil(1000 * 0.01) = 10 -> the 10th largest |x| per channel.
    x = np.random.default_rng(1).standard_normal((1000, 3)).astype(np.float32)
    parts = cal._partials_jit(jnp.asarray(x), 99.0)
    want = -np.sort(-np.abs(x), axis=0)[9]
    np.testing.assert_allclose(np.asarray(parts[1]), want)


def _collect(checkpoint, windows, cache_dir):
    return cal.collect_statistics(
        checkpoint, windows, model_id=model_identity(checkpoint), data_hash=array_hash(windows),
        cache_dir=cache_dir,
    )  # fmt: skip


def test_second_run_reads_the_cache(checkpoint, windows, tmp_path, monkeypatch):
    first = _collect(checkpoint, windows, tmp_path)
    assert not first.from_cache
    folder = next(tmp_path.iterdir())
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["dataset_hash"] == array_hash(windows)
    assert len(meta["files"]) == 3  # two layers and the head

    def fail(*args, **kwargs):
        raise AssertionError("the second run recomputed instead of reading the cache")

    monkeypatch.setattr(cal, "compute_statistics", fail)
    second = _collect(checkpoint, windows, tmp_path)
    assert second.from_cache
    for name, s in first.sites.items():
        t = second.sites[name]
        assert s.paths == t.paths and s.tokens == t.tokens
        np.testing.assert_array_equal(s.gram, t.gram)
        np.testing.assert_array_equal(s.absmax, t.absmax)
    # Other tokens -> another key -> recomputed (here: refused by the patched function).
    with pytest.raises(AssertionError, match="recomputed"):
        _collect(checkpoint, np.ascontiguousarray(windows[:, ::-1]), tmp_path)
    monkeypatch.undo()
    # On a multi-host slice the hosts read the cache only if every host found it (`agree` is
    # engine.sharding.on_every_host there): told "not on every host", a host that has it
    # computes, as the others do, instead of reading while they wait in a collective.
    asked = []
    third = cal.collect_statistics(
        checkpoint, windows, model_id=model_identity(checkpoint), data_hash=array_hash(windows),
        cache_dir=tmp_path, agree=lambda found: asked.append(found) or False,
    )  # fmt: skip
    assert asked == [True] and not third.from_cache


def test_cut_off_run_is_recomputed(checkpoint, windows, tmp_path):
    first = _collect(checkpoint, windows, tmp_path)
    folder = next(tmp_path.iterdir())
    (folder / "meta.json").unlink()  # as if the run died before finishing
    again = _collect(checkpoint, windows, tmp_path)
    assert not again.from_cache and (folder / "meta.json").is_file()
    np.testing.assert_allclose(
        again.for_path("lm_head").gram, first.for_path("lm_head").gram, rtol=1e-6
    )
