"""Held-out text for the suite: documents, their disjoint search/confirm halves, data hashes.

The default source is the shipped reference model's test split (stdlib files the model never
trained on); a user may point a suite at a `.txt`, `.jsonl` or Parquet text column. Every task
draws from one half of the documents (even-indexed for "search", odd for "confirm"; a single
document is cut at the line nearest its middle), so a confirmation run sees fresh text.
Text becomes token windows in `evals.windows`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

REFERENCE_TEST = "reference-test"


def load_documents(source: str, text_field: str = "text") -> list[str]:
    """The documents of `source`; an unreadable dataset is a one-line ValueError."""
    if source == REFERENCE_TEST:
        from tenantq.reference.corpus import load_corpus

        return load_corpus().texts("test")
    path = Path(source)
    expected = f"expected '{REFERENCE_TEST}' or a .txt, .jsonl or .parquet file"
    if path.is_dir():
        raise ValueError(f"dataset {source!r} is a folder, not a file; {expected}")
    if not path.is_file():
        raise ValueError(f"dataset {source!r} does not exist; {expected}")
    if path.suffix not in (".txt", ".jsonl", ".parquet"):  # before the try: named once
        raise ValueError(f"dataset {source!r}: unknown suffix {path.suffix!r}; {expected}")
    try:
        if path.suffix == ".txt":
            docs = [path.read_text(encoding="utf-8")]
        elif path.suffix == ".jsonl":
            docs = _jsonl_texts(path, source, text_field)
        else:  # .parquet
            import pyarrow.parquet as pq

            docs = pq.read_table(path, columns=[text_field]).column(text_field).to_pylist()
    except _RecordError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, OSError) as err:
        kind = type(err).__name__
        raise ValueError(
            f"dataset {source!r} is unreadable ({kind}: {err}); {expected} with a "
            f"'{text_field}' text field"
        ) from None
    except Exception as err:  # pyarrow's own errors (ArrowInvalid, ...) for a bad Parquet file
        raise ValueError(f"dataset {source!r} is unreadable ({err}); {expected}") from None
    docs = [d for d in docs if isinstance(d, str) and d.strip()]
    if not docs:
        raise ValueError(f"dataset {source!r} holds no text; {expected}")
    return docs


class _RecordError(ValueError):
    """A .jsonl record at fault, already named by its line."""


def _jsonl_texts(path: Path, source: str, text_field: str) -> list[str]:
    """Every record's `text_field`, which must be a string: a record whose text is a number or
    null is an error naming its line (dropping it would shrink the dataset silently)."""
    docs = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise _RecordError(
                f"dataset {source!r} is unreadable (JSONDecodeError on line {number}: {err}); "
                f"expected one JSON object per line with a {text_field!r} text field"
            ) from None
        if not isinstance(record, dict) or text_field not in record:
            raise _RecordError(
                f"dataset {source!r} line {number}: expected an object with a {text_field!r} "
                f"text field, got {type(record).__name__}"
                + (f" with keys {sorted(record)[:5]}" if isinstance(record, dict) else "")
            )
        text = record[text_field]
        if not isinstance(text, str):
            raise _RecordError(
                f"dataset {source!r} line {number}: {text_field!r} must be a string, got "
                f"{type(text).__name__} {text!r:.40}"
            )
        docs.append(text)
    return docs


def split_documents(docs: list[str], split: str) -> list[str]:
    """One of two disjoint halves: even-indexed documents for "search", odd for "confirm"."""
    if split not in ("search", "confirm"):
        raise ValueError(f"split must be 'search' or 'confirm', got {split!r}")
    if len(docs) == 1:
        text = docs[0]
        cut = text.find("\n", len(text) // 2)
        cut = len(text) // 2 if cut < 0 else cut + 1
        return [text[:cut]] if split == "search" else [text[cut:]]
    return docs[0::2] if split == "search" else docs[1::2]


def array_hash(*arrays: np.ndarray) -> str:
    """sha256 of arrays' dtypes, shapes and bytes: the identity of a drawn dataset."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()
