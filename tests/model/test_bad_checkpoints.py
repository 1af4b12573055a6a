"""Checkpoint boundary: hostile safetensors headers, shard indexes, non-finite weights and a
corrupt tokenizer each give one `ValueError` (or, for the optional tokenizer, a warning)
that names the file, the tensor or field, and what would be right; a loader that maps or
transposes a tensor wrongly is caught by a checkpoint written by hand in the HF layout.
"""

from __future__ import annotations

import json
import re

import ml_dtypes
import numpy as np
import pytest
from hand_checkpoint import (
    CONFIG,
    ENGINE_FROM_HF,
    HF_SHAPES,
    hf_tensors,
    raw_file,
    write_checkpoint,
    write_raw,
)

from tenantq.model.config import ModelConfig
from tenantq.model.loader import check_finite, iter_checkpoint, load_params
from tenantq.model.safetensors_header import MAX_HEADER_BYTES
from tenantq.model.tokenizer import TokenizerUnreadableWarning, load_tokenizer

EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"


def _config() -> ModelConfig:
    return ModelConfig.from_hf_dict(CONFIG)


# ------------------------------------------------------------------ the hand-written layout
def test_hand_written_hf_checkpoint_loads_with_every_tensor_in_engine_layout(tmp_path):
    # Catches a flipped transpose flag (issue 15, survivor 7): the expected layout here is
    # written by hand, so the loader's own name table cannot vouch for itself. bf16 values
    # load exactly (no arithmetic on the way), so equality is exact.
    hf = write_checkpoint(tmp_path)
    params = load_params(tmp_path, _config(), dtype="float32")
    assert set(params) == set(ENGINE_FROM_HF)
    for path, (name, transposed) in ENGINE_FROM_HF.items():
        want = hf[name].astype(np.float32)
        want = want.T if transposed else want
        np.testing.assert_array_equal(np.asarray(params[path]), want, err_msg=path)
    assert params["layers/0/mlp/gate_proj"].shape == (6, 12)  # [in, out] = HF [12, 6].T
    assert params["layers/0/mlp/down_proj"].shape == (12, 6)


# ------------------------------------------------------------------ safetensors headers
def _good() -> tuple[dict, bytes]:
    return raw_file(hf_tensors())


def _mutate(change):
    header, data = _good()
    return change(header, data)


def _set(name, key, value):
    def change(header, data):
        header[name][key] = value
        return header, data, None

    return change


def _overlap(header, data):
    # The norm's entry claims the first 12 bytes, which belong to the embedding: two tensors
    # aliasing the same bytes (and the norm's own 12 bytes left as a hole).
    header[NORM]["data_offsets"] = [0, 12]
    return header, data, None


def _into_header(header, data):
    header[EMBED]["data_offsets"] = [-16, 176]
    return header, data, None


def _truncated(header, data):
    return header, data[:-10], None


def _trailing(header, data):
    return header, data + b"\0" * 8, None


def _huge_length(header, data):
    return header, data, 1 << 40  # 1 TiB


def _length_past_file(header, data):
    return header, data, len(json.dumps(header)) + len(data) + 1


def _as_list(header, data):
    return json.dumps([header]).encode(), data, None


def _not_json(header, data):
    return b"\xff\xfe{not json", data, None


def _no_dtype(header, data):
    del header[NORM]["dtype"]
    return header, data, None


def _entry_not_object(header, data):
    header[NORM] = [1, 2]
    return header, data, None


def _bad_metadata(header, data):
    header["__metadata__"] = {"format": 5}
    return header, data, None


def _gap(header, data):
    for entry in header.values():
        entry["data_offsets"] = [o + 8 for o in entry["data_offsets"]]
    return header, b"\0" * 8 + data, None


def _mutate_dtype(header, data):
    header[NORM]["dtype"] = "I16"  # same 2 bytes per element: a valid header, wrong kind
    return header, data, None


