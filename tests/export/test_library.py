"""The export against compressed-tensors' own choices, and tenantq reading folders the
library wrote itself.

Bounds: each exported config group's `format` is the one compressed-tensors 0.20.1's
`infer_module_format` picks for its scheme (vLLM dispatches on it: a W8A8 int group written
`pack-quantized` is refused there); decompression stays bit-exact (same codes, same float32
scales). A library-written folder tenantq can express reads back to exactly the weights the
library decompresses; one it cannot is a one-line error naming the folder's config.json.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the library checks need CPU torch (parity extra)")
pytest.importorskip("compressed_tensors", reason="needs compressed-tensors (parity extra)")

from _ct import (  # noqa: E402
    assert_bit_equal,
    library_folder,
    library_weights,
    tenantq_weights,
    write_folder,
)

from tenantq.export import export_checkpoint  # noqa: E402
from tenantq.model.compressed import checkpoint_plan, iter_compressed  # noqa: E402
from tenantq.numerics import QArray, dequantize  # noqa: E402
from tenantq.quant.apply import load_quantized  # noqa: E402
from tenantq.quant.plan import QuantPlan  # noqa: E402
from tenantq.testing import tiny_config, tiny_params  # noqa: E402

pytestmark = pytest.mark.parity
CONFIG = tiny_config()
EVERY_SCHEME = {
    "rules": [
        {"pattern": "layers/0/attn/.*", "format": "int8", "activations": "int8"},
        {"pattern": "layers/1/attn/.*", "format": "fp8_e4m3", "activations": "fp8_e4m3"},
        {"pattern": "layers/0/mlp/.*", "format": "int4", "group_size": 16},
        {"pattern": "layers/1/mlp/.*", "format": "fp8_e4m3"},
        {"pattern": "lm_head", "format": "int8"},
    ],
    "kv": {},
}
INT8_CHANNEL = dict(num_bits=8, type="int", symmetric=True, strategy="channel")
INT4_G16 = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=16)
TOKEN_INT8 = dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("lib") / "m", CONFIG, tiny_params(CONFIG))


@pytest.mark.slow  # 6 s at load 12 on 2 cores
def test_each_group_format_is_the_librarys_inference(source, tmp_path):
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig

    plan = QuantPlan.from_dict(EVERY_SCHEME)
    out = tmp_path / "ct"
    export_checkpoint(source, plan, out, quantize_lm_head=True)
    raw = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = QuantizationConfig.model_validate(raw).config_groups.values()
    formats = {s.format: infer_module_format(torch.nn.Linear, s).value for s in groups}
    assert formats == {f: f for f in ("int-quantized", "float-quantized", "pack-quantized",
                                      "naive-quantized")}, formats  # fmt: skip
    assert raw["format"] == "mixed-precision"
    params = load_quantized(source, CONFIG, plan, dtype="float32")
    assert_bit_equal(library_weights(out), tenantq_weights(params, CONFIG))
    back = dict(iter_compressed(out, CONFIG))
    for path, value in params.items():
        if isinstance(value, QArray):
            np.testing.assert_array_equal(dequantize(back[path]), dequantize(value))


@pytest.mark.parametrize(
    ("weights", "acts", "fmt"),
    [(INT8_CHANNEL, TOKEN_INT8, "int-quantized"), (INT4_G16, None, "pack-quantized")],
)
def test_library_written_folder_reads_back_as_the_library_decompresses(
    source, tmp_path, weights, acts, fmt
):
    out = library_folder(source, tmp_path / "lib", weights, acts, fmt=fmt)
    plan, _ = checkpoint_plan(out, CONFIG)
    assert len(plan["rules"]) == 2 * 7 and all(  # 2 layers x 7 projections
        ("activations" in r) == bool(acts) for r in plan["rules"]
    )
    back = dict(iter_compressed(out, CONFIG))
    got = {k: v for k, v in tenantq_weights(back, CONFIG).items()}
    assert_bit_equal(got, library_weights(out))


@pytest.mark.parametrize(
    ("build", "named"),
    [
        (dict(weights={**INT4_G16, "actorder": "weight"}, g_idx=True), "actorder"),
        (dict(weights=INT4_G16, extra={"transform_config": {"config_groups": {"u": {
            "type": "hadamard", "apply": [{"targets": ["Linear"], "location": "weight_input",
                                           "inverse": True}]}}}}), "transform_config"),
        (dict(weights=INT4_G16, extra={"sparsity_config": {"format": "sparse-24-bitmask"}}),
         "sparsity_config"),
        (dict(weights=INT4_G16, acts=TOKEN_INT8, fmt="int-quantized"), "have no tenantq format"),
        (dict(weights=INT8_CHANNEL, acts={**TOKEN_INT8, "symmetric": False},
              fmt="int-quantized"), "symmetric False"),
    ],
)  # fmt: skip
def test_library_folder_tenantq_cannot_express_is_one_line_naming_config(
    source, tmp_path, build, named
):
    build = {"fmt": "pack-quantized", **build}
    weights = build.pop("weights")
    out = library_folder(source, tmp_path / "lib", weights, build.pop("acts", None), **build)
    for read in (lambda: checkpoint_plan(out, CONFIG), lambda: dict(iter_compressed(out, CONFIG))):
        with pytest.raises(ValueError) as err:
            read()
        message = str(err.value)
        assert named in message and f"{out}/config.json" in message and "\n" not in message


def test_output_activations_are_refused_naming_config(source, tmp_path):
    out = library_folder(source, tmp_path / "lib", INT4_G16, fmt="pack-quantized")
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"]["config_groups"]["group_0"]["output_activations"] = {
        "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError) as err:
        checkpoint_plan(out, CONFIG)
    message = str(err.value)
    assert "output_activations" in message and f"{out}/config.json" in message
    assert "\n" not in message
