"""The study's metric contract, read from dashboards/README.md (the one place it is written).

Both the Grafana test and the `ray job submit` test use it, so the dashboard's queries, the
documentation and what Ray really exports are checked against the same table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "dashboards" / "README.md"
# A contract row: | `name` | Kind | `tag`, `tag` | `ray_name...` | meaning |
_ROW = re.compile(
    r"^\|\s*`(tenantq_[a-z_]+)`\s*\|\s*(Counter|Gauge|Histogram)\s*\|([^|]*)\|[^|]*\|([^|]*)\|"
)
_BOUNDARIES = re.compile(r"boundaries `\[([0-9., ]+)\]`")


@dataclass(frozen=True)
class StudyMetric:
    name: str  # as passed to ray.util.metrics
    kind: str  # Counter | Gauge | Histogram
    tag_keys: tuple[str, ...]
    boundaries: tuple[float, ...] = ()  # histogram buckets, as documented

    @property
    def prometheus_series(self) -> tuple[str, ...]:
        # Ray prefixes application metrics with `ray_`; a histogram is three series.
        base = f"ray_{self.name}"
        if self.kind == "Histogram":
            return (f"{base}_bucket", f"{base}_count", f"{base}_sum")
        return (base,)


def documented_study_metrics() -> dict[str, StudyMetric]:
    metrics = {}
    for line in README.read_text().splitlines():
        if match := _ROW.match(line):
            name, kind, tags, meaning = match.groups()
            bounds = _BOUNDARIES.search(meaning)
            metrics[name] = StudyMetric(
                name,
                kind,
                tuple(re.findall(r"`([a-z_]+)`", tags)),
                tuple(float(b) for b in bounds.group(1).split(",")) if bounds else (),
            )
    return metrics
