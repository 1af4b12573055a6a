"""Fuzzed safetensors files: every outcome is a correct load or a `ValueError` naming the file.

Hypothesis builds a valid file of random tensors (dtypes, shapes), then damages it: random
data offsets, shapes, dtypes, header-length fields, truncation, appended bytes, dropped
keys, a replaced header. The loader's file reader (`iter_file`, the checks a checkpoint
load runs) must then either raise a `ValueError` whose message names the file, or return
exactly the values an independent decoder reads at the offsets the header claims: never
other bytes (garbage weights), never another exception type, never a hang (each example
runs under a deadline).
"""

from __future__ import annotations

import json
import struct
from datetime import timedelta

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tenantq.model.loader import iter_file

NP = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
ALL_CODES = [*NP, "I8", "U8", "I32", "F8_E4M3", "F4", "BOOL", "XX", ""]

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3)
tensor_specs = st.lists(st.tuples(st.sampled_from(list(NP)), shapes), min_size=1, max_size=4)
mutations = st.one_of(
    st.just(("none",)),
    st.tuples(st.just("offsets"), st.integers(0, 3), st.integers(-8, 400), st.integers(-8, 400)),
    st.tuples(st.just("shape"), st.integers(0, 3), shapes),
    st.tuples(st.just("dtype"), st.integers(0, 3), st.sampled_from(ALL_CODES)),
    st.tuples(st.just("header_len"), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("header_len_delta"), st.integers(-16, 16)),
    st.tuples(st.just("truncate"), st.integers(1, 64)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("drop_key"), st.integers(0, 3), st.sampled_from(["dtype", "shape"])),
    st.tuples(st.just("header"), st.sampled_from(["[]", "5", "null", '"x"', "{", '{"a": 1}'])),
)


def _build(specs, seed):
    rng = np.random.default_rng(seed)
    header, chunks, cursor = {}, [], 0
    for i, (code, shape) in enumerate(specs):
        values = rng.standard_normal(shape).astype(np.float32).astype(NP[code])
        data = values.tobytes()
        header[f"t{i}"] = {
            "dtype": code,
            "shape": shape,
            "data_offsets": [cursor, cursor + len(data)],
        }
        chunks.append(data)
        cursor += len(data)
    return header, b"".join(chunks)


def _apply(mutation, header, data):
    """(header text, header length field, data) after one mutation."""
    kind, *args = mutation
    names = list(header)
    header_len = None
    if kind == "offsets":
        header[names[args[0] % len(names)]]["data_offsets"] = [args[1], args[2]]
    elif kind == "shape":
        header[names[args[0] % len(names)]]["shape"] = args[1]
    elif kind == "dtype":
        header[names[args[0] % len(names)]]["dtype"] = args[1]
    elif kind == "drop_key":
        del header[names[args[0] % len(names)]][args[1]]
    elif kind == "truncate":
        data = data[: max(0, len(data) - args[0])]
    elif kind == "append":
        data = data + args[0]
    text = args[0].encode() if kind == "header" else json.dumps(header).encode()
    if kind == "header_len":
        header_len = args[0]
    elif kind == "header_len_delta":
        header_len = max(0, len(text) + args[0])
    return text, len(text) if header_len is None else header_len, data


def _independent_decode(raw: bytes) -> dict[str, np.ndarray]:
    """Read a file the loader accepted, straight from the bytes the header claims."""
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        out[name] = np.frombuffer(raw[base + begin : base + end], NP[info["dtype"]]).reshape(
            info["shape"]
        )
    return out


@settings(
    max_examples=300,
    deadline=timedelta(seconds=5),
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(specs=tensor_specs, mutation=mutations, seed=st.integers(0, 2**16))
def test_fuzzed_file_loads_correctly_or_fails_naming_the_file(tmp_path, specs, mutation, seed):
    header, data = _build(specs, seed)
    text, header_len, data = _apply(mutation, header, data)
    path = tmp_path / "fuzz.safetensors"
    raw = struct.pack("<Q", header_len) + text + data
    path.write_bytes(raw)
    try:
        loaded = dict(iter_file(path))
    except ValueError as err:
        assert "fuzz.safetensors" in str(err), str(err)
        event(f"refused after {mutation[0]}")
        return
    event(f"loaded after {mutation[0]}")
    want = _independent_decode(raw)
    assert set(loaded) == set(want)
    for name, value in want.items():
        assert loaded[name].dtype == value.dtype and loaded[name].shape == value.shape
        np.testing.assert_array_equal(loaded[name], value)
    if mutation[0] == "none":  # an undamaged file always loads
        assert len(loaded) == len(specs)
