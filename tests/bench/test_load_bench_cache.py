"""`python -m tenantq.bench load --cache cold` measures loads from disk: the checkpoint's
pages are evicted before each load, and the fraction still resident is measured (mincore)
rather than assumed. The bench itself runs with its defaults in tests/bench/test_bench.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tenantq.bench import load as bench

pytestmark = pytest.mark.skipif(
    not hasattr(os, "posix_fadvise") or not Path("/proc/mounts").exists(),
    reason="page-cache eviction is Linux-only",
)


def _written(folder: Path, mib: int = 8) -> Path:
    path = folder / "model.safetensors"
    path.write_bytes(os.urandom(mib << 20))
    with open(path, "rb") as f:  # every page read once: in the page cache now
        while f.read(1 << 20):
            pass
    return path


def test_a_read_file_is_resident_and_an_evicted_one_is_not(tmp_path):
    if bench.filesystem_type(tmp_path) in bench.MEMORY_FILESYSTEMS:
        pytest.skip(f"{tmp_path} is in memory (tmpfs): nothing to evict")  # see the next test
    path = _written(tmp_path)
    # A file just written and read is whole in the page cache: 2,048 of 2,048 pages.
    assert bench._resident([path]) == 1.0
    bench._evict([path])
    # DONTNEED drops clean, unmapped pages; a few may be read back by another process
    # at once, so the bound is loose, but a no-op eviction (1.0) fails it.
    assert bench._resident([path]) < 0.1


def test_cold_loads_on_a_memory_filesystem_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "filesystem_type", lambda path: "tmpfs")
    with pytest.raises(SystemExit) as exit_info:
        bench._parse(["--cache", "cold", "--dir", str(tmp_path)])
    assert exit_info.value.code == 2
    # warm loads do not need eviction: accepted on any filesystem
    assert bench._parse(["--cache", "warm", "--dir", str(tmp_path)]).cache == ["warm"]


def test_the_filesystem_is_the_longest_mount_point_holding_the_path(tmp_path, monkeypatch):
    root = tmp_path.resolve()
    (root / "shm").mkdir()
    mounts = f"/dev/vda / ext4 rw 0 0\ntmpfs {root}/shm tmpfs rw 0 0\nproc /proc proc rw 0 0\n"
    real_read = Path.read_text
    monkeypatch.setattr(
        Path,
        "read_text",
        lambda self, *a, **k: mounts if str(self) == "/proc/mounts" else real_read(self, *a, **k),
    )
    assert bench.filesystem_type(root / "shm") == "tmpfs"
    assert bench.filesystem_type(root / "shm" / "not" / "yet" / "made") == "tmpfs"
    assert bench.filesystem_type(root) == "ext4"  # shm is below it, not above
    assert bench.filesystem_type(root / "shmoo") == "ext4"  # a prefix of the name is not a parent


@pytest.mark.parametrize("cache", ["", "hot", "warm,lukewarm"])
def test_an_unknown_cache_state_is_a_usage_error(cache, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench._parse(["--cache", cache])
    assert exit_info.value.code == 2
    assert "--cache takes warm and/or cold" in capsys.readouterr().err
