"""The search space reaches the KV cache's static axes, int2 and scale storage, and
canonicalises pairs that cannot exist (a static axis on a format without one float scale; a
scale dtype a trial's formats cannot use) to the plan they become. `kv_scale_dtypes` adds no
parameter unless searched, so earlier studies' parameters and fingerprints are unchanged."""

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


def test_static_axes_and_int2_are_searchable():
    space = SpaceSpec(
        key_formats=["fp8_e4m3", "int2"], key_axes=["channel", "tensor", "head"],
        value_formats=["int8", "int2"], value_axes=["token", "tensor"],
    )  # fmt: skip
    choices = parameter_choices(space, CONFIG)
    assert choices["kv.value_axis"] == ["token", "tensor"]
    plan = plan_from_params(
        space, _params(space, kv__key_format="fp8_e4m3", kv__key_axis="head",
                       kv__value_format="int8", kv__value_axis="tensor"), CONFIG,
    )  # fmt: skip
    assert (plan.kv.key_axis, plan.kv.value_axis) == ("head", "tensor")
    int2 = plan_from_params(space, _params(space, kv__key_format="int2"), CONFIG)
    assert int2.kv.key_format == "int2"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_a_static_axis_on_a_block_format_is_the_formats_default_plan(fmt):
    # MX/nvfp4 carry a scale per block; a per-tensor scale does not apply, so the trial's
    # plan is the format's default axis and shares its fingerprint (evaluated once).
    space = SpaceSpec(key_formats=[fmt], key_axes=["tensor", "channel"])
    static = plan_from_params(space, _params(space, kv__key_axis="tensor"), CONFIG)
    default = plan_from_params(space, _params(space, kv__key_axis="channel"), CONFIG)
    assert static.kv.key_axis == "channel" and static.fingerprint() == default.fingerprint()


def test_value_axis_is_no_parameter_unless_searched_and_baselines_still_build():
    plain = SpaceSpec()
    assert "kv.value_axis" not in parameter_choices(plain, CONFIG)
    searched = SpaceSpec(value_axes=["tensor", "token"])
    for params in baseline_params(searched, CONFIG):
        plan = plan_from_params(searched, params, CONFIG)
        assert plan.kv.value_axis == "token"


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


@pytest.mark.parametrize("axis", ["channel", "token", "tensor", "head"])
def test_a_bf16_key_or_value_has_the_plain_plans_axis_whatever_axis_was_asked(axis):
    # A bf16 tensor has no scale, so its axis cannot matter: it is KVPlan's default (keys per
    # channel, values per token) so trials differing only there share one fingerprint.
    space = SpaceSpec(
        key_formats=["bf16", "int4"], key_axes=["channel", "token", "tensor", "head"],
        value_formats=["int4", "bf16"], value_axes=["token", "channel", "tensor", "head"],
    )  # fmt: skip
    bf16_key = plan_from_params(space, _params(space, kv__key_format="bf16",
                                               kv__key_axis=axis), CONFIG)  # fmt: skip
    assert (bf16_key.kv.key_format, bf16_key.kv.key_axis) == ("bf16", "channel")
    bf16_value = plan_from_params(
        space, _params(space, kv__key_format="int4", kv__value_format="bf16",
                       kv__value_axis=axis), CONFIG,
    )  # fmt: skip
    assert (bf16_value.kv.value_format, bf16_value.kv.value_axis) == ("bf16", "token")
