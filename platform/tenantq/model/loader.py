"""Read a Hugging Face checkpoint folder (safetensors only) as a stream of engine tensors.

`iter_checkpoint` yields `(engine path, array in engine layout)` one tensor at a time, so a
caller that converts each tensor before asking for the next (`load_params`, or quantization
in `tenantq.quant.apply.load_quantized`) holds the model plus one tensor. Every tensor is
checked for shape against config.json and for NaN/inf before it is yielded. Pickle
(`*.bin`) is never read. Errors are `ValueError`s naming the file, the tensor and what
was expected; nothing is yielded from a file whose header is not valid.

Why not `safetensors.safe_open`: it validates headers too, but its errors name neither the
file nor, for several faults, the tensor, and its numpy `get_tensor` copies every tensor.
Here the header is validated completely first (`SafetensorsHeader`, with named messages);
each tensor is then a read-only memory map of exactly the span the header gives it
(`map_tensor`), checked for NaN/inf in cache-sized blocks (`_check_rows`)
by one worker thread that runs a bounded distance ahead of the consumer (`_checked_stream`),
so the check overlaps the consumer's copy; its cost is measured by
`python -m tenantq.bench load`.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from tenantq.model.config import ATTN_PROJ, ModelConfig, is_compressed_tensors
from tenantq.model.safetensors_header import SafetensorsHeader, TensorEntry

# safetensors dtype codes the loader reads; others (ints, fp8, packed GPTQ) are rejected.
READABLE_DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
}
# HF tensors that carry nothing the engine needs (precomputed RoPE tables).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")
INDEX_FILE = "model.safetensors.index.json"


def hf_names(config: ModelConfig) -> dict[str, tuple[str, bool]]:
    """Engine tensor path -> (HF tensor name, transpose on load)."""
    out: dict[str, tuple[str, bool]] = {"embed": ("model.embed_tokens.weight", False)}
    for path in config.tensors():
        parts = path.split("/")
        if parts[0] != "layers":
            continue
        hf = f"model.layers.{parts[1]}"
        kind, name = parts[2], parts[-1]
        if kind == "input_norm":
            out[path] = (f"{hf}.input_layernorm.weight", False)
        elif kind == "post_attn_norm":
            out[path] = (f"{hf}.post_attention_layernorm.weight", False)
        elif kind == "mlp":
            out[path] = (f"{hf}.mlp.{name}.weight", True)
        elif name in ATTN_PROJ:
            out[path] = (f"{hf}.self_attn.{name}.weight", True)
        elif name.endswith("_bias"):
            out[path] = (f"{hf}.self_attn.{name[0]}_proj.bias", False)
        elif name.endswith("_norm"):
            out[path] = (f"{hf}.self_attn.{name}.weight", False)
    out["final_norm"] = ("model.norm.weight", False)
    if not config.tie_word_embeddings:
        out["lm_head"] = ("lm_head.weight", True)
    missing = set(config.tensors()) - set(out)
    if missing:  # a new tensor kind in config.tensors() without a mapping here
        raise ValueError(f"no Hugging Face name known for {sorted(missing)}")
    return out


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """HF tensor name -> the file holding it (sharded via the index, or every file).

    An index is read as JSON (the error names it when it is not), its shard names must be
    plain file names inside `folder`: a path that leaves the folder is refused.
    """
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            raw = json.loads(index.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{index}: not valid JSON ({err})") from None
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(
                f'{index}: expected an object with a non-empty "weight_map" '
                "{tensor name: shard file name}"
            )
        root = folder.resolve()
        out: dict[str, Path] = {}
        for name, file in weight_map.items():
            if not isinstance(file, str) or not file.endswith(".safetensors"):
                raise ValueError(
                    f"{index}: weight_map[{name!r}] is {file!r}; expected the file name of a "
                    ".safetensors shard in the same folder"
                )
            shard = (folder / file).resolve()
            if shard.parent != root:
                raise ValueError(
                    f"{index}: weight_map[{name!r}] = {file!r} points outside the checkpoint "
                    f"folder {folder}; shards must be files in that folder"
                )
            out[name] = shard
        return out
    if not folder.is_dir():
        raise ValueError(
            f"checkpoint {folder} is not a folder; give a Hugging Face checkpoint folder"
        )
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.glob("*.bin"))
        hint = f" (found {pickles}; pickle checkpoints are never read)" if pickles else ""
        raise ValueError(f"no *.safetensors files in {folder}{hint}")
    out = {}
    for path in files:
        for name in SafetensorsHeader.read(path).entries:
            out[name] = path
    return out


def _check_tied_head(folder: Path, where: dict[str, Path]) -> None:
    """config.json ties the output head to the embedding, yet the checkpoint holds an
    `lm_head.weight`: fine when it is the embedding's copy (some exports save both), an
    error when it differs: loading would throw a trained head away without a word."""
    embed_name, head_name = "model.embed_tokens.weight", "lm_head.weight"
    if embed_name not in where:
        return  # reported as a missing tensor by the caller
    header = {f: SafetensorsHeader.read(f) for f in {where[embed_name], where[head_name]}}
    embed_entry = header[where[embed_name]].entries[embed_name]
    head_entry = header[where[head_name]].entries[head_name]
    same = embed_entry.shape == head_entry.shape and embed_entry.dtype == head_entry.dtype
    if same and embed_entry.dtype in READABLE_DTYPES:
        embed = map_tensor(header[where[embed_name]], embed_entry)
        head = map_tensor(header[where[head_name]], head_entry)
        same = embed.tobytes() == head.tobytes()
    if not same:
        raise ValueError(
            f"{folder / 'config.json'}: tie_word_embeddings is true, but "
            f"{where[head_name].name} holds an lm_head.weight that differs from the embedding "
            "(a trained output head); set tie_word_embeddings to false to use it, or remove it"
        )


# Bit pattern of +inf per float dtype (sign 0, exponent all ones, mantissa 0), IEEE 754.
_INF_BITS = {
    np.dtype(np.float16): 0x7C00,
    np.dtype(ml_dtypes.bfloat16): 0x7F80,
    np.dtype(np.float32): 0x7F800000,
    np.dtype(np.float64): 0x7FF0000000000000,
}
_INT_VIEWS = {2: (np.int16, np.uint16), 4: (np.int32, np.uint32), 8: (np.int64, np.uint64)}


def check_finite(array: np.ndarray, what: str) -> None:
    """Raise naming `what` when `array` holds NaN or inf.

    A float is non-finite exactly when its exponent bits are all ones. Read as a signed
    integer, a positive one is then >= the +inf pattern; read as unsigned, a negative one is
    >= the -inf pattern (sign bit set) and no finite value is. So two integer max
    reductions over views of the bytes decide, without a temporary or a float conversion
    (measured on 156M bf16 weights: 0.04 s, against 0.09 s for a float64 sum and 0.21 s for
    `np.isfinite(...).all()`). Only a failing tensor pays for the element-wise scan that
    counts and locates the offenders for the message.
    """
    if array.size == 0 or _all_finite(np.ascontiguousarray(array)):
        return
    wide = np.asarray(array, np.float64)
    bad = ~np.isfinite(wide)
    count = int(bad.sum())
    first = [int(i) for i in np.unravel_index(int(np.argmax(bad)), array.shape)]
    nans = int(np.isnan(wide).sum())
    raise ValueError(
        f"{what} holds {count} non-finite values ({nans} NaN, {count - nans} inf; first at "
        f"index {first} of shape {list(array.shape)}); weights must be finite numbers"
    )


def check_checkpoint(
    folder: str | Path, config: ModelConfig
) -> tuple[dict[str, Path], dict[Path, SafetensorsHeader]]:
    """Every check of a checkpoint that reads headers only (no tensor data, except a tied
    lm_head compared to the embedding): config.json supported, every file's header valid, no
    tensor the engine does not use, every expected tensor present with a readable dtype and
    its config.json shape. `iter_checkpoint` runs it before the first tensor is read, and
    `tenantq search --check` (`search.checks.check_study`) runs it alone; NaN/inf need the
    data and are left to the load. Returns (HF tensor name -> file, file -> header)."""
    from tenantq.model.decoder import check_supported

    folder = Path(folder)
    check_supported(config)
    if is_compressed_tensors(folder):
        raise ValueError(
            f"{folder} is a compressed-tensors checkpoint (config.json quantization_config); "
            "read it with tenantq.model.compressed.iter_compressed or Engine.from_checkpoint"
        )
    where = checkpoint_files(folder)
    names = hf_names(config)
    expected = config.tensors()
    wanted = {hf for hf, _ in names.values()}
    tied_head = {"lm_head.weight"} if config.tie_word_embeddings else set()
    extra = sorted(
        n for n in where if n not in wanted and n not in tied_head and not _IGNORED.fullmatch(n)
    )
    if extra:
        raise ValueError(
            f"{folder}: tensors the {config.model_type} engine does not use: {extra[:5]} "
            f"({len(extra)} in all); the checkpoint does not match its config.json"
        )
    if tied_head & set(where):
        _check_tied_head(folder, where)
    headers: dict[Path, SafetensorsHeader] = {}
    for path, (hf, transpose) in names.items():
        file = where.get(hf)
        if file is None:
            searched = sorted({p.name for p in where.values()})
            raise ValueError(f"tensor {hf} ({path}) is missing; searched {searched} in {folder}")
        if not file.is_file():
            raise ValueError(f"tensor {hf} ({path}): the index names {file.name}, which is missing")
        if file not in headers:
            headers[file] = SafetensorsHeader.read(file)
        entry = headers[file].entries.get(hf)
        if entry is None:
            raise ValueError(f"tensor {hf} ({path}) is missing from {file.name}")
        if entry.dtype not in READABLE_DTYPES:
            raise ValueError(
                f"{file.name}: tensor {hf} has dtype {entry.dtype}, which the loader cannot "
                f"read; readable: {', '.join(READABLE_DTYPES)}"
            )
        want = expected[path].shape
        want_hf = tuple(reversed(want)) if transpose else want
        if entry.shape != want_hf:
            raise ValueError(
                f"tensor {hf} ({path}) in {file.name} has shape {list(entry.shape)}, "
                f"expected {list(want_hf)} from config.json"
            )
    return where, headers


def iter_checkpoint(folder: str | Path, config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(engine path, float array in engine layout) per tensor, one at a time, in order.

    Every file's header is validated (`SafetensorsHeader`) and every expected tensor found
    with its config.json shape before the first tensor is read. Arrays are read-only
    memory maps, each checked for NaN/inf (`read_tensor`) before it is yielded: the checks
    run on a worker thread ahead of the consumer (`_checked_stream`), which is joined
    before the stream ends or fails. A consumer that keeps an array past the next tensor
    must copy or convert it.
    """
    folder = Path(folder)
    where, headers = check_checkpoint(folder, config)
    yield from _checked_stream(
        (path, headers[where[hf]], hf, f"tensor {hf} ({path}) in {where[hf].name}", transpose)
        for path, (hf, transpose) in hf_names(config).items()
    )


