"""Dispatch `python -m tenantq.bench NAME [options]` to `tenantq.bench.NAME.main(argv)`."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

# Every module beside this one is a benchmark with `main(argv)`; a new one adds a module only.
BENCHMARKS = sorted(
    p.stem for p in Path(__file__).parent.glob("*.py") if not p.stem.startswith("_")
)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print(
            f"usage: python -m tenantq.bench {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr
        )
        return 2
    module = importlib.import_module(f"tenantq.bench.{argv[0]}")
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
