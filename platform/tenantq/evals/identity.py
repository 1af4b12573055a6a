"""What was measured: the model's identity and the cache key of a baseline.

Model identity = sha256 of config.json plus every safetensors file's header and data bytes
(DESIGN.md, "Identity of what was measured"); a renamed copy of the same checkpoint has the
same identity, a retrained one does not. Hashing reads the files once and is memoised per
(path, size, mtime), so a worker evaluating many plans hashes its model once. A study's
identity also keeps one digest per input file (`model_file_digests`, `file_digest`), with
config.json in canonical JSON form, so that a refused resume names the file (and key).
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from tenantq.model.files import cache_key as cache_key  # the one key; re-exported here

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


# Tokenizer files of a Hugging Face folder: the tokens a suite scores depend on them.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes (memoised per path, size and mtime)."""
    st = Path(path).stat()
    return _file_digest(str(path), st.st_size, st.st_mtime_ns)


def _canon(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def config_key_digests(config: str | Path) -> dict[str, str]:
    """Key -> short digest of its value in canonical JSON: key order, whitespace and
    indentation do not change it, a value does."""
    data = json.loads(Path(config).read_text())
    return {k: hashlib.sha256(_canon(v).encode()).hexdigest()[:16] for k, v in data.items()}


def model_file_digests(folder: str | Path) -> dict[str, str]:
    """File name -> content digest, for config.json (canonical JSON), the safetensors files
    and the tokenizer files a model folder holds; the folder's path is not part of it."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    out = {"config.json": hashlib.sha256(_canon(config).encode()).hexdigest()}
    for path in sorted(folder.glob("*.safetensors")):
        out[path.name] = file_digest(path)
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            out[name] = file_digest(folder / name)
    return out