# How far the checking thread may run ahead of the consumer: tensors mapped and queued for
# checking but not yet yielded (at least one). Enough to keep it busy (a check reads ~5x
# faster than a copy), small enough that the checked pages are still in memory when the
# consumer copies them.
_LOOKAHEAD_BYTES = 256 << 20
# One task of the checking thread: rows of a tensor, about this many bytes. A consumer that
# waits for a tensor checks the tasks of it that the thread has not started itself, so the
# first tensor (the 65 MB embedding of the reference model) is not checked by one core
# while the other idles.
_TASK_BYTES = 8 << 20


def _checked_stream(
    jobs: Iterable[tuple[str, SafetensorsHeader, str, str, bool]],
) -> Iterator[tuple[str, np.ndarray]]:
    """(key, checked array) per job `(key, header, tensor name, what, transpose)`, in order,
    each checked for NaN/inf before it is yielded; the array is the tensor's read-only
    memory map (`map_tensor`), transposed when asked.

    One worker thread checks the next tensors (up to `_LOOKAHEAD_BYTES` ahead, at least one)
    while the consumer converts the current one; numpy's integer reductions and jax's
    host-to-device copy both release the GIL. Each tensor's check is split into row ranges
    of about `_TASK_BYTES`; when the consumer asks for a tensor whose check is not done, it
    checks the ranges the worker has not started (taken back with `Future.cancel`) instead
    of waiting idle. A failed check is raised at the next item the consumer asks for, as
    soon as every tensor before the failing one has passed (so the first failing tensor in
    stream order is the one named), before any later tensor is yielded. The thread is
    joined when the stream ends, fails or is closed: none outlives it.
    """
    jobs = list(jobs)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tenantq-finite-check")
    pending: deque[tuple[str, np.ndarray, bool, list[tuple[Future[None], tuple]]]] = deque()
    ahead_bytes, submitted = 0, 0
    # Set by a failed task (its done-callback), so that the queue is walked only once a
    # check has failed: walking it for every item would cost O(tensors^2) future lookups.
    failed: list[bool] = []

    def _note_failure(future: Future[None]) -> None:
        if not future.cancelled() and future.exception() is not None:
            failed.append(True)

    try:
        for _ in range(len(jobs)):
            while submitted < len(jobs) and (not pending or ahead_bytes < _LOOKAHEAD_BYTES):
                key, header, name, what, transpose = jobs[submitted]
                source = map_tensor(header, header.entries[name])
                _check_transposable(source, what, transpose)
                tasks = []
                for args in _row_ranges(source, what, _TASK_BYTES):
                    future = pool.submit(_check_rows, *args)
                    future.add_done_callback(_note_failure)
                    tasks.append((future, args))
                pending.append((key, source, transpose, tasks))
                ahead_bytes += source.nbytes
                submitted += 1
            if failed:
                _raise_first_failure(pending)
            key, source, transpose, tasks = pending.popleft()
            _complete_checks(tasks)
            ahead_bytes -= source.nbytes
            yield key, source.T if transpose else source
            del source, tasks
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _complete_checks(tasks: list[tuple[Future[None], tuple]]) -> None:
    """Finish one tensor's check: the row ranges the worker has not started are taken back
    (`Future.cancel`) and checked on this thread, then the ones it has are waited for; a
    failure of either raises here."""
    for future, args in tasks:
        if future.cancel():
            _check_rows(*args)
    for future, _args in tasks:
        if not future.cancelled():
            future.result()


