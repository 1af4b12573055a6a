"""Files every cache writer shares: atomic replacement (calibration, KV scales, sensitivity,
evaluation results, reports, fronts, checkpoints: a unique temporary file in the destination's
folder, then `os.replace`), the one cache key and the one default cache folder.

A fixed `<name>.tmp` lets two writers of the same cache file rename each other's file away
(FileNotFoundError) or publish a half-written one; the temporary name here is unique per call. It
lives in `model` (pure Python, no JAX) because every package that writes caches imports it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

# The default cache folder of every command, benchmark and Evaluator (relative to the current
# directory); each takes its own `cache_dir`/`--cache-dir` to put it elsewhere.
CACHE_DIR = Path(".tenantq-cache")


def cache_key(**parts) -> str:
    """A short key over `parts`, the same in every process: the one key of every on-disk
    cache entry. JSON with sorted keys (plain JSON parts key as they always did); sets sorted
    (their order follows the per-process string hash seed), arrays by every value (`str`
    elides the middle of a large one), other objects by their text; an object whose text is
    an address is a TypeError naming the part."""
    try:
        canon = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=_canonical)
    except TypeError as err:
        for name in sorted(parts):
            try:
                json.dumps(parts[name], default=_canonical)
            except TypeError:
                raise TypeError(f"cache_key part {name!r}: {err}") from None
        raise
    return hashlib.sha256(canon.encode()).hexdigest()[:24]


def _canonical(o):
    if isinstance(o, (set, frozenset)):
        return sorted(o, key=lambda v: json.dumps(v, sort_keys=True, default=str))
    if hasattr(o, "tolist") and not isinstance(o, type):  # numpy/JAX arrays and scalars
        return o.tolist()
    text = str(o)
    if " at 0x" in text:
        raise TypeError(
            f"{type(o).__name__} has no stable text form ({text[:60]}); pass its fields instead"
        )
    return text


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary path beside `path`; when the block ends without an exception the
    file written there replaces `path` in one step, otherwise it is removed (`path` untouched)."""
    path = Path(path)
    while True:  # like tempfile.mkstemp, but mode 0o666 under the umask (mkstemp's is 0o600)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())