# (case id, mutation, regex the message must match: the file, the tensor or field, the rule)
HEADER_CASES = [
    (
        "offsets overlap another tensor",
        _overlap,
        rf"model\.safetensors: tensor {EMBED} bytes \[0, 192\) overlap tensor {NORM} \(which "
        r"ends at 12\); tensors may not share bytes",
    ),
    (
        "offsets into the header",
        _into_header,
        rf"model\.safetensors: tensor {EMBED}: data_offsets \[-16, 176\] must be \[begin, end\] "
        r"with 0 <= begin <= end",
    ),
    (
        "past the end of the file",
        _truncated,
        r"model\.safetensors: tensor lm_head\.weight runs past the end of the file.*truncated",
    ),
    (
        "trailing bytes",
        _trailing,
        r"model\.safetensors: tensor lm_head\.weight ends before the data does",
    ),
    (
        "size differs from itemsize x elements",
        _set(NORM, "shape", [7]),
        rf"model\.safetensors: tensor {NORM}: data_offsets .* span 12 bytes, but BF16 \[7\] "
        r"needs 7 x 16 bits = 14 bytes",
    ),
    (
        "header length 1 TiB",
        _huge_length,
        rf"model\.safetensors: header length field says 1,099,511,627,776 bytes.*at most "
        rf"{MAX_HEADER_BYTES:,}",
    ),
    (
        "header length past the file",
        _length_past_file,
        r"model\.safetensors: header length field says .* the file holds",
    ),
    (
        "header is a JSON list",
        _as_list,
        r"model\.safetensors: header is a JSON list; expected an object \{tensor name",
    ),
    ("header is not JSON", _not_json, r"model\.safetensors: header is not UTF-8 JSON"),
    (
        "entry without dtype",
        _no_dtype,
        rf"model\.safetensors: tensor {NORM}: entry lacks \['dtype'\]; expected dtype, shape",
    ),
    (
        "entry is not an object",
        _entry_not_object,
        rf"model\.safetensors: tensor {NORM}: entry is \[1, 2\]; expected \{{dtype, shape",
    ),
    (
        "unknown dtype",
        _set(NORM, "dtype", "Q7"),
        rf"model\.safetensors: tensor {NORM}: unknown dtype 'Q7'; the format defines BOOL, .*BF16",
    ),
    (
        "negative dimension",
        _set(NORM, "shape", [-6]),
        rf"tensor {NORM}: shape \[-6\] must be a list of non-negative integers",
    ),
    (
        "shape not a list",
        _set(NORM, "shape", "6"),
        rf"tensor {NORM}: shape '6' must be a list of non-negative integers",
    ),
    (
        "offsets not a pair",
        _set(NORM, "data_offsets", [0]),
        rf"tensor {NORM}: data_offsets \[0\] must be \[begin, end\]",
    ),
    (
        "offsets reversed",
        _set(NORM, "data_offsets", [12, 0]),
        rf"tensor {NORM}: data_offsets \[12, 0\] must be \[begin, end\] with 0 <= begin <= end",
    ),
    (
        "gap before the first tensor",
        _gap,
        rf"tensor {EMBED} starts at byte 8 of the data, but the data buffer starts at 0.*gaps",
    ),
    (
        "metadata not strings",
        _bad_metadata,
        r"model\.safetensors: __metadata__ must be an object of strings to strings",
    ),
    (
        "readable format, unreadable dtype",
        _mutate_dtype,
        rf"tensor {NORM} has dtype I16, which the loader cannot read; readable: F64, F32, F16, "
        "BF16",
    ),
]


@pytest.mark.parametrize(
    ("mutation", "message"), [c[1:] for c in HEADER_CASES], ids=[c[0] for c in HEADER_CASES]
)
def test_hostile_safetensors_header_is_named(tmp_path, mutation, message):
    header, data, header_len = _mutate(mutation)
    write_raw(tmp_path / "model.safetensors", header, data, header_len=header_len)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(ValueError, match=message):
        load_params(tmp_path, _config())


