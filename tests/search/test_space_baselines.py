"""The baselines a study starts with, as each space's parameters, and the parameters a trial
is asked for: exactly the choices the space declares (Optuna refuses a suggestion whose
distribution differs from the one a sampler declared)."""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, IntDistribution

from tenantq.capacity import get_model_config
from tenantq.evals.profile import read_profile_table
from tenantq.search.space import (
    SensitivityProfile,
    _edge_layers,
    baseline_params,
    distributions,
    parameter_choices,
    suggest,
)
from tenantq.search.spec import SpaceSpec

CONFIG = get_model_config("tenantq-ref")  # 4 layers, untied lm_head
WEIGHTS = ["w.attn_qkv", "w.attn_o", "w.mlp_gate_up", "w.mlp_down", "w.embed", "w.lm_head"]


def _expected(weights: str, kv: str) -> dict:
    return {name: weights for name in WEIGHTS} | {
        "bf16_first_layers": 0,
        "bf16_last_layers": 0,
        "kv.key_format": kv,
        "kv.key_axis": "channel",
        "kv.value_format": kv,
        "kv.sink_tokens": 0,
        "kv.bf16_layers": "none",
    }


def test_the_default_space_starts_from_bf16_fp8_and_int4_with_bf16_kv() -> None:
    assert baseline_params(SpaceSpec(), CONFIG) == [
        _expected("bf16", "bf16"),
        _expected("fp8_e4m3", "fp8_e4m3"),
        _expected("int4", "bf16"),
    ]


def test_baselines_take_the_spaces_own_choices_where_the_default_is_missing() -> None:
    space = SpaceSpec(
        weight_formats=["bf16", "int4"],  # no fp8: its baseline cannot be expressed
        key_axes=["token"],
        value_axes=["tensor", "channel"],
        sink_tokens=[8, 4],
        kv_scale_dtypes=["bf16", "e8m0"],
        kv_bf16_layers=["first", "last"],
    )
    got = baseline_params(space, CONFIG)
    assert [b["w.attn_o"] for b in got] == ["bf16", "int4"]
    for b in got:
        assert b["kv.key_axis"] == "token" and b["kv.value_axis"] == "tensor"
        assert b["kv.sink_tokens"] == 4 and b["kv.scale_dtype"] == "bf16"
        assert b["kv.bf16_layers"] == "first"
    kept = SpaceSpec(
        key_axes=["token", "channel"],
        value_axes=["channel", "token"],
        kv_scale_dtypes=["e8m0", "float32"],
        kv_bf16_layers=["first_last", "none"],
    )
    first = baseline_params(kept, CONFIG)[0]  # the defaults, wherever they are listed
    assert first["kv.key_axis"] == "channel" and first["kv.value_axis"] == "token"
    assert first["kv.scale_dtype"] == "float32" and first["kv.bf16_layers"] == "none"


def test_a_baseline_whose_kv_format_is_not_searched_is_left_out() -> None:
    space = SpaceSpec(key_formats=["bf16", "int8"], value_formats=["bf16", "int8"])
    assert [b["w.mlp_down"] for b in baseline_params(space, CONFIG)] == ["bf16", "int4"]


def _sensitivity(**kw) -> tuple[SpaceSpec, SensitivityProfile]:
    space = SpaceSpec(kind="sensitivity", profile="profile.parquet", **kw)
    order = ("layers/0/mlp/down_proj", "lm_head", "layers/3/attn/o_proj")
    return space, SensitivityProfile(tensor_order=order, kv_layer_order=(3, 0))


def test_sensitivity_baselines_keep_everything_or_nothing_in_bf16() -> None:
    space, profile = _sensitivity()
    got = baseline_params(space, CONFIG, profile)
    # bf16 weights are not a sens.format choice: that baseline is expressed by no other
    # parameter, so it is left out; fp8 and int4 keep no tensor and no KV layer in bf16.
    assert got == [
        {"sens.format": "fp8_e4m3", "sens.keep_bf16": 0, "sens.kv_keep_bf16": 0,
         "kv.key_format": "fp8_e4m3", "kv.key_axis": "channel",
         "kv.value_format": "fp8_e4m3", "kv.sink_tokens": 0},
        {"sens.format": "int4", "sens.keep_bf16": 0, "sens.kv_keep_bf16": 0,
         "kv.key_format": "bf16", "kv.key_axis": "channel",
         "kv.value_format": "bf16", "kv.sink_tokens": 0},
    ]  # fmt: skip
    only_bf16, profile = _sensitivity(weight_formats=["bf16"])
    (b,) = baseline_params(only_bf16, CONFIG, profile)
    assert b["sens.format"] == "bf16" and b["sens.keep_bf16"] == 3  # every ranked tensor


