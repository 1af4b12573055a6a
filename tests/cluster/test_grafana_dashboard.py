"""The Grafana dashboard queries only metrics that exist: the study's documented ones or Ray's.

"Exists" has two sources: the study's metric table in dashboards/README.md (the contract the
search driver exports through `ray.util.metrics`), and the metrics Ray's own Grafana
dashboard queries (read from the installed Ray's `default_dashboard_config`, so a metric
Ray renames fails here).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from _study_metrics import documented_study_metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "tenantq-study.grafana.json"
# A PromQL metric selector as this dashboard writes them: a name directly followed by `{`.
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{")
LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,")
# The four metrics the issue asks the dashboard to show (trials done, duration, utilization,
# failures), with the names pinned for the driver.
PINNED = {
    "tenantq_trials_total": ("Counter", ("study", "state")),
    "tenantq_trial_duration_s": ("Histogram", ("study",)),
    "tenantq_workers_busy": ("Gauge", ("study",)),
    "tenantq_trial_failures_total": ("Counter", ("study", "reason")),
}


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # panels nested in a collapsed row
    return out


def _ray_builtin_metrics() -> set[str]:
    from ray.dashboard.modules.metrics.dashboards.default_dashboard_panels import (
        default_dashboard_config,
    )

    panels = list(default_dashboard_config.panels)
    for row in default_dashboard_config.rows:
        panels.extend(row.panels)
    return {name for p in panels for t in p.targets for name in SELECTOR.findall(t.expr)}


def test_the_contract_table_pins_the_four_study_metrics() -> None:
    documented = documented_study_metrics()
    assert {n: (m.kind, m.tag_keys) for n, m in documented.items()} == PINNED


def test_driver_exports_the_documented_histogram_buckets() -> None:
    from tenantq.search.metrics import DURATION_BOUNDARIES_S

    documented = documented_study_metrics()["tenantq_trial_duration_s"].boundaries
    assert len(documented) == 13
    assert tuple(float(b) for b in DURATION_BOUNDARIES_S) == documented


def test_every_query_names_a_documented_or_ray_builtin_metric() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    study_series = {s for m in documented_study_metrics().values() for s in m.prometheus_series}
    ray_builtin = _ray_builtin_metrics()
    # Guard the reference itself: Ray's dashboard must still chart node and actor metrics.
    assert {
        "ray_node_cpu_utilization",
        "ray_actors",
        "ray_tpu_tensorcore_utilization",
    } <= ray_builtin

    queries = [
        (p["title"], t["expr"])
        for p in _panels(dashboard)
        if p["type"] != "row"
        for t in p["targets"]
    ]
    queries += [
        (f"variable {v['name']}", v["definition"])
        for v in dashboard["templating"]["list"]
        if v["type"] == "query"
    ]
    assert len(queries) >= 10
    unknown = []
    for title, expr in queries:
        names = SELECTOR.findall(expr) + LABEL_VALUES.findall(expr)
        assert names, f"{title}: no metric selector in {expr!r}"
        unknown += [(title, n) for n in names if n not in study_series | ray_builtin]
    assert unknown == []


def test_each_study_metric_is_charted_and_filtered_by_study() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in _panels(dashboard) if p["type"] != "row" for t in p["targets"]]
    for metric in documented_study_metrics().values():
        using = [e for e in exprs if any(f"{s}{{" in e for s in metric.prometheus_series)]
        assert using, f"no panel charts {metric.name}"
        # Every selector of a study metric is narrowed to the chosen studies.
        for expr in using:
            for series in metric.prometheus_series:
                for selector in re.findall(rf"{series}\{{([^}}]*)\}}", expr):
                    assert 'study=~"$study"' in selector, expr


def test_panels_use_the_datasource_variable_and_do_not_overlap() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"datasource", "study"}
    cells: dict[tuple[int, int], str] = {}
    for panel in _panels(dashboard):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]  # Grafana's grid is 24 columns wide
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_local_prometheus_config_scrapes_the_local_clusters_metrics_port() -> None:
    import yaml

    config = yaml.safe_load((DASHBOARD.parent / "prometheus-local.yml").read_text())
    (job,) = config["scrape_configs"]
    (static,) = job["static_configs"]
    script = (DASHBOARD.parents[1] / "cluster" / "local.sh").read_text()
    default_port = re.search(r'METRICS_PORT="\$\{TENANTQ_RAY_METRICS_PORT:-(\d+)\}"', script)
    assert static["targets"] == [f"127.0.0.1:{default_port.group(1)}"]
