"""Round trip over random plans: every exportable plan exports, the library decompresses it
to tenantq's dequantized weights bit for bit, and tenantq reads back the same QArrays.

Plans draw, per tensor group of the tiny model (hidden 32, MLP 64), a format among the
exportable ones with a group size that divides the input dimension (or none; fp8 per
channel only), W8A8 activations with dynamic or static scales where the format allows
them, and a KV part: bf16, or static fp8 per tensor or per head (random stored scales).
lm_head is quantized through the `quantize_lm_head` opt-in.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="the library check needs CPU torch (parity extra)")
pytest.importorskip("compressed_tensors", reason="needs compressed-tensors (parity extra)")

from _ct import assert_bit_equal, library_weights, tenantq_weights, write_folder  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tenantq.export import export_checkpoint, export_problems  # noqa: E402
from tenantq.model.compressed import (  # noqa: E402
    StoredKVScales,
    checkpoint_plan,
    iter_compressed,
)
from tenantq.numerics import QArray, dequantize  # noqa: E402
from tenantq.quant.apply import apply_plan, load_quantized  # noqa: E402
from tenantq.quant.plan import QuantPlan  # noqa: E402
from tenantq.testing import tiny_config, tiny_params  # noqa: E402

pytestmark = pytest.mark.parity
PATTERNS = ("layers/0/attn/.*", "layers/1/attn/.*", "layers/.*/mlp/.*", "lm_head")
CONFIG = tiny_config()


@st.composite
def rules(draw):
    out = []
    for pattern in PATTERNS:
        fmt = draw(st.sampled_from(("bf16", "int8", "int4", "fp8_e4m3")))
        if fmt == "bf16":
            continue
        group = None if fmt == "fp8_e4m3" else draw(st.sampled_from((None, 8, 16, 32)))
        rule = {"pattern": pattern, "format": fmt}
        if group is not None:
            rule["group_size"] = group
        if fmt in ("int8", "fp8_e4m3") and group is None and draw(st.booleans()):
            rule["activations"] = fmt
            rule["activation_scale"] = draw(st.sampled_from(("dynamic", "static")))
        out.append(rule)
    axis = draw(st.sampled_from((None, "tensor", "head")))
    kv = {} if axis is None else {"key_format": "fp8_e4m3", "key_axis": axis,
                                  "value_format": "fp8_e4m3", "value_axis": axis}  # fmt: skip
    return {"rules": out, "kv": kv}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("rt") / "m", CONFIG, tiny_params(CONFIG))


@pytest.mark.slow
@settings(
    max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(raw=rules())
def test_random_exportable_plans_round_trip(source, tmp_path_factory, raw):
    plan = QuantPlan.from_dict(raw)
    assert export_problems(plan, CONFIG, quantize_lm_head=True) == []
    out = tmp_path_factory.mktemp("out") / "ct"
    float_params = dict(load_quantized(source, CONFIG, None, dtype="float32"))
    amax = {p: {"act_amax": 1.5 + 0.25 * i} for i, p in enumerate(sorted(plan.resolve(CONFIG)))}
    params = apply_plan(float_params, plan, CONFIG, inputs=amax)
    kv_scales = None
    if raw["kv"]:
        heads = CONFIG.num_kv_heads if raw["kv"]["key_axis"] == "head" else 1
        rng = np.random.default_rng(len(raw["rules"]))
        kv_scales = StoredKVScales(
            {(t, layer): rng.uniform(0.01, 0.05, heads).astype(np.float32)
             for t in ("keys", "values") for layer in range(CONFIG.num_layers)}
        )  # fmt: skip
    export_checkpoint(source, plan, out, params=params, kv_scales=kv_scales, quantize_lm_head=True)
    want = tenantq_weights(params, CONFIG)
    assert_bit_equal(library_weights(out), want)
    back = dict(iter_compressed(out, CONFIG))
    for path, value in params.items():
        if isinstance(value, QArray):
            assert isinstance(back[path], QArray) and back[path].fmt == value.fmt, path
            np.testing.assert_array_equal(dequantize(back[path]), dequantize(value))
            act = getattr(value, "act_scale", None)
            assert act is None or np.float32(back[path].act_scale) == np.float32(act), path
        else:
            np.testing.assert_array_equal(np.asarray(back[path], np.float32), value)
    read_plan, stored = checkpoint_plan(out, CONFIG)
    assert read_plan["kv"] == raw["kv"]
    if kv_scales is not None:
        assert stored.fingerprint() == kv_scales.fingerprint()