def test_a_trial_is_asked_each_parameter_with_the_declared_distribution() -> None:
    space, profile = _sensitivity(max_keep_bf16=2)
    choices = parameter_choices(space, CONFIG, profile)
    declared = distributions(choices)
    assert declared["sens.keep_bf16"] == IntDistribution(0, 2)
    assert declared["sens.kv_keep_bf16"] == IntDistribution(0, 2)  # two profiled KV layers
    assert declared["sens.format"] == CategoricalDistribution(["fp8_e4m3", "int8", "int4"])
    assert declared["kv.sink_tokens"] == CategoricalDistribution([0, 4])
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(12):
        trial = study.ask()
        params = suggest(trial, space, CONFIG, profile)
        assert trial.distributions == declared and trial.params == params
        assert list(params) == list(choices)
        study.tell(trial, 0.0)
    asked = {t.params["sens.keep_bf16"] for t in study.trials}
    assert asked <= {0, 1, 2} and len(asked) > 1


def test_max_keep_bf16_zero_keeps_no_tensor_in_bf16() -> None:
    # `max_keep_bf16` caps k, the number of most sensitive tensors kept in bf16 (spec.py):
    # 0 means none (it was read as "no limit", a falsy check); absent means every tensor of
    # the profile (3 here), and a cap above that is the profile's length.
    from tenantq.search.space import plan_from_params

    space, profile = _sensitivity(max_keep_bf16=0, weight_formats=["int4"])
    choices = parameter_choices(space, CONFIG, profile)
    assert choices["sens.keep_bf16"] == range(0, 1)
    assert distributions(choices)["sens.keep_bf16"] == IntDistribution(0, 0)
    params = {name: (c[0] if isinstance(c, list) else c.start) for name, c in choices.items()}
    resolved = plan_from_params(space, params, CONFIG, profile=profile).resolve(CONFIG)
    assert {resolved[t].format for t in profile.tensor_order} == {"int4"}  # none kept bf16
    for cap, top in ((None, 3), (1, 1), (3, 3), (7, 3)):
        space, profile = _sensitivity(max_keep_bf16=cap)
        assert parameter_choices(space, CONFIG, profile)["sens.keep_bf16"] == range(0, top + 1)


def test_edge_layer_choices_up_to_the_model_depth_are_accepted() -> None:
    space = SpaceSpec(bf16_first_layers=[0, 4], bf16_last_layers=[4])
    assert parameter_choices(space, CONFIG)["bf16_first_layers"] == [0, 4]
    with pytest.raises(
        ValueError, match=r"^space: bf16 edge-layer choices \[5\] exceed the model's 4 layers$"
    ):
        parameter_choices(SpaceSpec(bf16_last_layers=[1, 5]), CONFIG)


def test_edge_layers_cover_the_first_and_last_layers_asked_for() -> None:
    assert _edge_layers(0, 0, CONFIG) == []
    assert _edge_layers(1, 1, CONFIG) == [0, 3]
    assert _edge_layers(0, 4, CONFIG) == [0, 1, 2, 3]  # every layer from the end
    assert _edge_layers(9, 9, CONFIG) == [0, 1, 2, 3]


def _profile(tmp_path, name: str, rows: dict[str, list]):
    import pyarrow as pa
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    path = tmp_path / name
    table = pa.table(rows)
    pq.write_table(table, path) if path.suffix == ".parquet" else feather.write_feather(table, path)
    return path


ROWS = {"tensor": ["lm_head", "kv/3"], "format": ["int4", "int8"], "kl_mean": [0.5, 0.25]}


@pytest.mark.parametrize("name", ["p.parquet", "p.arrow"])
def test_a_profile_is_read_in_the_format_its_suffix_names(tmp_path, name) -> None:
    path = _profile(tmp_path, name, ROWS)
    assert read_profile_table(path, 4).column("tensor").to_pylist() == ["lm_head", "kv/3"]
    with pytest.raises(ValueError, match=rf"^sensitivity profile {path}: row 'kv/3' names no "
                                         r"KV layer of the model \(3 layers\)"):  # fmt: skip
        read_profile_table(path, 3)


