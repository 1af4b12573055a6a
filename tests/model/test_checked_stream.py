"""The loader's NaN/inf checks run on a worker thread ahead of the consumer (issue 14).

What the overlap must not cost: a bad tensor is still named and never yielded (not even the
last one, whose check is the last to finish), the tensors arrive complete and in order
whatever the lookahead, and no thread outlives a load that ends, fails or is abandoned.
"""

from __future__ import annotations

import gc
import itertools
import json
import re
import threading

import numpy as np
import pytest
from hand_checkpoint import CONFIG, ENGINE_FROM_HF, HF_SHAPES, hf_tensors, raw_file, write_raw

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
    check = loader._check_rows

    def recording(source, what, start, stop):
        try:
            return check(source, what, start, stop)
        finally:
            if what.startswith(f"tensor {LAST} "):
                checked_last.set()

    monkeypatch.setattr(loader, "_check_rows", recording)
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


def _recording_checks(monkeypatch, calls: list, hold=None):
    """Record (what, start, stop, thread name) of every row-range check. With `hold`
    (entered, release): the worker's first check sets `entered`, then waits for `release`."""
    check = loader._check_rows
    held = []

    def recording(source, what, start, stop):
        thread = threading.current_thread().name
        calls.append((what, start, stop, thread))
        if hold is not None and thread.startswith("tenantq-finite-check") and not held:
            held.append(what)
            hold[0].set()
            assert hold[1].wait(timeout=60)
        return check(source, what, start, stop)

    monkeypatch.setattr(loader, "_check_rows", recording)


def test_checks_run_on_the_worker_thread_when_it_is_ahead(tmp_path, monkeypatch):
    # The overlap exists: once the worker has checked everything queued (the consumer
    # waits for it here), every tensor after the first is checked off the consumer's thread.
    _checkpoint(tmp_path)
    calls: list = []
    _recording_checks(monkeypatch, calls)
    checked_last = threading.Event()
    check = loader._check_rows

    def signalling(source, what, start, stop):
        check(source, what, start, stop)
        if what.startswith(f"tensor {LAST} "):
            checked_last.set()

    monkeypatch.setattr(loader, "_check_rows", signalling)
    stream = iter_checkpoint(tmp_path, _config())
    first = next(stream)[0]
    assert checked_last.wait(timeout=60)
    assert [first, *(path for path, _array in stream)] == list(ENGINE_FROM_HF)
    later = [c for c in calls if not c[0].startswith("tensor model.embed_tokens.weight ")]
    assert len(later) == len(ENGINE_FROM_HF) - 1  # one row range each: tiny tensors
    assert all(thread.startswith("tenantq-finite-check") for *_, thread in later)


def test_a_waiting_consumer_checks_the_ranges_the_worker_has_not_started(tmp_path, monkeypatch):
    # 16 rows of 6 bf16 (12 bytes) in tasks of 24 bytes: the embedding is 8 ranges of 2 rows.
    # The worker is held inside the first range, so the consumer, asking for the embedding,
    # must take ranges 2-8 back and check them itself; it then opens the gate and waits for
    # range 1 only. A consumer that only waited would hang (the gate opens after its checks).
    monkeypatch.setattr(loader, "_TASK_BYTES", 24)
    _checkpoint(tmp_path)
    calls: list = []
    entered, release = threading.Event(), threading.Event()
    _recording_checks(monkeypatch, calls, (entered, release))
    check, complete = loader._check_rows, loader._complete_checks

    def after_submitting(tasks):  # the worker is inside range 1 before the consumer looks
        assert entered.wait(timeout=60)
        complete(tasks)

    def releasing(source, what, start, stop):
        check(source, what, start, stop)
        if threading.current_thread() is threading.main_thread() and stop == 16:
            release.set()  # the consumer has checked the embedding's last range

    monkeypatch.setattr(loader, "_complete_checks", after_submitting)
    monkeypatch.setattr(loader, "_check_rows", releasing)
    stream = iter_checkpoint(tmp_path, _config())
    assert next(stream)[0] == "embed"
    embed = [c for c in calls if c[0].startswith("tensor model.embed_tokens.weight ")]
    assert sorted((start, stop) for _w, start, stop, _t in embed) == [
        (i, i + 2) for i in range(0, 16, 2)
    ]
    assert [(a, b) for _w, a, b, t in embed if t != "MainThread"] == [(0, 2)]
    stream.close()


def test_every_row_is_checked_exactly_once(tmp_path, monkeypatch):
    # Small tasks (40 bytes: 1-3 rows of the 12-24 byte rows) so most tensors are several
    # ranges, whoever checks them: together they cover each tensor's rows once, no gap.
    monkeypatch.setattr(loader, "_TASK_BYTES", 40)
    _checkpoint(tmp_path)
    calls: list = []
    _recording_checks(monkeypatch, calls)
    load_params(tmp_path, _config())
    for path, (name, _transposed) in ENGINE_FROM_HF.items():
        ranges = sorted((a, b) for w, a, b, _t in calls if w.startswith(f"tensor {name} "))
        rows = HF_SHAPES[name][0]
        assert ranges[0][0] == 0 and ranges[-1][1] == rows, path
        assert all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(ranges)), path


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


@pytest.mark.parametrize("lookahead_bytes", [1, 1 << 30])
def test_the_queue_is_searched_for_a_failure_only_after_one(tmp_path, monkeypatch, lookahead_bytes):
    # Searching every queued tensor's tasks on every item is O(tensors x queue): on the
    # 155.7M bench checkpoint (75 tensors, all inside the lookahead) that was 2,635
    # `Future.exception` and 2,710 `Future.done` calls, the 7-8 ms that made the threaded
    # stream cost x1.13 wall even with the check skipped (`python -m tenantq.bench load
    # --profile`, `thread-nocheck`). A clean load never searches; a failed check still
    # raises (test_a_later_failure_is_raised_at_the_next_item).
    monkeypatch.setattr(loader, "_LOOKAHEAD_BYTES", lookahead_bytes)
    searches: list[int] = []
    search = loader._raise_first_failure

    def counting(pending):
        searches.append(len(pending))
        return search(pending)

    monkeypatch.setattr(loader, "_raise_first_failure", counting)
    _checkpoint(tmp_path)
    assert len(load_params(tmp_path, _config())) == len(ENGINE_FROM_HF)
    assert searches == []
    _checkpoint(tmp_path, bad=LAST)
    with pytest.raises(ValueError, match=re.escape(f"tensor {LAST} (lm_head)")):
        load_params(tmp_path, _config())
