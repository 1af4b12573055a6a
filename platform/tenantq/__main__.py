"""`python -m tenantq` is the same as the `tenantq` console script."""

import sys

from tenantq.cli import main

if __name__ == "__main__":
    sys.exit(main())