def test_file_shorter_than_its_length_field(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00")
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(ValueError, match=r"model\.safetensors: not a safetensors file \(2 bytes"):
        load_params(tmp_path, _config())


def test_no_tensor_is_read_from_a_file_whose_header_fails(tmp_path):
    # Validation happens before any data is mapped: the stream fails on its first item, so
    # no consumer ever sees a tensor of a damaged file (the damage is in the last entry).
    header, data = _good()
    header["lm_head.weight"]["shape"] = [16, 7]
    write_raw(tmp_path / "model.safetensors", header, data)
    stream = iter_checkpoint(tmp_path, _config())
    with pytest.raises(ValueError, match=r"tensor lm_head\.weight: data_offsets"):
        next(stream)


# ------------------------------------------------------------------ non-finite weights
@pytest.mark.parametrize(
    ("name", "dtype", "value", "counts"),
    [
        (NORM, "BF16", np.nan, r"1 non-finite values \(1 NaN, 0 inf"),
        ("model.layers.0.mlp.down_proj.weight", "F32", np.inf, r"\(0 NaN, 1 inf"),
        ("model.layers.0.self_attn.k_proj.weight", "F16", -np.inf, r"\(0 NaN, 1 inf"),
        (EMBED, "BF16", np.nan, r"1 NaN"),
    ],
)
def test_non_finite_weight_is_named_while_streaming(tmp_path, name, dtype, value, counts):
    tensors = {k: v.astype(np.float32) for k, v in hf_tensors().items()}
    tensors[name] = tensors[name].copy()
    tensors[name].flat[3] = value
    np_dtype = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}[dtype]
    header, data = raw_file({k: v.astype(np_dtype) for k, v in tensors.items()}, dtype)
    write_raw(tmp_path / "model.safetensors", header, data)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    index = [int(i) for i in np.unravel_index(3, HF_SHAPES[name])]
    with pytest.raises(
        ValueError,
        match=rf"tensor {re.escape(name)} \(.*\) in model\.safetensors holds .*{counts}.*first at "
        rf"index {re.escape(str(index))}.*weights must be finite",
    ):
        load_params(tmp_path, _config())


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_finite_check_draws_the_line_at_the_exponent_bits(dtype):
    # IEEE 754: all-ones exponent = inf/NaN. The largest finite value, the smallest
    # subnormal and -0 (bit patterns next to the check's thresholds) pass; +-inf and +-NaN
    # (the sign bit set on a NaN is the unsigned view's largest pattern) fail, alone
    # among finite values, whichever element holds them.
    info = ml_dtypes.finfo(dtype)
    finite = np.array([info.max, -info.max, info.smallest_subnormal, -0.0, 1.0], dtype)
    check_finite(finite, "ok")
    for bad in (np.inf, -np.inf, np.nan, -np.nan):
        for position in (0, 4):
            values = finite.copy()
            values[position] = bad
            with pytest.raises(ValueError, match=r"^t holds 1 non-finite values"):
                check_finite(values.reshape(5, 1), "t")
    assert np.signbit(np.array(-np.nan, dtype))  # the -NaN case really has its sign bit set


def test_non_finite_weight_is_named_under_a_plan(tmp_path):
    from tenantq.quant.apply import load_quantized
    from tenantq.quant.plan import QuantPlan

    tensors = hf_tensors()
    tensors["model.layers.0.mlp.up_proj.weight"][5, 2] = np.nan
    header, data = raw_file(tensors)
    write_raw(tmp_path / "model.safetensors", header, data)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(ValueError, match=r"mlp\.up_proj\.weight \(layers/0/mlp/up_proj\).*NaN"):
        load_quantized(tmp_path, _config(), QuantPlan.uniform("int8", "bf16"))


