"""The search space's KV scale storage (`kv_scale_dtypes` -> `kv.scale_dtype`): no parameter
unless searched (earlier studies' parameters and fingerprints unchanged), and a choice that
cannot apply to a trial's formats falls back to float32, sharing that plan's fingerprint."""

from __future__ import annotations

import pytest

from tenantq.model.config import ModelConfig
from tenantq.reference import reference_model_path
from tenantq.search.space import baseline_params, parameter_choices, plan_from_params
from tenantq.search.spec import SpaceSpec
from tenantq.tracking import flatten_plan

CONFIG = ModelConfig.from_file(reference_model_path() / "config.json")


def _params(space: SpaceSpec, **kv) -> dict:
    params = {k: (v[0] if isinstance(v, list) else v.start) for k, v in
              parameter_choices(space, CONFIG).items()}  # fmt: skip
    params.update({k.replace("__", "."): v for k, v in kv.items()})
    return params


def test_no_scale_dtype_parameter_unless_searched():
    assert "kv.scale_dtype" not in parameter_choices(SpaceSpec(), CONFIG)
    searched = SpaceSpec(kv_scale_dtypes=["float32", "bf16", "e8m0"])
    assert parameter_choices(searched, CONFIG)["kv.scale_dtype"] == ["float32", "bf16", "e8m0"]
    for params in baseline_params(searched, CONFIG):  # baselines keep float32 scales
        assert plan_from_params(searched, params, CONFIG).kv.scale_dtype == "float32"


def test_a_searched_scale_dtype_reaches_the_plan_and_mlflow_params():
    space = SpaceSpec(key_formats=["int4"], value_formats=["int4"], kv_scale_dtypes=["e8m0"])
    plan = plan_from_params(space, _params(space, kv__key_axis="channel"), CONFIG)
    assert plan.kv.scale_dtype == "e8m0"
    assert flatten_plan(plan, CONFIG)["kv.scale_dtype"] == "e8m0"


@pytest.mark.parametrize(
    ("key", "value", "axis", "wanted"),
    [
        ("int2", "int2", "channel", "e8m0"),  # E8M0 is for symmetric formats
        ("mxfp4", "mxfp4", "channel", "bf16"),  # MX keeps its own E8M0 block scales
        ("fp8_e4m3", "fp8_e4m3", "tensor", "bf16"),  # keys and values static per tensor
        ("bf16", "bf16", "channel", "bf16"),  # nothing quantized
    ],
)
def test_a_scale_dtype_that_cannot_apply_is_the_float32_plan(key, value, axis, wanted):
    space = SpaceSpec(
        key_formats=[key], value_formats=[value], key_axes=[axis],
        value_axes=["tensor"] if axis == "tensor" else ["token"],
        kv_scale_dtypes=["float32", wanted],
    )  # fmt: skip
    cheap = plan_from_params(space, _params(space, kv__scale_dtype=wanted), CONFIG)
    plain = plan_from_params(space, _params(space, kv__scale_dtype="float32"), CONFIG)
    assert cheap.kv.scale_dtype == "float32"
    assert cheap.fingerprint() == plain.fingerprint()
