"""The loader's NaN/inf checks run on a worker thread ahead of the consumer (issue 14).

What the overlap must not cost: a bad tensor is still named and never yielded (not even the
last one, whose check is the last to finish), the tensors arrive complete and in order
whatever the lookahead, and no thread outlives a load that ends, fails or is abandoned.
"""

from __future__ import annotations

import gc
import json
import re
import threading

import numpy as np
import pytest
from hand_checkpoint import CONFIG, ENGINE_FROM_HF, hf_tensors, raw_file, write_raw

from tenantq.model import loader
from tenantq.model.config import ModelConfig
from tenantq.model.loader import iter_checkpoint, load_params

LAST = "lm_head.weight"  # engine path lm_head: the last tensor the stream yields


def _config() -> ModelConfig:
    return ModelConfig.from_hf_dict(CONFIG)


def _checkpoint(folder, bad: str | None = None, index: int = 0):
    tensors = hf_tensors()
    if bad is not None:
        tensors[bad] = tensors[bad].copy()
        tensors[bad].flat[index] = np.nan
    header, data = raw_file(tensors)
    write_raw(folder / "model.safetensors", header, data)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return tensors


def test_the_last_tensor_is_the_last_one_streamed():
    assert list(loader.hf_names(_config()))[-1] == "lm_head"
    assert ENGINE_FROM_HF["lm_head"] == (LAST, True)


def test_nan_in_the_last_tensor_fails_the_load_naming_it(tmp_path):
    # The last element of the last tensor: the check that finishes last, after every other
    # tensor was already handed to the consumer.
    _checkpoint(tmp_path, bad=LAST, index=16 * 6 - 1)
    threads_before = threading.active_count()
    with pytest.raises(
        ValueError,
        match=rf"^tensor {re.escape(LAST)} \(lm_head\) in model\.safetensors holds 1 "
        r"non-finite values \(1 NaN, 0 inf; first at index \[15, 5\]",
    ):
        load_params(tmp_path, _config())
    assert threading.active_count() == threads_before


def test_a_bad_tensor_is_never_yielded(tmp_path):
    _checkpoint(tmp_path, bad=LAST, index=7)
    seen = []
    with pytest.raises(ValueError, match=re.escape(f"tensor {LAST} (lm_head)")):
        for path, _array in iter_checkpoint(tmp_path, _config()):
            seen.append(path)
    assert "lm_head" not in seen
    assert seen == list(ENGINE_FROM_HF)[: len(seen)]  # what came, came in order


def test_a_later_failure_is_raised_at_the_next_item(tmp_path, monkeypatch):
    # With the whole checkpoint inside the lookahead, the worker checks the last tensor
    # while the consumer still holds the first: the consumer's next request raises then,
    # instead of after converting every tensor in between.
    _checkpoint(tmp_path, bad=LAST)
    checked_last = threading.Event()
    check = loader._map_and_check

    def recording(header, entry, what, transpose):
        try:
            return check(header, entry, what, transpose)
        finally:
            if entry.name == LAST:
                checked_last.set()

    monkeypatch.setattr(loader, "_map_and_check", recording)
    stream = iter_checkpoint(tmp_path, _config())
    assert next(stream)[0] == "embed"
    assert checked_last.wait(timeout=60)
    with pytest.raises(ValueError, match=re.escape(f"tensor {LAST} (lm_head)")):
        next(stream)


@pytest.mark.parametrize("lookahead_bytes", [1, 200, 1 << 30])
def test_every_tensor_arrives_whole_and_in_order_at_any_lookahead(
    tmp_path, monkeypatch, lookahead_bytes
):
    # 1 byte: one tensor ahead (the minimum); 200 bytes: a few of the 84-192 byte tensors;
    # 1 GiB: all of them. bf16 values load bit for bit, so equality is exact.
    monkeypatch.setattr(loader, "_LOOKAHEAD_BYTES", lookahead_bytes)
    hf = _checkpoint(tmp_path)
    got = [(path, np.array(array)) for path, array in iter_checkpoint(tmp_path, _config())]
    assert [path for path, _ in got] == list(ENGINE_FROM_HF)
    for path, array in got:
        name, transposed = ENGINE_FROM_HF[path]
        want = hf[name].T if transposed else hf[name]
        assert np.array_equal(array.view(np.uint16), np.ascontiguousarray(want).view(np.uint16))


def test_checks_run_on_the_worker_thread(tmp_path, monkeypatch):
    # The overlap exists: every tensor is checked off the consumer's thread.
    _checkpoint(tmp_path)
    threads = []
    read = loader.read_tensor

    def recording(source, what, transpose=False):
        threads.append(threading.current_thread())
        return read(source, what, transpose)

    monkeypatch.setattr(loader, "read_tensor", recording)
    load_params(tmp_path, _config())
    assert len(threads) == len(ENGINE_FROM_HF)
    assert all(t is not threading.current_thread() for t in threads)
    assert all(t.name.startswith("tenantq-finite-check") for t in threads)


@pytest.mark.parametrize("how", ["closed", "abandoned", "finished"])
def test_no_thread_outlives_the_stream(tmp_path, how):
    _checkpoint(tmp_path)
    threads_before = threading.active_count()
    stream = iter_checkpoint(tmp_path, _config())
    next(stream)  # the worker thread exists from here on
    assert threading.active_count() == threads_before + 1
    if how == "closed":
        stream.close()
    elif how == "abandoned":
        del stream
        gc.collect()
    else:
        assert len(list(stream)) == len(ENGINE_FROM_HF) - 1
    assert threading.active_count() == threads_before
