"""The sensitivity profile's table as every reader checks it (evals/profile.py).

One rule a test, on tables built in memory or written to a temporary file (milliseconds):
the columns, the rows' tensors, formats and KLs, the KV rows' names and layers, one row per
tensor and format, and reading a file by its suffix. Each error is one line that names the
file and the row; the messages are pinned in full because users read them.
"""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from tenantq.evals.profile import check_profile_table, read_profile_table

PATH = "prof.parquet"


def _rows(*rows: tuple) -> pa.Table:
    tensor, fmt, kl = zip(*rows, strict=True) if rows else ((), (), ())
    return pa.table({"tensor": list(tensor), "format": list(fmt), "kl_mean": list(kl)})


def _error(table: pa.Table, num_layers: int | None = None) -> str:
    with pytest.raises(ValueError) as err:
        check_profile_table(table, PATH, num_layers)
    return str(err.value)


def test_a_profile_of_every_kind_of_row_passes_and_is_left_as_it_was() -> None:
    table = _rows(
        ("layers/0/mlp/up_proj", "int4", 0.5),
        ("layers/0/mlp/up_proj", "int8", 0.0),  # a second format of one tensor; KL 0 allowed
        ("kv/0", "int8", 1),  # an integer KL is a number too
        ("kv/3", "int8", 0.25),  # the last layer of a 4-layer model
        ("kv/10", "fp8", 0.1),
    )
    assert check_profile_table(table, PATH) is None  # no model: any layer index
    assert check_profile_table(table.slice(0, 4), PATH, 4) is None
    assert check_profile_table(_rows(), PATH, 4) is None  # no rows: nothing to contradict


def test_missing_columns_are_named_with_the_columns_present() -> None:
    table = pa.table({"tensor": ["lm_head"], "kl_mean": [0.5]})
    assert _error(table) == (
        "sensitivity profile prof.parquet: needs columns ['format', 'kl_mean', 'tensor'], "
        "has ['tensor', 'kl_mean']"
    )
    # Extra columns are the profile's business (intervals, counts): not an error.
    extra = _rows(("lm_head", "int4", 0.5)).append_column("kl_hi", [[0.7]])
    assert check_profile_table(extra, PATH) is None


@pytest.mark.parametrize("tensor", ["", None])
def test_a_row_without_a_tensor_is_refused(tensor) -> None:
    table = pa.table({"tensor": [tensor], "format": ["int4"], "kl_mean": [0.5]})
    assert _error(table) == (
        f"sensitivity profile prof.parquet: a row has tensor {tensor!r}; "
        "expected a tensor path or kv/LAYER"
    )


@pytest.mark.parametrize("fmt", ["", None])
def test_a_row_without_a_format_is_refused(fmt) -> None:
    table = pa.table({"tensor": ["lm_head"], "format": [fmt], "kl_mean": [0.5]})
    assert _error(table) == (
        f"sensitivity profile prof.parquet: row 'lm_head' has format {fmt!r}; "
        "expected the format it was measured at (int4, mxfp4, ...)"
    )


@pytest.mark.parametrize("kl", [math.nan, math.inf, -math.inf, -0.5, -1e-300, None])
def test_a_kl_that_is_not_a_finite_number_at_least_zero_is_refused(kl) -> None:
    # A NaN would rank the tensor least sensitive and have it quantized first.
    table = pa.table(
        {"tensor": ["lm_head"], "format": ["int4"], "kl_mean": pa.array([kl], pa.float64())}
    )
    assert _error(table) == (
        f"sensitivity profile prof.parquet: kl_mean of lm_head (int4) is {kl!r}; a KL is a "
        "finite number >= 0 (re-measure it with `tenantq sensitivity`)"
    )


def test_a_kl_written_as_text_is_refused() -> None:
    table = pa.table({"tensor": ["lm_head"], "format": ["int4"], "kl_mean": ["0.5"]})
    assert "kl_mean of lm_head (int4) is '0.5'; a KL is a finite number >= 0" in _error(table)


@pytest.mark.parametrize(
    "row",
    ["kv/x", "kv/", "kv/-1", "kv/1.0", "kv/ 1", "kv/01", "kv/00", "kv/²", "kv/٣", "kv/1/2"],
)
def test_a_kv_row_is_kv_and_a_layer_written_as_tenantq_writes_it(row) -> None:
    # str.isdigit() takes '²' (int() then fails) and '٣' (Arabic-Indic 3, which int() reads
    # as 3); 'kv/01' names layer 1 a second way, so the space would rank layer 1 twice.
    assert _error(_rows((row, "int8", 0.5))) == (
        f"sensitivity profile prof.parquet: row {row!r} names no KV layer of the model "
        "(None layers); valid rows: kv/LAYER (0, 1, ...) (was it measured on another model?)"
    )


