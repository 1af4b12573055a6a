"""Format by format, the export checked by compressed-tensors, transformers and tenantq itself.

Bounds: the library's decompressed weights equal tenantq's dequantized weights bit for bit
(both compute (q - zero_point) * scale in float32 from the same codes and scales);
transformers' float32 logits match tenantq's engine within 1e-4 (float32 round-off over
the reference model's 4 layers, the bound tests/parity uses); tenantq reading the export
back gives identical logits (the same QArrays reach the same jitted engine).
int8 *activations* are left out of the transformers comparison: compressed-tensors'
reference quantizes them with scale amax/127.5, tenantq (and vLLM's kernel) with amax/127,
so their logits differ by an activation rounding step, not by round-off.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the export checks need CPU torch (parity extra)")
transformers = pytest.importorskip("transformers", reason="needs transformers (parity extra)")
pytest.importorskip("compressed_tensors", reason="needs compressed-tensors (parity extra)")

from _ct import assert_bit_equal, library_weights, tenantq_weights, write_folder  # noqa: E402

from tenantq.engine import Engine  # noqa: E402
from tenantq.export import export_checkpoint  # noqa: E402
from tenantq.model.compressed import StoredKVScales, iter_compressed  # noqa: E402
from tenantq.model.config import ModelConfig  # noqa: E402
from tenantq.quant.apply import apply_plan, load_quantized  # noqa: E402
from tenantq.quant.plan import QuantPlan  # noqa: E402
from tenantq.reference import reference_model_path  # noqa: E402
from tenantq.testing import tiny_config, tiny_params  # noqa: E402

pytestmark = pytest.mark.parity
TOLERANCE = 1e-4
IDS = [1, 5, 17, 99, 3, 64, 700, 12, 41, 2000, 7, 350]
# One tensor group per exportable scheme on the reference model (hidden 192, MLP 512).
REFERENCE_PLAN = {
    "rules": [
        {"pattern": "layers/0/.*", "format": "int4", "group_size": 64},
        {"pattern": "layers/1/.*", "format": "int8"},
        {"pattern": "layers/2/attn/.*", "format": "fp8_e4m3"},
        {"pattern": "layers/2/mlp/.*", "format": "fp8_e4m3", "activations": "fp8_e4m3"},
        {"pattern": "layers/3/mlp/down_proj", "format": "int4", "group_size": 512},
        {"pattern": "layers/3/.*", "format": "int4", "group_size": 32},
        {"pattern": "lm_head", "format": "fp8_e4m3"},  # by --quantize-lm-head
    ],
    "kv": {},
}


@pytest.fixture(scope="module")
def reference_export(tmp_path_factory):
    plan = QuantPlan.from_dict(REFERENCE_PLAN)
    out = tmp_path_factory.mktemp("export") / "ref-ct"
    export_checkpoint(reference_model_path(), plan, out, quantize_lm_head=True)
    return plan, out


@pytest.mark.slow
def test_library_decompresses_every_format_bit_for_bit(reference_export):
    plan, out = reference_export
    config = ModelConfig.from_file(reference_model_path())
    want = tenantq_weights(load_quantized(reference_model_path(), config, plan), config)
    assert len(want) == 29  # 28 linears and lm_head: every tensor but the embedding
    assert_bit_equal(library_weights(out), want)


@pytest.mark.slow
def test_transformers_logits_match_the_engine_under_the_plan(reference_export):
    plan, out = reference_export
    engine = Engine.from_checkpoint(
        reference_model_path(), plan, dtype="float32", max_seqs=1, max_seq_tokens=32
    )
    want = engine.logits([IDS])[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(torch.tensor([IDS])).logits[0].numpy()
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)
    # the export's own files came along: tokenizer, generation config, the plan
    assert (out / "tokenizer.json").read_bytes() == (
        reference_model_path() / "tokenizer.json"
    ).read_bytes()
    assert (out / "generation_config.json").is_file()
    provenance = json.loads((out / "tenantq_export.json").read_text())
    assert QuantPlan.from_dict(provenance["plan"]).fingerprint() == plan.fingerprint()


@pytest.mark.slow
def test_engine_reads_the_export_back_with_identical_logits(reference_export):
    plan, out = reference_export
    options = dict(dtype="float32", max_seqs=1, max_seq_tokens=32)
    want = Engine.from_checkpoint(reference_model_path(), plan, **options).logits([IDS])[0]
    engine = Engine.from_checkpoint(out, **options)  # no plan: the export's own
    assert {r.format for r in engine.plan.rules} == {"int8", "int4", "fp8_e4m3"}
    np.testing.assert_array_equal(engine.logits([IDS])[0], want)


@pytest.mark.slow
def test_static_activations_and_kv_scales_survive_the_round_trip(tmp_path):
    """W8A8 with static fp8 input scales and dynamic int8, plus a static fp8 KV cache per
    head: weights bit-exact through the library, input/k/v scales stored as tenantq holds
    them, and the engine over the export computes what the engine under the plan does."""
    config = tiny_config()
    source = write_folder(tmp_path / "src", config, tiny_params(config))
    plan = QuantPlan.from_dict(
        {
            "rules": [
                {"pattern": "layers/.*/attn/.*", "format": "fp8_e4m3",
                 "activations": "fp8_e4m3", "activation_scale": "static"},
                {"pattern": "layers/.*/mlp/.*", "format": "int8", "activations": "int8"},
            ],
            "kv": {"key_format": "fp8_e4m3", "key_axis": "head",
                   "value_format": "fp8_e4m3", "value_axis": "head"},
        }
    )  # fmt: skip
    float_params = dict(load_quantized(source, config, None, dtype="float32"))
    amax = {p: {"act_amax": 2.0 + 0.25 * i} for i, p in enumerate(sorted(plan.resolve(config)))}
    params = apply_plan(float_params, plan, config, inputs=amax)
    rng = np.random.default_rng(0)
    kv_scales = StoredKVScales(
        {
            (t, layer): rng.uniform(0.01, 0.05, config.num_kv_heads).astype(np.float32)
            for t in ("keys", "values")
            for layer in range(config.num_layers)
        }
    )
    out = tmp_path / "ct"
    result = export_checkpoint(source, plan, out, params=params, kv_scales=kv_scales)
    assert result.kv_cache_scheme["strategy"] == "attn_head"
    assert_bit_equal(library_weights(out), tenantq_weights(params, config))

    back = dict(iter_compressed(out, config))
    for path, q in params.items():
        if hasattr(q, "act_scale") and q.act_scale is not None:
            assert np.float32(back[path].act_scale) == np.float32(q.act_scale), path
    options = dict(dtype="float32", max_seqs=1, max_seq_tokens=32)
    ids = [[3, 9, 27, 5, 44, 12, 7]]
    want = Engine(config, params, plan, kv_scales=kv_scales, **options).logits(ids)
    np.testing.assert_array_equal(Engine.from_checkpoint(out, **options).logits(ids), want)


@pytest.mark.slow
def test_transformers_runs_static_fp8_activation_scales_as_the_engine(tmp_path):
    """Static W8A8 fp8: the stored `input_scale` is the one transformers quantizes inputs
    with, so logits agree within the float32 round-off bound. (A static fp8 KV cache is
    not compared here: transformers 5.24 ignores `k_scale`/`v_scale` and keeps its cache in
    float, so only tenantq's read-back checks the KV scheme.)"""
    config = tiny_config()
    source = write_folder(tmp_path / "src", config, tiny_params(config))
    plan = QuantPlan.from_dict(
        {"rules": [{"pattern": "layers/.*/attn/.*", "format": "fp8_e4m3",
                    "activations": "fp8_e4m3", "activation_scale": "static"}]}
    )  # fmt: skip
    float_params = dict(load_quantized(source, config, None, dtype="float32"))
    # amax below the inputs' real range, so that clipping at the static scale is exercised
    amax = {p: {"act_amax": 0.5 + 0.25 * i} for i, p in enumerate(sorted(plan.resolve(config)))}
    params = apply_plan(float_params, plan, config, inputs=amax)
    export_checkpoint(source, plan, tmp_path / "ct", params=params)
    ids = [[3, 9, 27, 5, 44, 12, 7]]
    options = dict(dtype="float32", max_seqs=1, max_seq_tokens=32)
    want = Engine(config, params, plan, **options).logits(ids)[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32)
    with torch.no_grad():
        got = model(torch.tensor(ids)).logits[0].numpy()
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)