def _raise_first_failure(pending: Iterable[tuple[Any, Any, Any, list]]) -> None:
    """Raise the error of the first failed check among queued tensors whose earlier
    tensors have all passed; return when none has failed yet or an earlier one is open."""
    for _key, _source, _transpose, tasks in pending:
        for future, _args in tasks:
            if not future.done():
                return
            if future.exception() is not None:
                future.result()


def map_tensor(header: SafetensorsHeader, entry: TensorEntry) -> np.ndarray:
    """A read-only memory map of one tensor of a validated file (no bytes read yet), unmapped
    when the array is dropped: a stream holds the pages of the tensors still referenced, not
    the whole file. `mmap` + `np.frombuffer`: ~10 us a tensor against ~100 us for
    `np.memmap` (which opens the file each time), paid on the consumer's thread."""
    dtype = np.dtype(READABLE_DTYPES[entry.dtype])
    nbytes = entry.end - entry.begin
    if nbytes == 0:  # an empty span cannot be mapped
        return np.zeros(entry.shape, dtype)
    start = header.data_offset_bytes + entry.begin
    page = start - start % mmap.ALLOCATIONGRANULARITY  # a map starts at a page boundary
    fd = os.open(header.path, os.O_RDONLY)
    try:  # the map keeps its own duplicate of the descriptor
        mapped = mmap.mmap(fd, start + nbytes - page, offset=page, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    count = nbytes // dtype.itemsize
    return np.frombuffer(mapped, dtype, count=count, offset=start - page).reshape(entry.shape)


_BLOCK_BYTES = 1 << 20  # rows checked together: both integer reductions read them from L2


def _rows(source: np.ndarray) -> np.ndarray:
    """`source` as a 2-D view, one row per leading index (a column for 0-D/1-D tensors)."""
    return source.reshape(source.shape[0], -1) if source.ndim > 1 else source.reshape(-1, 1)


def _row_ranges(source: np.ndarray, what: str, task_bytes: int) -> list[tuple]:
    """`_check_rows` arguments covering `source`'s rows in ranges of about `task_bytes`."""
    if source.size == 0:
        return []
    n_rows = _rows(source).shape[0]
    step = max(1, task_bytes // (source.nbytes // n_rows))
    return [(source, what, start, min(start + step, n_rows)) for start in range(0, n_rows, step)]


def _check_rows(source: np.ndarray, what: str, start: int, stop: int) -> None:
    """Check rows [start, stop) of `source` (see `read_tensor`) in blocks of ~1 MiB, so the
    second of `_all_finite`'s two integer reductions reads the block from cache. A failing
    block falls back to `check_finite` over the whole tensor, which names the count and the
    first offending index."""
    rows = _rows(source)
    step = max(1, _BLOCK_BYTES // (rows.shape[1] * source.dtype.itemsize))
    for begin in range(start, stop, step):
        if not _all_finite(rows[begin : min(begin + step, stop)]):
            check_finite(source, what)  # raises with the count and the first index


def _check_transposable(source: np.ndarray, what: str, transpose: bool) -> None:
    if transpose and source.ndim != 2:
        raise ValueError(f"{what}: only 2-D tensors are transposed, this one has {source.ndim}")


def read_tensor(source: np.ndarray, what: str, transpose: bool = False) -> np.ndarray:
    """`source` (a file-layout memory map) checked for NaN/inf on this thread, in engine
    layout (its transposed view for HF `[out, in]` linears); the bytes are not copied here.
    The streaming loader (`_checked_stream`) runs the same check (`_check_rows`) on a
    worker thread; the cost of both is measured by `python -m tenantq.bench load`.
    """
    _check_transposable(source, what, transpose)
    for args in _row_ranges(source, what, source.nbytes):
        _check_rows(*args)
    return source.T if transpose else source


def _all_finite(array: np.ndarray) -> bool:
    """True when no element of the contiguous float `array` is NaN or inf (see check_finite)."""
    inf_bits = _INF_BITS[array.dtype]
    signed, unsigned = _INT_VIEWS[array.dtype.itemsize]
    flat = array.reshape(-1)
    if flat.size == 0:
        return True
    sign_bit = 1 << (8 * array.dtype.itemsize - 1)
    return (
        int(flat.view(signed).max()) < inf_bits
        and int(flat.view(unsigned).max()) < inf_bits | sign_bit
    )


def iter_file(path: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, read-only array) of every tensor of one `.safetensors` file, in header order,
    with the same checks as a checkpoint load (header, readable dtype, finite values)."""
    path = Path(path)
    header = SafetensorsHeader.read(path)
    for entry in header.entries.values():
        if entry.dtype not in READABLE_DTYPES:
            raise ValueError(
                f"{path.name}: tensor {entry.name} has dtype {entry.dtype}, which the loader "
                f"cannot read; readable: {', '.join(READABLE_DTYPES)}"
            )
    yield from _checked_stream(
        (name, header, name, f"tensor {name} in {path.name}", False) for name in header.entries
    )


def load_params(folder: str | Path, config: ModelConfig, *, dtype: Any = "bfloat16") -> dict:
    """Params (path -> jax array of `dtype`), read and cast one tensor at a time.

    Full precision only: `tenantq.quant.apply.load_quantized` streams the same tensors
    into a plan's formats.
    """
    import jax.numpy as jnp

    return {
        path: jnp.asarray(array, dtype=jnp.dtype(dtype))
        for path, array in iter_checkpoint(folder, config)
    }