# ------------------------------------------------------------------ shard index
def _sharded(folder, weight_map_text: str):
    tensors = hf_tensors()
    names = sorted(tensors)
    for k, part in enumerate((names[:6], names[6:])):
        header, data = raw_file({n: tensors[n] for n in part})
        write_raw(folder / f"model-{k}.safetensors", header, data)
    (folder / "model.safetensors.index.json").write_text(weight_map_text)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return {n: f"model-{0 if n in names[:6] else 1}.safetensors" for n in names}


INDEX_CASES = [
    ("not JSON", lambda m: "{weight_map", r"model\.safetensors\.index\.json: not valid JSON"),
    (
        "a JSON list",
        lambda m: json.dumps([m]),
        r"index\.json: expected an object with a non-empty \"weight_map\"",
    ),
    (
        "no weight_map",
        lambda m: json.dumps({"metadata": {}}),
        r"index\.json: expected an object with a non-empty \"weight_map\"",
    ),
    (
        "shard outside the folder",
        lambda m: json.dumps({"weight_map": {**m, NORM: "../model-1.safetensors"}}),
        rf"weight_map\['{re.escape(NORM)}'\] = '\.\./model-1\.safetensors' points outside the "
        r"checkpoint folder.*must be files in that folder",
    ),
    (
        "absolute shard path",
        lambda m: json.dumps({"weight_map": {**m, NORM: "/etc/model-1.safetensors"}}),
        r"points outside the checkpoint folder",
    ),
    (
        "shard that is not safetensors",
        lambda m: json.dumps({"weight_map": {**m, NORM: "pytorch_model.bin"}}),
        rf"weight_map\['{re.escape(NORM)}'\] is 'pytorch_model\.bin'; expected the file name of "
        r"a \.safetensors shard",
    ),
    (
        "shard file missing",
        lambda m: json.dumps({"weight_map": {**m, NORM: "model-7.safetensors"}}),
        rf"tensor {re.escape(NORM)} \(final_norm\): the index names model-7\.safetensors, "
        r"which is missing",
    ),
]


@pytest.mark.parametrize(
    ("index", "message"), [c[1:] for c in INDEX_CASES], ids=[c[0] for c in INDEX_CASES]
)
def test_bad_shard_index_is_named(tmp_path, index, message):
    weight_map = _sharded(tmp_path, "{}")
    (tmp_path / "model.safetensors.index.json").write_text(index(weight_map))
    with pytest.raises(ValueError, match=message):
        load_params(tmp_path, _config())


def test_good_shard_index_loads_like_one_file(tmp_path):
    weight_map = _sharded(tmp_path, "{}")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = load_params(tmp_path, _config(), dtype="float32")
    single = tmp_path / "single"
    single.mkdir()
    write_checkpoint(single)
    whole = load_params(single, _config(), dtype="float32")
    for path in whole:
        np.testing.assert_array_equal(np.asarray(sharded[path]), np.asarray(whole[path]))


# ------------------------------------------------------------------ tokenizer.json
@pytest.mark.parametrize(
    "text",
    ['{"version": "1.0", "model": 5}', "[1, 2, 3]", "{not json"],
    ids=["wrong model field", "JSON list", "not JSON"],
)
def test_corrupt_tokenizer_warns_naming_it_and_the_model_still_loads(tmp_path, text):
    from tenantq.engine import Engine

    write_checkpoint(tmp_path)
    (tmp_path / "tokenizer.json").write_text(text)
    with pytest.warns(
        TokenizerUnreadableWarning,
        match=r"tokenizer\.json: the tokenizer could not be read .*runs on token ids only",
    ):
        assert load_tokenizer(tmp_path) is None
    with pytest.warns(TokenizerUnreadableWarning):
        engine = Engine.from_checkpoint(tmp_path, dtype="float32", max_seqs=1, max_seq_tokens=8)
    assert engine.tokenizer is None
    assert engine.logits([[1, 5, 7]]).shape == (1, 3, 16)
