"""Round trip over random plans: every exportable plan exports, the library decompresses it
to tenantq's dequantized weights bit for bit, and tenantq reads back the same QArrays.

Plans draw, per tensor group of the tiny model (hidden 32, MLP 64), a format among the
exportable ones with a group size that divides the input dimension (or none), and W8A8
dynamic activations where the format allows them.
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
from tenantq.model.compressed import iter_compressed  # noqa: E402
from tenantq.numerics import QArray, dequantize  # noqa: E402
from tenantq.quant.apply import load_quantized  # noqa: E402
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
        group = draw(st.sampled_from((None, 8, 16, 32)))
        rule = {"pattern": pattern, "format": fmt}
        if group is not None:
            rule["group_size"] = group
        if fmt in ("int8", "fp8_e4m3") and group is None and draw(st.booleans()):
            rule["activations"] = fmt
        out.append(rule)
    return {"rules": out, "kv": {}}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("rt") / "m", CONFIG, tiny_params(CONFIG))


@pytest.mark.slow
@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(raw=rules())
def test_random_exportable_plans_round_trip(source, tmp_path_factory, raw):
    plan = QuantPlan.from_dict(raw)
    assert export_problems(plan, CONFIG) == []
    out = tmp_path_factory.mktemp("out") / "ct"
    export_checkpoint(source, plan, out)
    params = load_quantized(source, CONFIG, plan, dtype="float32")
    want = tenantq_weights(params, CONFIG)
    assert_bit_equal(library_weights(out), want)
    back = dict(iter_compressed(out, CONFIG))
    for path, value in params.items():
        if isinstance(value, QArray):
            assert isinstance(back[path], QArray) and back[path].fmt == value.fmt, path
            np.testing.assert_array_equal(dequantize(back[path]), dequantize(value))
        else:
            np.testing.assert_array_equal(np.asarray(back[path], np.float32), value)
