"""The project layout keeps Python's own `platform` module importable (DESIGN.md, rooms)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_stdlib_platform_not_shadowed_from_repo_root() -> None:
    # `platform/` is a source root without __init__.py; were it a package, this import from
    # the repo root would pick it up and platform.system() would not exist.
    code = "import platform, tenantq; print(platform.system()); print(tenantq.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] in {"Linux", "Darwin", "Windows"}
    assert Path(out[1]).resolve().is_relative_to(ROOT / "platform" / "tenantq")
    assert not (ROOT / "platform" / "__init__.py").exists()


def test_console_script_and_module_entry_agree() -> None:
    # `tenantq --help` and `python -m tenantq --help` are the same program.
    scripts = Path(sys.executable).parent
    a = subprocess.run([scripts / "tenantq", "--help"], capture_output=True, text=True)
    b = subprocess.run([sys.executable, "-m", "tenantq", "--help"], capture_output=True, text=True)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout.replace("tenantq", "") == b.stdout.replace("tenantq", "")
    assert "formats" in a.stdout and "capacity" in a.stdout
