"""A safetensors header, validated completely before any tensor data is mapped.

Every fault names the file, the tensor and the rule it breaks, following the format
(github.com/huggingface/safetensors, README "Format"): an 8-byte little-endian header
length, a JSON object of `{name: {dtype, shape, data_offsets}}` (plus an optional
`__metadata__` of strings), and a byte buffer that the tensors cover exactly, without holes
or overlaps. The `safetensors` library checks the same rules but its messages name neither
the file nor, for several faults ("invalid offset", "header too large"), the tensor.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

# The safetensors library refuses headers above 100 MB (MAX_HEADER_SIZE in its Rust
# source); a header that large would describe about a million tensors.
MAX_HEADER_BYTES = 100_000_000

# Bits per element of every dtype code the format defines (safetensors `Dtype`).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's header entry; `begin`/`end` are byte offsets into the data buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """The validated header of one `.safetensors` file."""

    path: Path
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_offset_bytes: int  # where the data buffer starts in the file

    @classmethod
    def read(cls, path: str | Path) -> SafetensorsHeader:
        path = Path(path)
        check_weight_file(path)
        file_bytes = path.stat().st_size
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise ValueError(
                    f"{path}: not a safetensors file ({file_bytes} bytes; the format starts "
                    "with an 8-byte header length)"
                )
            (header_bytes,) = struct.unpack("<Q", raw_len)
            if header_bytes > min(MAX_HEADER_BYTES, file_bytes - 8):
                raise ValueError(
                    f"{path}: header length field says {header_bytes:,} bytes, but the file "
                    f"holds {file_bytes - 8:,} bytes after it and a header may take at most "
                    f"{MAX_HEADER_BYTES:,}; the file is damaged or not safetensors"
                )
            text = f.read(header_bytes)
        try:
            header = json.loads(text.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: header is not UTF-8 JSON ({err})") from None
        if not isinstance(header, dict):
            raise ValueError(
                f"{path}: header is a JSON {type(header).__name__}; expected an object "
                "{tensor name: {dtype, shape, data_offsets}}"
            )
        metadata = header.pop("__metadata__", {})
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise ValueError(f"{path}: __metadata__ must be an object of strings to strings")
        data_offset = 8 + header_bytes
        entries = {name: _entry(path, name, info) for name, info in header.items()}
        _check_layout(path, entries, file_bytes - data_offset)
        return cls(path, entries, metadata, data_offset)


def _entry(path: Path, name: str, info: object) -> TensorEntry:
    where = f"{path}: tensor {name}"
    if not isinstance(info, dict):
        raise ValueError(f"{where}: entry is {info!r}; expected {{dtype, shape, data_offsets}}")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
    if missing:
        raise ValueError(f"{where}: entry lacks {missing}; expected dtype, shape, data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in DTYPE_BITS:
        raise ValueError(
            f"{where}: unknown dtype {dtype!r}; the format defines {', '.join(DTYPE_BITS)}"
        )
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise ValueError(f"{where}: shape {shape!r} must be a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise ValueError(
            f"{where}: data_offsets {offsets!r} must be [begin, end] with 0 <= begin <= end"
        )
    elements = 1
    for d in shape:
        elements *= d
    bits = elements * DTYPE_BITS[dtype]
    span = offsets[1] - offsets[0]
    if bits % 8 or span != bits // 8:
        raise ValueError(
            f"{where}: data_offsets {offsets} span {span:,} bytes, but {dtype} {shape} needs "
            f"{elements:,} x {DTYPE_BITS[dtype]} bits = {bits / 8:,g} bytes"
        )
    return TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_layout(path: Path, entries: dict[str, TensorEntry], data_bytes: int) -> None:
    """The tensors tile the data buffer: sorted by offset, each starts where the last ended."""
    cursor, previous = 0, None
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin != cursor:
            if e.begin < cursor:
                raise ValueError(
                    f"{path}: tensor {e.name} bytes [{e.begin}, {e.end}) overlap tensor "
                    f"{previous} (which ends at {cursor}); tensors may not share bytes"
                )
            after = f"tensor {previous} ends" if previous else "the data buffer starts"
            raise ValueError(
                f"{path}: tensor {e.name} starts at byte {e.begin} of the data, but {after} at "
                f"{cursor}; the format packs tensors without gaps"
            )
        cursor, previous = e.end, e.name
    if cursor != data_bytes:
        last = f"tensor {previous}" if previous else "the header"
        problem = (
            "runs past the end of the file"
            if cursor > data_bytes
            else "ends before the data does (trailing bytes)"
        )
        raise ValueError(
            f"{path}: {last} {problem}: the tensors cover {cursor:,} data bytes, the file "
            f"holds {data_bytes:,} after its header; the file is truncated or damaged"
        )


def check_weight_file(path: Path) -> None:
    """A weight file is a regular file (a symlink to one is fine): a folder, a dangling link
    or a symlink loop under a `.safetensors` name is one ValueError line naming it."""
    if path.is_file():
        return
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not a safetensors file; rename or remove it")
    if path.is_symlink():
        raise ValueError(
            f"{path} is a symbolic link that leads to no file (a loop or a dangling link); "
            "point it at the safetensors file or remove it"
        )
    raise ValueError(f"{path} is not a readable file; expected a safetensors file")
