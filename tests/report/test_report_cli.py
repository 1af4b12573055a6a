"""`tenantq report` on the studies a search leaves behind: with failed trials, with a single
trial, and for an experiment that does not exist (one line naming those that do).

The studies are real (`studies` in tests/conftest.py); the missing-experiment case also runs
on a fresh MLflow sqlite store with no study at all, in well under a second. Bounds are exact
counts.
"""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from tenantq.cli import main
from tenantq.report import load_study, write_report


@pytest.mark.e2e
@pytest.mark.slow
def test_report_with_failed_trials(studies, tmp_path, capsys) -> None:
    assert main(["report", "--experiment", "failing", "--tracking-uri", studies.tracking_uri,
                 "--out", str(tmp_path), "--static", "none", "--json"]) == 0  # fmt: skip
    written = json.loads(capsys.readouterr().out)
    study = load_study(studies.tracking_uri, "failing")
    failed = [t for t in study.trials if t.failed]
    assert len(failed) == 2 and len(study.completed) == 1  # the workers refuse quantized plans
    assert "timeline" in written["figures"] and "pareto" in written["figures"]
    html = (tmp_path / "report.html").read_text()
    assert "2 failed" in html  # the header's count
    from tenantq.report.figures import timeline_figure

    fig = timeline_figure(study)
    names = {trace.name: len(trace.x) for trace in fig.data}
    assert names == {"complete (1)": 1, "failed (2)": 2}
    hovers = [h for trace in fig.data for h in trace.hovertext if "failed" in h]
    assert len(hovers) == 2 and all("injected failure" in h for h in hovers)


@pytest.mark.e2e
@pytest.mark.slow
def test_report_with_a_single_trial(studies, tmp_path) -> None:
    study = load_study(studies.tracking_uri, "single")
    assert [t.number for t in study.trials] == [0] and study.trials[0].is_bf16
    outcome = write_report(study, tmp_path, static="none")
    # The only trial is bf16: it is the chosen trial and its own baseline, so the waterfall has
    # one column and no answer can flip against itself.
    assert outcome.figures == ["pareto", "capacity", "needles", "timeline"]
    assert set(outcome.skipped) == {"sensitivity", "flips"}
    from tenantq.report.figures import waterfall_figure

    fig = waterfall_figure(study.trials[0], study.bf16)
    assert len(fig.data) == 1
    budget = study.trials[0].artifact_json("budget.json")
    y = list(fig.data[0].y)
    # memory - weights - reserve = the KV pool, to the byte (capacity's own arithmetic).
    assert (y[0] + y[1] + y[2]) * 1024**2 == pytest.approx(budget["pool_bytes_per_chip"], abs=1)
    assert (
        budget["tenants"] == 16
    )  # quickstart's deployment at bf16/bf16 (experiments/quickstart.toml)


def test_missing_experiment_names_those_that_exist(tmp_path, capsys) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    client.create_experiment("quickstart", artifact_location=(tmp_path / "a1").as_uri())
    client.create_experiment("kv-grid", artifact_location=(tmp_path / "a2").as_uri())
    capsys.readouterr()  # MLflow's own log lines from creating the store
    code = main(["report", "--experiment", "quickstrat", "--tracking-uri", uri,
                 "--out", str(tmp_path / "out")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1
    assert err == (
        f"tenantq report: error: no experiment 'quickstrat' in {uri}; "
        "experiments there: Default, kv-grid, quickstart\n"
    )
    assert not (tmp_path / "out").exists()  # nothing written


def test_experiment_without_a_study_run(tmp_path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    MlflowClient(uri).create_experiment("empty", artifact_location=(tmp_path / "a3").as_uri())
    with pytest.raises(
        ValueError, match=r"^experiment 'empty' has no study run .*studies there: none$"
    ):
        load_study(uri, "empty")


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        # a scheme MLflow has no store for: named before MLflow is asked (its own exception
        # was a traceback about the *model registry*)
        ("ftp://host/x", "--tracking-uri: MLflow cannot track to 'ftp://host/x' (scheme 'ftp')"),
        # a sqlite store that does not exist: reading must not create an empty one
        ("sqlite:///{tmp}/nope.db", "--tracking-uri: no MLflow store at sqlite:///{tmp}/nope.db"),
    ],
)
def test_a_store_that_cannot_hold_the_study_is_one_line(uri, message, tmp_path, capsys):
    uri, message = uri.format(tmp=tmp_path), message.format(tmp=tmp_path)
    code = main(["report", "--experiment", "quickstart", "--tracking-uri", uri,
                 "--out", str(tmp_path / "out")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"tenantq report: error: {message}"), err
    assert list(tmp_path.iterdir()) == []  # no store created, no report folder


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_a_profile_that_is_not_a_table_names_the_file_and_the_format(suffix, tmp_path):
    from tenantq.evals.profile import read_profile_table

    path = tmp_path / f"profile{suffix}"
    path.write_text("tensor,format,kl_mean\n")  # a CSV under a table's name
    kind = "Parquet" if suffix == ".parquet" else r"Arrow IPC \(Feather\)"
    expected = rf"^sensitivity profile {path}: cannot read it as {kind} "
    with pytest.raises(ValueError, match=expected):
        read_profile_table(path)


@pytest.mark.e2e
@pytest.mark.slow
def test_an_out_folder_that_is_a_file_is_refused_before_any_figure(studies, tmp_path):
    # The CLI refuses it before reading MLflow (tests/cli/test_cli_outputs.py); `write_report`,
    # called as a library, refuses it before building a figure.
    (tmp_path / "report").write_text("not a folder")
    study = load_study(studies.tracking_uri, "single")
    with pytest.raises(ValueError) as err:
        write_report(study, tmp_path / "report", static="none")
    assert str(err.value) == (
        f"out: {tmp_path / 'report'} is a file; give a folder for report.html and figures/"
    )
    assert (tmp_path / "report").read_text() == "not a folder"
