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
    (
        lambda d: d.update(modle="x"),
        ["unknown key 'modle'; valid keys here:", "model, requires, deployment"],
    ),
    (
        lambda d: d["deployment"].update(hardwar="cpu"),
        ["deployment: unknown key 'hardwar'", "hardware, memory"],
    ),
    (lambda d: d["deployment"].update(hardware="tpu-v9"), ["tpu-v9", "tpu-v6e"]),
    (lambda d: d["deployment"].pop("memory"), ["deployment", "--memory"]),
    (
        lambda d: d.update(space={"weight_formats": ["int3"]}),
        ["space.weight_formats.0: unknown format 'int3'", "int8, int4"],
    ),
    (
        lambda d: d.update(sampler={"kind": "cmaes"}),
        ["sampler.kind: unknown kind 'cmaes'", "nsga2, tpe, gp"],
    ),
    (lambda d: d["study"].pop("trials"), ["study: required key 'trials' is missing"]),
    (lambda d: d["study"].update(trials=0), ["study.trials", "greater than or equal to 1", "0"]),
    (lambda d: d.update(space={"kind": "sensitivity"}), ["space.profile"]),
    (
        lambda d: d.update(objectives=[{"metric": "tenants", "direction": "up"}]),
        ["objectives.0.direction: unknown direction 'up'", "maximize, minimize"],
    ),
    (lambda d: d.update(workers={"kind": "tpu"}), ["tpu_topology", "TPU-V6E"]),
    (
        lambda d: d.update(space={"key_axes": ["row"]}),
        ["space.key_axes.0: unknown key axis 'row'", "channel, token, tensor, head"],
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
    # Issue 24: a study that can never succeed is refused before it starts.
    (
        lambda d: d.update(objectives=[{"metric": "tenants", "direction": "minimize"}]),
        ["objectives.0: 'tenants' must be maximized", "direction = 'maximize'"],
    ),
    (
        lambda d: d.update(constraints=[{"metric": "fidelity.kl_mean", "tolerance": -0.5}]),
        ["constraints.0.tolerance", "greater than or equal to 0", "-0.5"],
    ),
    (
        lambda d: d.update(constraints=[{"metric": "fidelity.kl_mean", "tolerance": float("nan")}]),
        ["constraints.0.tolerance", "finite number"],
    ),
    (
        lambda d: d.update(constraints=[{"metric": "fidelity.kl_mean", "tolerance": float("inf")}]),
        ["constraints.0.tolerance", "finite number"],
    ),
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
    # a quality objective: capacity_aware is the default (issue 25)
    assert spec.sampler.kind == "capacity_aware" and spec.study.storage == "sqlite:///optuna.db"
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
    from tenantq.search.driver import study_context

    with pytest.raises(ValueError, match="needs a local checkpoint"):
        study_context(spec, "")


BAD_FILES = {
    "not-toml.toml": ("model = [", "not valid TOML"),
    "unknown-key.toml": (
        'model = "reference"\nsampler = {kind = "nsga2", sed = 1}\n'
        '[deployment]\nhardware = "cpu"\nmemory = "10MiB"\ncontext_tokens = 256\n'
        '[study]\nname = "s"\ntrials = 2\n',
        "sampler: unknown key 'sed'",
    ),
    "bad-format.toml": (
        'model = "reference"\n[space]\nkey_formats = ["fp6"]\n'
        '[deployment]\nhardware = "cpu"\nmemory = "10MiB"\ncontext_tokens = 256\n'
        '[study]\nname = "s"\ntrials = 2\n',
        "space.key_formats.0: unknown format 'fp6'",
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
    # The two stores' URLs are checked before either is opened (no file, no connection).
    "storage-not-a-url.toml": (
        'model = "reference"\n'
        '[deployment]\nhardware = "cpu"\nmemory = "10MiB"\ncontext_tokens = 256\n'
        '[study]\nname = "s"\ntrials = 2\nstorage = "optuna.db"\n',
        "study.storage: 'optuna.db' is not a database URL Optuna can use; write sqlite:///",
    ),
    "storage-no-folder.toml": (
        'model = "reference"\n'
        '[deployment]\nhardware = "cpu"\nmemory = "10MiB"\ncontext_tokens = 256\n'
        '[study]\nname = "s"\ntrials = 2\nstorage = "sqlite:///no/such/folder/o.db"\n',
        "study.storage: the folder of 'no/such/folder/o.db'",
    ),
    "storage-unknown-database.toml": (
        'model = "reference"\n'
        '[deployment]\nhardware = "cpu"\nmemory = "10MiB"\ncontext_tokens = 256\n'
        '[study]\nname = "s"\ntrials = 2\nstorage = "mongodb://h/x"\n',
        "study.storage: 'mongodb://h/x' is not a database URL Optuna can use",
    ),
    "tracking-scheme.toml": (
        'model = "reference"\n'
        '[deployment]\nhardware = "cpu"\nmemory = "10MiB"\ncontext_tokens = 256\n'
        '[study]\nname = "s"\ntrials = 2\n[tracking]\nuri = "ftp://host/x"\n',
        "tracking.uri: MLflow cannot track to 'ftp://host/x' (scheme 'ftp')",
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


def test_a_storage_driver_that_is_missing_is_named(monkeypatch):
    # A database URL whose driver module is not installed: named before any connection.
    from sqlalchemy.engine import make_url

    from tenantq.search.driver import check_stores

    url = "postgresql://u@127.0.0.1/db"
    dialect = make_url(url).get_dialect()  # the dialect class

    def missing(cls):
        raise ImportError("No module named 'psycopg'")

    monkeypatch.setattr(dialect, "import_dbapi", classmethod(missing))
    spec = parse_spec(_with(lambda d: d["study"].update(storage=url)))
    with pytest.raises(ValueError) as err:
        check_stores(spec)
    assert str(err.value) == (
        f"study.storage: {url!r} needs the postgresql driver, which is not installed (No "
        "module named 'psycopg'); install it, or use sqlite:///FILE.db, "
        "postgresql://USER@HOST/DB or mysql://USER@HOST/DB"
    )


def test_unreachable_tracking_server_stops_before_the_study_is_created(
    tmp_path, monkeypatch, capsys
):
    # A closed port: MLflow's client fails (no retries here); Optuna's storage was not yet
    # opened, so no optuna.db holds a study that a rerun would have to --resume.
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    text = (ROOT / "experiments" / "capacity-only.toml").read_text()
    text = text.replace(
        "trials = 20\n", f'trials = 2\n\n[tracking]\nuri = "http://127.0.0.1:{port}"\n'
    )
    (tmp_path / "spec.toml").write_text(text)
    monkeypatch.chdir(tmp_path)
    assert main(["search", "spec.toml", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(
        f"tenantq search: error: tracking.uri: cannot open MLflow at 'http://127.0.0.1:{port}'"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.toml"]


def test_a_storage_that_cannot_be_opened_is_one_line(tmp_path, monkeypatch, capsys):
    # The URL is well formed and its folder exists, but the "file" is a folder: sqlite's
    # OperationalError when Optuna opens it becomes one line naming study.storage.
    (tmp_path / "optuna.db").mkdir()
    text = (ROOT / "experiments" / "capacity-only.toml").read_text()
    text = text.replace("trials = 20\n", 'trials = 2\nstorage = "sqlite:///optuna.db"\n')
    (tmp_path / "spec.toml").write_text(text)
    monkeypatch.chdir(tmp_path)
    assert main(["search", "spec.toml", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    # Named by the store-file check before SQLAlchemy is asked (tenantq.search.checks).
    assert err == (
        "tenantq search: error: study.storage: optuna.db is a folder; give a sqlite:/// path "
        "to a database file"
    ), err


# The one-line error in full for each shape of pydantic error: a nested unknown key lists the
# keys of the model it sits in (a list item's model, through `list[...] | None` too), a
# literal names the input and the choices, a validator's message loses pydantic's
# "Value error, " prefix, and a second error is counted, never listed.
EXACT = [
    ({"objectives": [{"metric": "tenants", "direction": "maximize", "bad": 1}]},
     "s.toml: objectives.0: unknown key 'bad'; valid keys here: metric, direction"),
    ({"constraints": [{"metric": "fidelity.kl_mean", "tolerance": 0.1, "bad": 1}]},
     "s.toml: constraints.0: unknown key 'bad'; valid keys here: metric, tolerance, bound"),
    ({"sampler": {"kind": "cmaes"}},
     "s.toml: sampler.kind: unknown kind 'cmaes'; valid kinds: nsga2, tpe, gp, random, grid, "
     "capacity_aware"),
    ({"sampler": {"kind": "cmaes", "seed": -1}},
     "s.toml: sampler.kind: unknown kind 'cmaes'; valid kinds: nsga2, tpe, gp, random, grid, "
     "capacity_aware (and 1 more)"),
    ({"space": {"sink_tokens": [0, 4, 300]}},
     "s.toml: space.sink_tokens: choices [300] exceed deployment.context_tokens = 256; sink "
     "tokens are the first tokens of a tenant's context"),
    ({"": 1},  # an empty TOML key (`"" = 1`) at the top level: the key is quoted, empty
     "s.toml: unknown key ''; valid keys here: model, requires, deployment, space, "
     "objectives, constraints, eval, calibration, sampler, study, workers, tracking"),
]  # fmt: skip


@pytest.mark.parametrize(("update", "message"), EXACT)
def test_a_spec_error_is_exactly_one_line_naming_the_key(update, message):
    with pytest.raises(ValueError) as err:
        parse_spec(_with(lambda d: d.update(update)), "s.toml")
    assert str(err.value) == message


def test_a_missing_spec_file_is_named(tmp_path):
    with pytest.raises(ValueError) as err:
        load_spec(tmp_path / "none.toml")
    assert str(err.value) == f"spec file {tmp_path / 'none.toml'} does not exist"


def test_the_default_sampler_is_nsga2_only_for_a_capacity_only_study():
    from tenantq.search.spec import default_sampler_kind

    capacity_only = parse_spec(_with(lambda d: d.update(
        objectives=[{"metric": "tenants", "direction": "maximize"}])))  # fmt: skip
    assert default_sampler_kind(capacity_only) == "nsga2"
    assert default_sampler_kind(parse_spec(BASE)) == "capacity_aware"


@pytest.mark.parametrize(("baselines", "wanted"), [(None, True), (True, True), (False, False)])
def test_baselines_are_enqueued_unless_the_spec_says_false(baselines, wanted):
    from tenantq.search.spec import wants_baselines

    study = dict(BASE["study"]) | ({} if baselines is None else {"baselines": baselines})
    assert wants_baselines(parse_spec(_with(lambda d: d.update(study=study)))) is wanted


def test_a_resumed_study_keeps_its_stored_sampler_with_the_fields_the_spec_sets():
    from tenantq.search.spec import SamplerSpec, resumed_sampler

    spec = parse_spec(_with(lambda d: d.update(sampler={"seed": 5})))
    stored = {"kind": "nsga2", "seed": 0, "population_size": 6}
    assert resumed_sampler(spec, stored) == SamplerSpec(kind="nsga2", seed=5, population_size=6)
    same = spec.sampler.model_dump(mode="json")
    assert resumed_sampler(spec, same) is None  # nothing differs: the spec's sampler stands


def test_an_error_names_the_spec_file_it_came_from_or_the_word_spec(tmp_path):
    path = tmp_path / "study.toml"
    path.write_text('modle = "x"\n')  # the first of its errors: `model` is missing
    with pytest.raises(ValueError, match=rf"^{path}: required key 'model' is missing \(and 3 "):
        load_spec(path)
    with pytest.raises(ValueError, match=r"^spec: unknown key 'modle'; valid keys here: "):
        parse_spec(_with(lambda d: d.update(modle="x")))  # no source given


def test_the_calibration_settings_reach_the_workers_calibration_data():
    from tenantq.evals.calibrated import CalibrationData

    spec = parse_spec(_with(lambda d: d.update(
        calibration={"data": "c.txt", "sequences": 3, "sequence_tokens": 64})))  # fmt: skip
    got = CalibrationData(**spec.calibration.worker_args())  # what HostWorker builds
    assert got == CalibrationData(data="c.txt", sequences=3, sequence_tokens=64)
    # One schema: the spec's table is the calibration set's fields plus the algorithm, so a
    # field added to one cannot be missing (or named differently) in the other.
    from tenantq.search.spec import CalibrationSpec

    assert isinstance(spec.calibration, CalibrationData)
    assert set(CalibrationSpec.model_fields) == set(CalibrationData.model_fields) | {"algorithm"}


def test_the_deployment_is_built_with_every_setting_of_the_spec():
    deployment = {"hardware": "h100-sxm", "chips": 2, "context_tokens": 256,
                  "page_tokens": 32, "reserve": "4GiB"}  # fmt: skip
    built = parse_spec(_with(lambda d: d.update(deployment=deployment))).deployment.build()
    assert (built.hardware.name, built.chips, built.page_tokens) == ("h100-sxm", 2, 32)
    assert built.reserve.fixed_bytes == 4 * 2**30


@pytest.mark.parametrize(
    "old, new",
    [("source", "data"), ("num_sequences", "sequences"), ("seq_tokens", "sequence_tokens")],
)
def test_a_calibration_field_under_its_old_name_is_refused_naming_the_new_one(old, new):
    # CalibrationData's fields took the spec's names (source -> data, ...): a spec table or
    # a caller still using the old name gets one line naming the new field, not a key list.
    from tenantq.quant.calibration_set import CalibrationData

    raw = _with(lambda d: d.update(calibration={old: 8}))
    with pytest.raises(ValueError, match=rf"^spec: calibration: '{old}' is now '{new}'$"):
        parse_spec(raw)
    with pytest.raises(ValueError, match=rf"'{old}' is now '{new}'"):
        CalibrationData(**{old: 8})


@pytest.mark.parametrize("value", [True, False, "2", 2.0, 2.5, -1])
def test_max_keep_bf16_is_a_strict_integer(value):
    # A count of tensors kept in bf16 (search/space.py): pydantic's lax int read `true` as 1,
    # `false` as 0, "2" and 2.0 as 2; each is refused in one line naming the field and what
    # is right, with the value given.
    raw = _with(lambda d: d.update(space={"kind": "sensitivity", "profile": "p.parquet",
                                          "max_keep_bf16": value}))  # fmt: skip
    with pytest.raises(ValueError) as err:
        parse_spec(raw)
    assert str(err.value) == (
        "spec: space.max_keep_bf16: must be a whole number >= 0 (the most tensors kept in "
        f"bf16; 0: none); leave it out for no limit (got {value!r})"
    )


@pytest.mark.parametrize("value", [None, 0, 3])
def test_max_keep_bf16_takes_a_whole_number_or_nothing(value):
    raw = _with(lambda d: d.update(space={"kind": "sensitivity", "profile": "p.parquet",
                                          "max_keep_bf16": value}))  # fmt: skip
    got = parse_spec(raw).space.max_keep_bf16
    assert got == value and type(got) is type(value)


def test_max_keep_bf16_from_toml_text_keeps_its_type_and_size():
    # TOML integers are unbounded in tomllib: a cap past 64 bits is still a whole number
    # (search/space.py caps k at the profile's length); TOML's own true, 2.0 and "2" are
    # refused as in the dict form (spec.py _whole_count).
    import tomllib

    for text, ok in (("18446744073709551616", True), ("0", True), ("true", False),
                     ("2.0", False), ('"2"', False), ("-0", True)):  # fmt: skip
        value = tomllib.loads(f"v = {text}")["v"]
        raw = _with(lambda d, v=value: d.update(space={"kind": "sensitivity",
                                                       "profile": "p.parquet",
                                                       "max_keep_bf16": v}))  # fmt: skip
        if ok:
            got = parse_spec(raw).space.max_keep_bf16
            assert got == value and type(got) is int
        else:
            with pytest.raises(ValueError, match=r"space\.max_keep_bf16: must be a whole number"):
                parse_spec(raw)
