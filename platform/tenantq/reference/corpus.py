"""The training corpus: the Python standard library's own source, split by file.

Every machine that runs tenantq has a stdlib, so the reference model can be trained and
evaluated without any download. Files (not lines) are assigned to train / validation /
test by a seeded hash of their relative path, so a file never leaks across splits and the
rule still works on a slightly different Python patch release (the card records both the
Python version and a sha256 of each split's file list).
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SPLIT_SEED = "tenantq-reference-v1"
# Fractions of files: validation and test each take 5%, train the rest.
VALID_FRACTION = 0.05
TEST_FRACTION = 0.05
# Test suites are excluded: they are a third of the stdlib and mostly repetitive fixtures.
EXCLUDED_DIRS = ("site-packages", "test", "tests", "idle_test", "__pycache__")
SPLITS = ("train", "valid", "test")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """Relative paths of the stdlib's .py files, sorted, test folders excluded."""
    root = root or stdlib_root()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        out.append(rel.as_posix())
    return sorted(out)


def split_of(rel_path: str) -> str:
    """The split a file belongs to: a seeded hash of its path, stable across machines."""
    digest = hashlib.sha256(f"{SPLIT_SEED}:{rel_path}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    if u < VALID_FRACTION:
        return "valid"
    if u < VALID_FRACTION + TEST_FRACTION:
        return "test"
    return "train"


@dataclass(frozen=True)
class Corpus:
    root: Path
    files: dict[str, tuple[str, ...]]  # split -> relative paths, sorted

    def texts(self, split: str) -> list[str]:
        """The split's file contents, in file-list order (undecodable bytes replaced)."""
        return [
            (self.root / rel).read_text(encoding="utf-8", errors="replace")
            for rel in self.files[split]
        ]

    def file_list_sha256(self, split: str) -> str:
        return hashlib.sha256("\n".join(self.files[split]).encode()).hexdigest()

    def describe(self) -> dict:
        return {
            "python": sys.version.split()[0],
            "stdlib": str(self.root),
            "split_rule": f"sha256('{SPLIT_SEED}:' + relpath) -> u in [0,1): "
            f"valid < {VALID_FRACTION}, test < {VALID_FRACTION + TEST_FRACTION}, else train",
            "excluded_dirs": list(EXCLUDED_DIRS),
            "splits": {
                s: {"files": len(self.files[s]), "file_list_sha256": self.file_list_sha256(s)}
                for s in SPLITS
            },
        }


def load_corpus(root: Path | None = None) -> Corpus:
    root = root or stdlib_root()
    by_split: dict[str, list[str]] = {s: [] for s in SPLITS}
    for rel in stdlib_files(root):
        by_split[split_of(rel)].append(rel)
    return Corpus(root, {s: tuple(v) for s, v in by_split.items()})