def test_an_unreadable_profile_names_the_file_and_the_format_tried(tmp_path) -> None:
    missing = tmp_path / "none.parquet"
    with pytest.raises(
        ValueError,
        match=rf"^sensitivity profile {missing} does not exist; "
        r"give a file `tenantq sensitivity --out` wrote$",
    ):
        read_profile_table(missing)
    arrow = _profile(tmp_path, "p.arrow", ROWS)
    as_parquet = tmp_path / "arrow.parquet"
    as_parquet.write_bytes(arrow.read_bytes())
    parquet = _profile(tmp_path, "p.parquet", ROWS)
    as_arrow = tmp_path / "parquet.feather"
    as_arrow.write_bytes(parquet.read_bytes())
    tail = (r"; give the table `tenantq sensitivity --out` wrote "
            r"\(.parquet, or Arrow IPC for other suffixes\)$")  # fmt: skip
    with pytest.raises(ValueError, match=rf"^sensitivity profile {as_parquet}: cannot read it "
                                         rf"as Parquet \(.*\){tail}"):  # fmt: skip
        read_profile_table(as_parquet)
    with pytest.raises(ValueError, match=rf"^sensitivity profile {as_arrow}: cannot read it "
                                         rf"as Arrow IPC \(Feather\) \(.*\){tail}"):  # fmt: skip
        read_profile_table(as_arrow)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ({"tensor": ["lm_head"], "kl_mean": [0.5]},
         "needs columns ['format', 'kl_mean', 'tensor'], has ['tensor', 'kl_mean']"),
        ({"tensor": [""], "format": ["int4"], "kl_mean": [0.5]},
         "a row has tensor ''; expected a tensor path or kv/LAYER"),
        ({"tensor": [None], "format": ["int4"], "kl_mean": [0.5]},
         "a row has tensor None; expected a tensor path or kv/LAYER"),
        ({"tensor": ["lm_head"], "format": ["int4"], "kl_mean": [float("nan")]},
         "kl_mean of lm_head (int4) is nan; a KL is a finite number >= 0 (re-measure it with "
         "`tenantq sensitivity`)"),
        ({"tensor": ["lm_head"], "format": ["int8"], "kl_mean": [-0.5]},
         "kl_mean of lm_head (int8) is -0.5; a KL is a finite number >= 0"),
        ({"tensor": ["kv/x"], "format": ["int8"], "kl_mean": [0.5]},
         "row 'kv/x' names no KV layer of the model (None layers); valid rows: "
         "kv/LAYER (0, 1, ...) (was it measured on another model?)"),
    ],
)  # fmt: skip
def test_a_bad_profile_row_is_one_line_naming_it(rows, message) -> None:
    import pyarrow as pa

    from tenantq.evals.profile import check_profile_table

    with pytest.raises(ValueError) as err:
        check_profile_table(pa.table(rows), "prof.parquet")
    assert str(err.value).startswith(f"sensitivity profile prof.parquet: {message}")


def test_a_zero_kl_and_any_kv_layer_of_an_unknown_model_are_accepted() -> None:
    import pyarrow as pa

    from tenantq.evals.profile import check_profile_table

    rows = {"tensor": ["lm_head", "kv/9"], "format": ["int4", "int4"], "kl_mean": [0.0, 1.0]}
    check_profile_table(pa.table(rows), "prof.parquet")  # no model given: any layer index
    with pytest.raises(ValueError, match=r"row 'kv/9' names no KV layer .*kv/0\.\.kv/3 "):
        check_profile_table(pa.table(rows), "prof.parquet", 4)


def test_a_profile_loaded_for_a_model_refuses_a_kv_row_past_its_last_layer(tmp_path) -> None:
    rows = {"tensor": ["lm_head", "kv/4"], "format": ["int4", "int4"], "kl_mean": [0.5, 1.0]}
    path = _profile(tmp_path, "p.parquet", rows)
    with pytest.raises(ValueError, match=r"row 'kv/4' names no KV layer of the model \(4 layers\)"):
        SensitivityProfile.load(path, CONFIG)  # layers 0..3
    ok = _profile(tmp_path, "q.parquet", rows | {"tensor": ["lm_head", "kv/3"]})
    assert SensitivityProfile.load(ok, CONFIG) == SensitivityProfile(("lm_head",), (3,))


def test_a_profile_of_another_model_names_its_first_three_unknown_tensors(tmp_path) -> None:
    # The message shows the first three unknown tensors in sorted order (enough to recognise
    # another model without a screenful), then asks the question that explains them.
    unknown = ["blocks/0/wq", "blocks/0/wk", "blocks/1/wq", "blocks/1/wk"]
    rows = {"tensor": ["lm_head", *unknown], "format": ["int4"] * 5, "kl_mean": [0.5] * 5}
    path = _profile(tmp_path, "p.parquet", rows)
    with pytest.raises(ValueError) as err:
        SensitivityProfile.load(path, CONFIG)
    assert str(err.value) == (
        f"sensitivity profile {path}: tensors not in the model: "
        "['blocks/0/wk', 'blocks/0/wq', 'blocks/1/wk'] (was it measured on another model?)"
    )
