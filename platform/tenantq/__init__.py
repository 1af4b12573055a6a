"""tenantq: how many tenants fit on an accelerator host, and what quantization costs.

The package is split into rooms (see DESIGN.md): numerics -> model -> quant -> engine,
capacity, evals, workers, search, tracking, report, cli. Importing the top package pulls
in nothing heavy; each room is imported where it is used.
"""

__version__ = "0.1.0"
