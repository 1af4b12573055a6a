"""tenantq.tracking: every study and trial recorded in MLflow, reproducible from its record.

A parent run per study (spec, code version, model identity, deployment) and a nested run per
trial (the flattened plan as params with the same names in every trial, metrics with CI
bounds, capacity lines, timings; plan.json, per-example Parquet, budget and memory report as
artifacts). Uses `MlflowClient` with explicit run ids, so nothing depends on an active run.
"""

from tenantq.tracking.flatten import flatten_plan
from tenantq.tracking.runs import (
    StudyTracker,
    check_sqlite_file,
    check_tracking_uri,
    code_version,
    source_tags,
)

__all__ = [
    "StudyTracker",
    "check_sqlite_file",
    "check_tracking_uri",
    "code_version",
    "flatten_plan",
    "source_tags",
]