def test_a_kv_layer_beyond_the_model_names_the_valid_rows() -> None:
    table = _rows(("kv/0", "int8", 0.1), ("kv/4", "int8", 0.5))
    assert _error(table, 4) == (
        "sensitivity profile prof.parquet: row 'kv/4' names no KV layer of the model "
        "(4 layers); valid rows: kv/0..kv/3 (was it measured on another model?)"
    )
    assert check_profile_table(table, PATH, 5) is None  # the same rows fit a 5-layer model
    # A weight row's name is the space's to check against the model, not a layer index.
    assert check_profile_table(_rows(("layers/9/mlp/up_proj", "int4", 0.5)), PATH, 4) is None


def test_two_rows_for_one_tensor_and_format_are_refused_with_both_kls() -> None:
    table = _rows(("lm_head", "int4", 0.5), ("kv/1", "int8", 0.2), ("lm_head", "int4", 0.75))
    assert _error(table) == (
        "sensitivity profile prof.parquet: lm_head (int4) has two rows (kl_mean 0.5 and "
        "0.75); a profile has one row per tensor and format"
    )
    # Equal KLs are still two rows: the file was not written by one measurement.
    same = _rows(("kv/1", "int8", 0.2), ("kv/1", "int8", 0.2))
    assert "kv/1 (int8) has two rows (kl_mean 0.2 and 0.2)" in _error(same)
    # The same tensor at two formats, and two tensors at one format, are one row each.
    assert check_profile_table(_rows(("kv/1", "int8", 0.2), ("kv/1", "fp8", 0.2)), PATH) is None
    assert check_profile_table(_rows(("kv/1", "int8", 0.2), ("kv/2", "int8", 0.2)), PATH) is None


def test_the_first_bad_row_is_the_one_named() -> None:
    table = _rows(("lm_head", "int4", 0.5), ("kv/9", "int8", math.nan), ("kv/x", "int8", 0.1))
    assert "kl_mean of kv/9 (int8) is nan" in _error(table, 4)  # its KL is checked first


def _write(path, table: pa.Table):
    pq.write_table(table, path) if path.suffix == ".parquet" else feather.write_feather(table, path)
    return path


ROWS = _rows(("lm_head", "int4", 0.5), ("kv/3", "int8", 0.25))


@pytest.mark.parametrize("name", ["p.parquet", "p.arrow", "p.feather", "p"])
def test_a_profile_file_is_read_as_its_suffix_says_and_checked(tmp_path, name) -> None:
    path = _write(tmp_path / name, ROWS)
    assert read_profile_table(path, 4).to_pydict() == ROWS.to_pydict()
    assert read_profile_table(str(path)).to_pydict() == ROWS.to_pydict()  # a str path too
    with pytest.raises(ValueError) as err:  # the check runs with the model's layers
        read_profile_table(path, 3)
    assert str(err.value) == (
        f"sensitivity profile {path}: row 'kv/3' names no KV layer of the model (3 layers); "
        "valid rows: kv/0..kv/2 (was it measured on another model?)"
    )


def test_a_missing_profile_or_a_folder_is_named(tmp_path) -> None:
    for path, what in ((tmp_path / "none.parquet", "does not exist"), (tmp_path, "is a folder")):
        with pytest.raises(ValueError) as err:
            read_profile_table(path)
        assert str(err.value) == (
            f"sensitivity profile {path} {what}; give a file `tenantq sensitivity --out` wrote"
        )


def test_a_file_in_the_other_format_names_the_format_tried(tmp_path) -> None:
    tail = (
        "; give the table `tenantq sensitivity --out` wrote "
        "(.parquet, or Arrow IPC for other suffixes)"
    )
    as_parquet = tmp_path / "arrow.parquet"
    as_parquet.write_bytes(_write(tmp_path / "p.arrow", ROWS).read_bytes())
    as_arrow = tmp_path / "parquet.arrow"
    as_arrow.write_bytes(_write(tmp_path / "p.parquet", ROWS).read_bytes())
    for path, kind in ((as_parquet, "Parquet"), (as_arrow, "Arrow IPC (Feather)")):
        with pytest.raises(ValueError) as err:
            read_profile_table(path)
        message = str(err.value)
        assert message.startswith(f"sensitivity profile {path}: cannot read it as {kind} (")
        assert message.endswith(tail) and "\n" not in message
        assert err.value.__cause__ is None and err.value.__suppress_context__  # `from None`


