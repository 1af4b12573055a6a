"""Sensitivity profiles: one unit quantized at a time, KL with a CI, cached, and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from tenantq.evals import sensitivity
from tenantq.reference import reference_model_path


def test_each_unit_quantizes_exactly_one_thing(config):
    tensors = sensitivity.units(config, "int4")
    quantizable = [p for p, t in config.tensors().items() if t.quantizable]
    assert [u.tensor for u in tensors] == quantizable
    for unit in tensors:
        assert list(unit.plan.resolve(config)) == [unit.tensor]  # regex escaped, fullmatch
    blocks = sensitivity.units(config, "int8", by="block")
    assert {u.tensor for u in blocks} == {
        "embed", "lm_head", *(f"layers/{i}/{b}" for i in range(2) for b in ("attn", "mlp"))
    }  # fmt: skip
    mlp = next(u for u in blocks if u.tensor == "layers/1/mlp")
    assert sorted(mlp.plan.resolve(config)) == [
        f"layers/1/mlp/{n}_proj" for n in ("down", "gate", "up")
    ]
    kv = sensitivity.units(config, "fp8_e4m3", kv=True)
    assert [(u.tensor, u.tensor_class) for u in kv] == [
        ("kv/0", "keys"), ("kv/0", "values"), ("kv/1", "keys"), ("kv/1", "values")
    ]  # fmt: skip
    layers = [kv[1].plan.kv.for_layer(i, 2) for i in range(2)]
    assert (layers[0].key_format, layers[0].value_format) == ("bf16", "fp8_e4m3")
    assert layers[1].is_bf16
    with pytest.raises(ValueError, match="not a quantized weight format"):
        sensitivity.units(config, "bf16")


@pytest.mark.slow
def test_kv_profile_on_the_reference_model_is_cached(tmp_path, monkeypatch, capsys):
    from tenantq.cli import main

    kw = dict(kv=True, rows=4, row_tokens=32, resamples=200, cache_dir=tmp_path, progress=False)
    table = sensitivity.profile(reference_model_path(), "int4", **kw)
    rows = table.to_pylist()
    assert len(rows) == 2 * 4  # 4 layers x (keys, values)
    for r in rows:
        # A CI brackets its point estimate; int4 keys or values (16 levels per channel or
        # token) always move some logits, so every KL is strictly positive.
        assert r["kl_ci_low"] <= r["kl_mean"] <= r["kl_ci_high"] and r["kl_mean"] > 0
        assert r["tokens"] == 4 * 31 and r["kind"] == "kv"

    def refuse(*a, **k):
        raise AssertionError("profiled again instead of reading the cache")

    monkeypatch.setattr("tenantq.engine.Engine", refuse)
    again = sensitivity.profile(reference_model_path(), "int4", **kw)
    assert again.equals(table)
    code = main([
        "sensitivity", "--model", str(reference_model_path()), "--format", "int4", "--kv",
        "--rows", "4", "--row-tokens", "32", "--resamples", "200", "--cache-dir", str(tmp_path),
        "--json", "--no-progress",
    ])  # fmt: skip
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    np.testing.assert_allclose([r["kl_mean"] for r in printed], [r["kl_mean"] for r in rows])
    text = sensitivity.matrix_text(table)
    assert text.splitlines()[0].split() == ["layer", "keys", "values"]
    # The search's sensitivity space reads this table as written (kv/{i} rows rank layers).
    from tenantq.model.config import ModelConfig
    from tenantq.search.space import SensitivityProfile

    pq_path = tmp_path / "kv.parquet"
    pq.write_table(table, pq_path)
    profile = SensitivityProfile.load(pq_path, ModelConfig.from_file(reference_model_path()))
    assert sorted(profile.kv_layer_order) == [0, 1, 2, 3]
