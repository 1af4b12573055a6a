"""Experiment specs: every mistake is one line naming the key, and nothing is written.

The shipped specs under experiments/ validate, including the real-deployment one that needs
hardware and a checkpoint this machine does not have (validated, never run).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from tenantq.cli import main
from tenantq.search.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted((ROOT / "experiments").glob("*.toml"))

BASE = {
    "model": "reference",
    "deployment": {"hardware": "cpu", "memory": "10MiB", "context_tokens": 256},
    "study": {"name": "s", "trials": 3},
}


def _with(mutate) -> dict:
    d = copy.deepcopy(BASE)
    mutate(d)
    return d


# (mutation, text the one-line error must contain: the key and the valid choices)
MISTAKES = [
    (lambda d: d.update(modle="x"), ["modle: unknown key", "model, requires, deployment"]),
    (lambda d: d["deployment"].update(hardwar="cpu"), ["deployment.hardwar", "hardware, memory"]),
    (lambda d: d["deployment"].update(hardware="tpu-v9"), ["tpu-v9", "tpu-v6e"]),
    (lambda d: d["deployment"].pop("memory"), ["deployment", "--memory"]),
    (lambda d: d.update(space={"weight_formats": ["int3"]}), ["space.weight_formats", "'int4'"]),
    (lambda d: d.update(sampler={"kind": "cmaes"}), ["sampler.kind", "'nsga2'", "'tpe'", "'gp'"]),
    (lambda d: d["study"].pop("trials"), ["study.trials: required key is missing"]),
    (lambda d: d["study"].update(trials=0), ["study.trials", "greater than or equal to 1", "0"]),
    (lambda d: d.update(space={"kind": "sensitivity"}), ["space.profile"]),
    (
        lambda d: d.update(objectives=[{"metric": "tenants", "direction": "up"}]),
        ["objectives.0.direction", "'maximize' or 'minimize'"],
    ),
    (lambda d: d.update(workers={"kind": "tpu"}), ["tpu_topology", "TPU-V6E"]),
    (
        lambda d: d.update(space={"key_axes": ["row"]}),
        ["space.key_axes", "'channel', 'token', 'tensor' or 'head'"],
    ),
    (lambda d: d.update(space={"sink_tokens": []}), ["space.sink_tokens", "at least one"]),
    # Sinks are the first tokens of a tenant's context: 300 of a 256-token context are not.
    (
        lambda d: d.update(space={"sink_tokens": [0, 4, 300]}),
        ["space.sink_tokens", "[300]", "deployment.context_tokens = 256"],
    ),
    # numpy's seed range, which Optuna's samplers would refuse only when the study starts.
    (lambda d: d.update(sampler={"seed": -1}), ["sampler.seed", "greater than or equal to 0"]),
    (lambda d: d.update(sampler={"seed": 2**32}), ["sampler.seed", "less than or equal to"]),
    # The name is the runs/NAME folder of the front's plans: one plain path component.
    (lambda d: d["study"].update(name="../../etc"), ["study.name", "'../../etc'", "letters"]),
    (lambda d: d["study"].update(name=""), ["study.name", "not a study name"]),
    (lambda d: d["study"].update(name=".hidden"), ["study.name", "starting with a letter"]),
    (lambda d: d["study"].update(name="a/b"), ["study.name", "'a/b'"]),
]


@pytest.mark.parametrize("mutate,expected", MISTAKES, ids=[m[1][0] for m in MISTAKES])
def test_each_mistake_is_one_line_naming_it(mutate, expected) -> None:
    with pytest.raises(ValueError) as err:
        parse_spec(_with(mutate), "bad.toml")
    message = str(err.value)
    assert "\n" not in message and message.startswith("bad.toml: ")
    for part in expected:
        assert part in message, message


def test_minimal_spec_defaults() -> None:
    spec = parse_spec(copy.deepcopy(BASE))
    assert [o.metric for o in spec.objectives] == ["tenants", "fidelity.kl_mean"]
    assert spec.sampler.kind == "nsga2" and spec.study.storage == "sqlite:///optuna.db"
    assert spec.tracking.uri == "sqlite:///mlflow.db" and spec.experiment_name == "s"


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_shipped_specs_validate(path: Path) -> None:
    from tenantq.capacity import budget, get_model_config
    from tenantq.quant.plan import QuantPlan

    spec = load_spec(path)
    # The capacity side of every shipped spec computes without the checkpoint or hardware.
    model = spec.deployment.model or "tenantq-ref"
    b = budget(get_model_config(model), QuantPlan(), spec.deployment.build(), 256)
    assert b.tenants > 0


def test_real_deployment_spec_says_what_it_needs() -> None:
    spec = load_spec(ROOT / "experiments" / "llama-3.1-8b-v6e-8.toml")
    assert spec.requires and spec.workers.kind == "tpu" and spec.deployment.chips == 8
    # Running it here must stop at the missing checkpoint, before writing anything.
    from tenantq.search.driver import prepare

    with pytest.raises(ValueError, match="needs a local checkpoint"):
        prepare(spec, "")


BAD_FILES = {
    "not-toml.toml": ("model = [", "not valid TOML"),
    "unknown-key.toml": (
        'model = "reference"\nsampler = {kind = "nsga2", sed = 1}\n'
        '[deployment]\nhardware = "cpu"\nmemory = "10MiB"\ncontext_tokens = 256\n'
        '[study]\nname = "s"\ntrials = 2\n',
        "sampler.sed: unknown key",
    ),
    "bad-format.toml": (
        'model = "reference"\n[space]\nkey_formats = ["fp6"]\n'
        '[deployment]\nhardware = "cpu"\nmemory = "10MiB"\ncontext_tokens = 256\n'
        '[study]\nname = "s"\ntrials = 2\n',
        "space.key_formats.0: 'fp6' is not valid",
    ),
    "missing-model.toml": (
        'model = "no/such/checkpoint"\n'
        '[deployment]\nhardware = "cpu"\nmemory = "10MiB"\ncontext_tokens = 256\n'
        '[study]\nname = "s"\ntrials = 2\n',
        "no/such/checkpoint has no config.json",
    ),
    # Metric names are checked against what the suites report (`suite_metrics`), before any
    # trial runs: a typo is not the failure of every trial.
    "objective-typo.toml": (
        'model = "reference"\n[[objectives]]\nmetric = "tenant"\ndirection = "maximize"\n'
        '[deployment]\nhardware = "cpu"\nmemory = "10MiB"\ncontext_tokens = 256\n'
        '[study]\nname = "s"\ntrials = 2\n',
        "objectives.0.metric: suite 'quick' (eval.suite) does not report 'tenant'; did you "
        "mean 'tenants'?",
    ),
    "unmeasured-length.toml": (
        'model = "reference"\n[[objectives]]\nmetric = "needle.acc_delta.len4096"\n'
        'direction = "maximize"\n'
        '[deployment]\nhardware = "cpu"\nmemory = "10MiB"\ncontext_tokens = 256\n'
        '[study]\nname = "s"\ntrials = 2\n',
        "does not report 'needle.acc_delta.len4096'; did you mean 'needle.acc_delta.len1019'",
    ),
    "constraint-bound.toml": (
        'model = "reference"\n[[constraints]]\nmetric = "fidelity.kl_p99"\ntolerance = 0.1\n'
        '[deployment]\nhardware = "cpu"\nmemory = "10MiB"\ncontext_tokens = 256\n'
        '[study]\nname = "s"\ntrials = 2\n',
        "constraints.0: suite 'quick' (eval.suite) does not report 'fidelity.kl_p99.ci_high'",
    ),
    "unknown-suite.toml": (
        'model = "reference"\n[eval]\nsuite = "quik"\n'
        '[deployment]\nhardware = "cpu"\nmemory = "10MiB"\ncontext_tokens = 256\n'
        '[study]\nname = "s"\ntrials = 2\n',
        "eval.suite: suite 'quik' not found: use one of long, quick, standard",
    ),
    "confirm-lacks-objective.toml": (
        'model = "reference"\n[eval]\nconfirm_suite = "CONFIRM"\n'
        '[[objectives]]\nmetric = "needle.acc_delta.len1019"\ndirection = "maximize"\n'
        '[deployment]\nhardware = "cpu"\nmemory = "10MiB"\ncontext_tokens = 256\n'
        '[study]\nname = "s"\ntrials = 2\n',
        "objectives.0.metric: suite 'fidelity-only' (eval.confirm_suite) does not report "
        "'needle.acc_delta.len1019'",
    ),
    "edge-layers.toml": (
        'model = "reference"\n[space]\nbf16_first_layers = [0, 9]\n'
        '[deployment]\nhardware = "cpu"\nmemory = "10MiB"\ncontext_tokens = 256\n'
        '[study]\nname = "s"\ntrials = 2\n',
        "exceed the model's 4 layers",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_spec_file_writes_nothing(name, tmp_path, monkeypatch, capsys) -> None:
    text, expected = BAD_FILES[name]
    files = [name]
    if "CONFIRM" in text:  # a confirmation suite that measures fidelity only
        suite = tmp_path / "fidelity-only.toml"
        suite.write_text("[fidelity]\nrows = 2\nrow_tokens = 64\n")
        text = text.replace("CONFIRM", str(suite))
        files.append(suite.name)
    (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    assert main(["search", name, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err
    # No Optuna or MLflow store, no exported plans: the spec failed before anything was opened.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)