def test_an_empty_or_truncated_file_is_an_error_not_a_crash(tmp_path) -> None:
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    cut = tmp_path / "cut.arrow"
    cut.write_bytes(_write(tmp_path / "whole.arrow", ROWS).read_bytes()[:40])
    for path in (empty, cut):
        with pytest.raises(ValueError, match=rf"^sensitivity profile {path}: cannot read it as "):
            read_profile_table(path)


def test_a_kv_profile_as_tenantq_sensitivity_writes_it_is_read_back() -> None:
    # `tenantq sensitivity --kv` writes each layer's keys and values as two rows of kv/{i}
    # at one format (evals.sensitivity.units); the one-row-per-tensor-and-format check read
    # them as two contradicting KLs and refused every KV profile it writes.
    from tenantq.evals import sensitivity
    from tenantq.model.config import ModelConfig

    config = ModelConfig(
        model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
        num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128, eos_token_ids=(2,),
        bos_token_id=1,
    )  # fmt: skip
    units = sensitivity.units(config, "int8", kv=True)
    # distinct KLs, one per row the writer makes
    kls = {("kv/0", "keys"): 0.5, ("kv/0", "values"): 0.1, ("kv/1", "keys"): 0.2,
           ("kv/1", "values"): 0.3, ("kv/2", "keys"): 0.9, ("kv/2", "values"): 0.4}  # fmt: skip
    table = pa.Table.from_pylist(
        [{"tensor": u.tensor, "format": "int8", "kl_mean": kls[u.tensor, u.tensor_class],
          "layer": u.layer, "tensor_class": u.tensor_class, "kind": u.kind} for u in units],
        schema=pa.schema([f for f in sensitivity.SCHEMA if f.name in
                          ("tensor", "format", "kl_mean", "layer", "tensor_class", "kind")]),
    )  # fmt: skip
    assert table.num_rows == 2 * config.num_layers
    assert check_profile_table(table, PATH, config.num_layers) is None
    # a second keys row of one layer is still two KLs for one unit, named with its class
    twice = pa.concat_tables([table, table.slice(2, 1)])
    assert "kv/1 keys (int8) has two rows (kl_mean 0.2 and 0.2)" in _error(twice, 3)


def test_a_kv_profile_file_ranks_layers_by_their_larger_row(tmp_path) -> None:
    # The search reads the written file: each layer ranked by max(keys, values) KL.
    from tenantq.model.config import ModelConfig
    from tenantq.search.space import SensitivityProfile

    config = ModelConfig(
        model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128, eos_token_ids=(2,),
        bos_token_id=1,
    )  # fmt: skip
    rows = [("kv/0", "keys", 0.1), ("kv/0", "values", 0.2), ("kv/1", "keys", 0.5),
            ("kv/1", "values", 0.05)]  # fmt: skip
    path = tmp_path / "kv.parquet"
    pq.write_table(
        pa.table({"tensor": [r[0] for r in rows], "format": ["int8"] * 4,
                  "kl_mean": [r[2] for r in rows], "tensor_class": [r[1] for r in rows]}),
        path,
    )  # fmt: skip
    assert SensitivityProfile.load(path, config).kv_layer_order == (1, 0)


@pytest.mark.parametrize("num_layers", [None, 4])
def test_a_kv_layer_of_thousands_of_digits_names_the_profile_and_row(num_layers) -> None:
    # int() of more than 4,300 digits raises Python's own ValueError (no profile, no row)
    row = "kv/" + "9" * 5000
    if num_layers is None:  # no model to check against: a canonical index passes
        assert check_profile_table(_rows((row, "int8", 0.1)), PATH) is None
    else:
        assert f"row {row!r} names no KV layer of the model (4 layers)" in _error(
            _rows((row, "int8", 0.1)), num_layers
        )
    # one digit more than the layer count has, and equal to it: both beyond the model
    assert "row 'kv/10' names no KV layer" in _error(_rows(("kv/10", "int8", 0.1)), 9)
    assert "row 'kv/9' names no KV layer" in _error(_rows(("kv/9", "int8", 0.1)), 9)
    assert check_profile_table(_rows(("kv/8", "int8", 0.1)), PATH, 9) is None


def test_a_true_or_false_kl_is_refused() -> None:
    # bool is an int to Python: a boolean kl_mean column would have read as KLs 1 and 0
    table = pa.table({"tensor": ["lm_head"], "format": ["int4"], "kl_mean": [True]})
    assert "kl_mean of lm_head (int4) is True; a KL is a finite number >= 0" in _error(table)
