"""Benchmarks: `python -m tenantq.bench NAME`. Figures are ratios measured in the same run."""
