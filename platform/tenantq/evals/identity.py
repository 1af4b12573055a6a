"""What was measured: the model's identity and the cache key of a baseline.

Model identity = sha256 of config.json plus every safetensors file's header and data bytes
(DESIGN.md, "Identity of what was measured"); a renamed copy of the same checkpoint has the
same identity, a retrained one does not. Hashing reads the files once and is memoised per
(path, size, mtime), so a worker evaluating many plans hashes its model once.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

_CHUNK_BYTES = 1 << 22


@functools.cache
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def model_identity(folder: str | Path) -> str:
    """sha256 over config.json and the safetensors files (sorted by name)."""
    folder = Path(folder)
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"{folder} has no config.json; expected a Hugging Face checkpoint folder")
    h = hashlib.sha256(config.read_bytes())
    from tenantq.model.safetensors_header import check_weight_file

    for path in sorted(folder.glob("*.safetensors")):
        check_weight_file(path)
        st = path.stat()
        h.update(path.name.encode())
        h.update(_file_digest(str(path), st.st_size, st.st_mtime_ns).encode())
    return h.hexdigest()


def cache_key(**parts) -> str:
    """A short stable key over JSON-serialisable parts (sorted keys)."""
    canon = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canon.encode()).hexdigest()[:24]
