"""The report and the study's viewers, checked with real components on real studies.

The studies come from the search driver itself (`studies` in tests/conftest.py). A headless
Debian Chromium (tests/report/setup_browser.sh installs it when missing) loads the report from
a file URL with every network request refused; the MLflow UI and optuna-dashboard are started
as servers on 127.0.0.1 over the studies' stores. Bounds are exact counts read back from the
stores.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHROMIUM = os.environ.get("TENANTQ_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
SETUP = Path(__file__).with_name("setup_browser.sh")
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def chromium() -> str:
    if not Path(CHROMIUM).is_file():
        subprocess.run(["bash", str(SETUP)], check=True, timeout=900)
    return CHROMIUM


@contextmanager
def browser_page(tmp_path: Path, chromium: str):
    """A Playwright page in the Debian Chromium (never `playwright install`), with a fresh
    profile; yields (page, console errors, requests that went off the machine)."""
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    remote: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=chromium,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            page = browser.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on(
                "request",
                lambda r: (
                    remote.append(r.url)
                    if not r.url.startswith(("file:", "data:", "blob:", "http://127.0.0.1"))
                    else None
                ),
            )
            yield page, errors, remote
        finally:
            browser.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(cmd: list[str], url: str, tmp_path: Path, timeout_s: float = 180):
    """Start `cmd`, wait until `url` answers 200, yield, then stop exactly that process."""
    log = open(tmp_path / f"{Path(cmd[0]).name}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"{cmd[0]} exited {proc.returncode}: {_tail(tmp_path, cmd)}")
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{url} did not answer in {timeout_s} s: {_tail(tmp_path, cmd)}"
                )
            time.sleep(1)
        yield
    finally:
        os.killpg(proc.pid, 15)  # the server and the workers it forked (mlflow: uvicorn)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()


def _tail(tmp_path: Path, cmd: list[str]) -> str:
    return (tmp_path / f"{Path(cmd[0]).name}.log").read_text()[-2000:]


def _post_json(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _report(studies, experiment: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [str(BIN / "tenantq"), "report", "--experiment", experiment]
        + ["--tracking-uri", studies.tracking_uri, "--out", str(out), "--json", *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


# What a drawn plot has when plotly rendered its data: a trace group in a subplot (`.trace`;
# a heatmap's is `.hm`) holding a drawn path (markers, bars, boxes) or an <image> (heatmap).
RENDERED_JS = """
(id) => {
  const root = document.getElementById(id);
  const traces = root.querySelectorAll('.cartesianlayer .trace, .cartesianlayer .hm');
  let marks = 0;
  for (const t of traces) {
    for (const p of t.querySelectorAll('path')) {
      const d = p.getAttribute('d');
      if (d && d !== 'M0,0Z' && d.length > 4) marks++;
    }
    marks += t.querySelectorAll('image').length;
  }
  return {svgs: root.querySelectorAll('svg.main-svg').length, traces: traces.length,
          marks: marks, data: root.data ? root.data.length : 0};
}
"""


def test_report_renders_in_chromium_offline(studies, chromium, tmp_path) -> None:
    out = tmp_path / "report"
    proc = _report(studies, "report", out, "--static", "png")
    assert proc.returncode == 0, proc.stderr
    written = json.loads(proc.stdout)
    # 3 trials, each with examples (needles + structured) and a budget: every figure but the
    # sensitivity heatmap (the structured space has no profile).
    assert written["figures"] == ["pareto", "capacity", "needles", "flips", "timeline"]
    assert list(written["skipped"]) == ["sensitivity"]
    for path in written["images"]:  # a PNG's 8-byte signature, and more than an empty canvas
        data = Path(path).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, path
    with browser_page(tmp_path, chromium) as (page, errors, remote):
        page.route(
            "**/*", lambda r: r.abort() if not r.request.url.startswith("file:") else r.continue_()
        )
        page.goto((out / "report.html").as_uri())
        page.wait_for_function(
            f"document.querySelectorAll('.js-plotly-plot').length === {len(written['figures'])}",
            timeout=60_000,
        )
        for name in written["figures"]:
            seen = page.evaluate(RENDERED_JS, f"fig-{name}")
            assert seen["svgs"] >= 1 and seen["data"] >= 1, (name, seen)
            assert seen["traces"] >= 1 and seen["marks"] >= 1, (name, seen)
        # The front table lists every trial MLflow tags as on the front.
        from mlflow import MlflowClient

        client = MlflowClient(studies.tracking_uri)
        exp = client.get_experiment_by_name("report")
        front = client.search_runs([exp.experiment_id], "tags.`tenantq.pareto` = 'true'")
        assert page.locator("table.front tr").count() == len(front) + 1
        shot = tmp_path / "report-screenshot.png"
        page.screenshot(path=str(shot), full_page=True)
        keep = os.environ.get("TENANTQ_REPORT_SCREENSHOT")
        if keep:
            shutil.copy(shot, keep)
    assert errors == []
    assert remote == []  # plotly.js is embedded: nothing fetched from the network
    assert shot.stat().st_size > 50_000


def test_mlflow_ui_serves_the_study(studies, chromium, tmp_path) -> None:
    import optuna
    from mlflow import MlflowClient

    client = MlflowClient(studies.tracking_uri)
    exp = client.get_experiment_by_name("report")
    expected = {r.info.run_name for r in client.search_runs([exp.experiment_id])}
    trials = optuna.load_study(study_name="report", storage=studies.optuna_url).trials
    assert len(expected) == 1 + len(trials)  # the study's parent run and one run per trial
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [str(BIN / "mlflow"), "ui", "--backend-store-uri", studies.tracking_uri]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    with server(cmd, f"{base}/health", tmp_path):
        got = _post_json(
            f"{base}/api/2.0/mlflow/runs/search",
            {"experiment_ids": [exp.experiment_id], "max_results": 100},
        )
        runs = got["runs"]
        assert {r["info"]["run_name"] for r in runs} == expected
        trials = [r for r in runs if {"key": "tenantq.kind", "value": "trial"} in r["data"]["tags"]]
        assert all(
            any(m["key"] == "capacity.tenants" for m in r["data"]["metrics"]) for r in trials
        )
        with browser_page(tmp_path, chromium) as (page, errors, remote):
            page.goto(f"{base}/#/experiments/{exp.experiment_id}/runs")
            # The runs table lists the parent run (its trials nested under it, collapsed) and
            # counts every run of the experiment (MLflow 3.17's experiment page, seen here).
            page.get_by_text("study-report", exact=True).first.wait_for(timeout=120_000)
            page.get_by_text(f"{len(expected)} matching runs").wait_for(timeout=60_000)
            page.screenshot(path=str(tmp_path / "mlflow-ui.png"))
        assert remote == []


def test_optuna_dashboard_serves_the_trials(studies, tmp_path) -> None:
    import optuna

    study = optuna.load_study(study_name="report", storage=studies.optuna_url)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [str(BIN / "optuna-dashboard"), studies.optuna_url, "--host", "127.0.0.1"]
    cmd += ["--port", str(port)]
    with server(cmd, f"{base}/api/studies", tmp_path):
        listed = _get_json(f"{base}/api/studies")["study_summaries"]
        names = {s["study_name"]: s["study_id"] for s in listed}
        assert set(names) == {"report", "failing", "single"}
        detail = _get_json(f"{base}/api/studies/{names['report']}")
        assert [t["number"] for t in detail["trials"]] == [t.number for t in study.trials]
        assert [t["state"] for t in detail["trials"]] == [
            t.state.name.capitalize() for t in study.trials
        ]
