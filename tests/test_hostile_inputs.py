"""Hostile inputs, round 2 (issue 24): inputs that were accepted and gave a wrong result, or
ended in a traceback or in an error that did not name them. Each is now one line naming the
file or key and what would be right (or, for a value that is legitimately ignorable, a
warning naming it).

Two tables: `CASES` calls the one validating function of each input kind (spec, suite,
plan, sensitivity profile, checkpoint, dataset, store) and checks the ValueError; `CLI_CASES`
runs the `tenantq` command a user would, and checks exit 2, one line on stderr, no traceback
and nothing created. The spec's pure-schema cases are in tests/search/test_spec.py
(MISTAKES, BAD_FILES); this file holds the ones that need the model, files or a command.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tenantq.cli import main
from tenantq.model.config import ModelConfig
from tenantq.reference import reference_model_path

ROOT = Path(__file__).resolve().parents[1]
REF = reference_model_path()
REF_CONFIG = ModelConfig.from_file(REF / "config.json")  # 4 layers, 1,024 positions, vocab 2,048
_spec = importlib.util.spec_from_file_location(
    "hand_checkpoint", ROOT / "tests/model/hand_checkpoint.py"
)
hand = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hand)

SPEC_HEAD = (
    'model = "reference"\n'
    '[deployment]\nhardware = "cpu"\nmemory = "10MiB"\ncontext_tokens = 256\n'
    '[study]\nname = "s"\ntrials = 2\n'
)


# ------------------------------------------------------------------ helpers building inputs
def _suite(tmp: Path, text: str) -> Path:
    path = tmp / "suite.toml"
    path.write_text(text)
    return path


def _load_suite(tmp: Path, text: str):
    from tenantq.evals.suite import load_suite

    path = _suite(tmp, text)
    return lambda: load_suite(path)


def _suite_on_model(tmp: Path, text: str):
    from tenantq.evals.suite import check_suite_for_model, load_suite

    suite = load_suite(_suite(tmp, text))
    return lambda: check_suite_for_model(suite, REF_CONFIG)


def _plan_json(tmp: Path, text: str):
    from tenantq.quant.plan import QuantPlan

    path = tmp / "plan.json"
    path.write_text(text)
    return lambda: QuantPlan.load(path)


def _plan_toml(tmp: Path, text: str):
    from tenantq.quant.plan import QuantPlan

    path = tmp / "plan.toml"
    path.write_text(text)
    return lambda: QuantPlan.load(path)


def _plan_on_model(raw: dict):
    from tenantq.quant.plan import QuantPlan

    return lambda: QuantPlan.from_dict(raw).check_model(REF_CONFIG)


def _profile(tmp: Path, rows: list[tuple[str, float]], on_model: bool = False):
    from tenantq.evals.profile import read_profile_table
    from tenantq.search.space import SensitivityProfile

    path = tmp / "profile.parquet"
    table = pa.table(
        {
            "tensor": [t for t, _ in rows],
            "format": ["int4"] * len(rows),
            "kl_mean": pa.array([kl for _, kl in rows], pa.float64()),
        }
    )
    pq.write_table(table, path)
    if on_model:
        return lambda: SensitivityProfile.load(path, REF_CONFIG)
    return lambda: read_profile_table(path)


def _reference_copy(tmp: Path, config_update: dict | None = None) -> Path:
    """The reference checkpoint with its weights linked (not copied) and config.json edited."""
    folder = tmp / "ckpt"
    folder.mkdir()
    for f in REF.iterdir():
        if f.suffix == ".safetensors":
            (folder / f.name).symlink_to(f)
        elif f.name == "tokenizer.json":
            shutil.copy(f, folder / f.name)
    raw = json.loads((REF / "config.json").read_text())
    raw.update(config_update or {})
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def _load_checkpoint(folder: Path):
    from tenantq.model.loader import iter_checkpoint

    config = ModelConfig.from_file(folder / "config.json")
    return lambda: next(iter_checkpoint(folder, config))


def _hand_folder(tmp: Path) -> Path:
    folder = tmp / "hand"
    folder.mkdir()
    hand.write_checkpoint(folder)
    return folder


def _weights_named_folder(tmp: Path):
    folder = _hand_folder(tmp)
    (folder / "model.safetensors").rename(folder / "weights.safetensors")
    (folder / "model.safetensors").mkdir()
    return _load_checkpoint(folder)


def _symlink_loop(tmp: Path):
    folder = _hand_folder(tmp)
    (folder / "loop.safetensors").symlink_to(folder / "loop.safetensors")
    return _load_checkpoint(folder)


def _dangling(tmp: Path):
    folder = _hand_folder(tmp)
    (folder / "gone.safetensors").symlink_to(tmp / "nowhere.safetensors")
    return _load_checkpoint(folder)


def _identity_of_folder_weights(tmp: Path):
    from tenantq.evals.identity import model_identity

    folder = _hand_folder(tmp)
    (folder / "extra.safetensors").mkdir()
    return lambda: model_identity(folder)


def _tokenizer(tmp: Path, text: str | None, vocab_update: dict | None = None):
    from tenantq.model.tokenizer import require_tokenizer

    folder = _reference_copy(tmp, vocab_update)
    if text is None:
        (folder / "tokenizer.json").unlink()
    else:
        (folder / "tokenizer.json").write_text(text)
    config = ModelConfig.from_file(folder / "config.json")
    return lambda: require_tokenizer(folder, config.vocab_size)


def _small_vocab_tokenizer(tmp: Path):
    from tenantq.model.tokenizer import require_tokenizer

    folder = _reference_copy(tmp, {"vocab_size": 1000})
    return lambda: require_tokenizer(folder, 1000)


def _jsonl(tmp: Path, lines: list[str]):
    from tenantq.evals.data import load_documents

    path = tmp / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return lambda: load_documents(str(path))


def _store(tmp: Path, url_key: str, content: bytes | None):
    from tenantq.search.checks import check_store_files
    from tenantq.search.spec import parse_spec

    path = tmp / "store.db"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    raw = {
        "model": "reference",
        "deployment": {"hardware": "cpu", "memory": "10MiB", "context_tokens": 256},
        "study": {"name": "s", "trials": 2},
    }
    if url_key == "study.storage":
        raw["study"]["storage"] = f"sqlite:///{path}"
    else:
        raw["tracking"] = {"uri": f"sqlite:///{path}"}
    spec = parse_spec(raw)
    return lambda: check_store_files(spec)


def _study_spec(text: str):
    """`check_study` on a spec (TOML text appended to a valid head)."""
    import tomllib

    from tenantq.search.checks import check_study
    from tenantq.search.spec import parse_spec

    spec = parse_spec(tomllib.loads(text), "spec.toml")
    return lambda: check_study(spec)


def _damaged_checkpoint(tmp: Path, damage: str) -> Path:
    """The reference checkpoint with one fault a header read finds (round 3, item 1)."""
    from safetensors.numpy import load_file, save_file

    folder = _reference_copy(tmp)
    weights = folder / "model.safetensors"
    if damage == "empty":
        weights.unlink()
        weights.write_bytes(b"")
        return folder
    tensors = load_file(str(REF / "model.safetensors"))
    if damage == "missing":
        tensors.pop("model.layers.1.self_attn.k_proj.weight")
    elif damage == "shape":
        name = "model.layers.0.mlp.down_proj.weight"
        tensors[name] = tensors[name][:, :100].copy()
    weights.unlink()
    save_file(tensors, str(weights))
    return folder


def _study_on_model(folder: Path, extra: str = ""):
    """`check_study` on a valid spec whose model is `folder`."""
    return _study_spec(SPEC_HEAD.replace('"reference"', f'"{folder}"') + extra)


def _config_of(tmp: Path, update: dict, drop: tuple[str, ...] = ()):
    folder = _reference_copy(tmp, update)
    raw = json.loads((folder / "config.json").read_text())
    for key in drop:
        raw.pop(key, None)
    (folder / "config.json").write_text(json.dumps(raw))
    return lambda: ModelConfig.from_file(folder / "config.json")


def _parsed_spec(text: str):
    """`parse_spec` alone (the schema and its cross-field checks, no model)."""
    import tomllib

    from tenantq.search.spec import parse_spec

    return lambda: parse_spec(tomllib.loads(text), "spec.toml")


def _source(path: Path) -> str:
    return f'source = "{path}"\n'


def _calibration_study(tmp: Path, data: str | None, text: str | None = "", extra: str = ""):
    """`check_study` with a [calibration] table; `data` written with `text` (None: a folder)."""
    if data is not None:
        if text is None:
            (tmp / data).mkdir()
        else:
            (tmp / data).write_text(text)
        extra = f'data = "{tmp / data}"\n' + extra
    return _study_spec(SPEC_HEAD + '[calibration]\nalgorithm = "gptq"\n' + extra)


FIDELITY = "[fidelity]\nrows = 2\nrow_tokens = 64\n"
LONG_NEEDLES = "[[needles]]\nlengths = [1500]\nper_length = 2\n"

# (id, build(tmp) -> the call that must raise, texts the one-line error must contain)
CASES = [
    # ---- suites (evals.suite.load_suite / parse_suite, check_suite_for_model)
    (
        "suite-no-task",
        lambda t: _load_suite(t, "seed = 0\n"),
        ["suite.toml", "no task", "[fidelity]"],
    ),
    (
        "suite-only-gates",
        lambda t: _load_suite(
            t, '[[gates]]\nmetric = "fidelity.kl_mean"\ntolerance = 0.1\nhigher_is_better = false\n'
        ),
        ["no task"],
    ),
    (
        "suite-empty-lengths",
        lambda t: _load_suite(t, "[[needles]]\nlengths = []\nper_length = 2\n"),
        ["needles.0.lengths", "at least one prompt length"],
    ),
    (
        "suite-duplicate-lengths",
        lambda t: _load_suite(t, "[[needles]]\nlengths = [128, 256, 128]\nper_length = 2\n"),
        ["needles.0.lengths", "twice", "[128, 256, 128]"],
    ),
    (
        "suite-negative-length",
        lambda t: _load_suite(t, "[[needles]]\nlengths = [-5]\nper_length = 2\n"),
        ["needles.0.lengths", "[-5] too short", "32 tokens"],
    ),
    (
        "suite-tiny-length",
        lambda t: _load_suite(t, "[[needles]]\nlengths = [4]\nper_length = 2\n"),
        ["needles.0.lengths", "[4] too short"],
    ),
    (
        "suite-gated-twice",
        lambda t: _load_suite(
            t,
            FIDELITY
            + '[[gates]]\nmetric = "fidelity.kl_mean"\ntolerance = 0.01\nhigher_is_better = false\n'
            '[[gates]]\nmetric = "fidelity.kl_mean"\ntolerance = 0.5\nhigher_is_better = false\n',
        ),
        ["gates", "'fidelity.kl_mean' is gated twice"],
    ),
    ("suite-unknown-key", lambda t: _load_suite(t, "[needles]\nlenghts = [1]\n"), ["needles"]),
    (
        "suite-unknown-fidelity-key",
        lambda t: _load_suite(t, "[fidelity]\nrowz = 2\n"),
        ["fidelity: unknown key 'rowz'; valid keys here: source, text_field, rows, row_tokens"],
    ),
    (
        "suite-per-length-zero",
        lambda t: _load_suite(t, "[[needles]]\nlengths = [128]\nper_length = 0\n"),
        ["needles.0.per_length", "greater than 0", "(got 0)"],
    ),
    (
        "suite-negative-tolerance",
        lambda t: _load_suite(
            t,
            FIDELITY
            + '[[gates]]\nmetric = "fidelity.kl_mean"\ntolerance = -1\nhigher_is_better = false\n',
        ),
        ["gates.0.tolerance", "(got -1"],
    ),
    (
        "suite-bad-split",
        lambda t: _load_suite(t, 'split = "train"\n' + FIDELITY),
        ["split: unknown split 'train'; valid splits: search, confirm"],
    ),
    (
        # numpy's seed sequence used to refuse it mid-run with "expected non-negative integer".
        "suite-negative-seed",
        lambda t: _load_suite(t, "seed = -1\n" + FIDELITY),
        ["suite.toml: seed: Input should be greater than or equal to 0 (got -1)"],
    ),
    (
        "suite-resamples-small",
        lambda t: _load_suite(t, "resamples = 5\n" + FIDELITY),
        ["resamples", "greater than or equal to 100", "(got 5)"],
    ),
    (
        "suite-needle-beyond-model",
        lambda t: _suite_on_model(t, "[[needles]]\nlengths = [2000]\nper_length = 2\n"),
        ["needles.0.lengths [2000]", "context of 1024"],
    ),
    (
        "suite-rows-beyond-model",
        lambda t: _suite_on_model(t, "[fidelity]\nrows = 2\nrow_tokens = 4096\n"),
        ["fidelity.row_tokens = 4096", "context of 1024"],
    ),
    (
        "suite-top-k-beyond-vocab",
        lambda t: _suite_on_model(
            t, "[fidelity]\nrows = 2\nrow_tokens = 64\nexact_vocab_limit = 8\ntop_k = 4096\n"
        ),
        ["fidelity.top_k = 4096", "vocabulary of 2048"],
    ),
    (
        "suite-tail-beyond-vocab",
        lambda t: _suite_on_model(
            t, "[fidelity]\nrows = 2\nrow_tokens = 64\nexact_vocab_limit = 8\ntail_samples = 2048\n"
        ),
        ["fidelity.tail_samples = 2048"],
    ),
    (
        "suite-structured-beyond-model",
        lambda t: _suite_on_model(t, "[structured]\ncontext_tokens = 1020\nmax_new_tokens = 12\n"),
        ["structured.context_tokens + max_new_tokens = 1032", "context of 1024"],
    ),
    # ---- plans (quant.plan: QuantPlan.load / from_dict, check_model)
    (
        "plan-layer-twice",
        lambda t: _plan_json(
            t,
            json.dumps(
                {
                    "rules": [],
                    "kv": {
                        "layer_formats": [
                            {"layer": 0, "key_format": "int4"},
                            {"layer": 0, "key_format": "int8"},
                        ]
                    },
                }
            ),
        ),
        ["plan.json", "kv.layer_formats: layer 0 is already given in kv.layer_formats"],
    ),
    (
        "plan-layer-negative-alias",
        lambda t: _plan_on_model(
            {
                "kv": {
                    "layer_formats": [
                        {"layer": 0, "key_format": "int4"},
                        {"layer": -4, "key_format": "int8"},
                    ]
                }
            }
        ),
        ["kv.layer_formats: layer -4 is already given in kv.layer_formats (as 0)"],
    ),
    (
        "plan-bf16-and-format",
        lambda t: _plan_json(
            t,
            json.dumps(
                {"kv": {"bf16_layers": [1], "layer_formats": [{"layer": 1, "key_format": "int4"}]}}
            ),
        ),
        ["kv.bf16_layers: layer 1 is already given in kv.layer_formats"],
    ),
    (
        "plan-bf16-alias-and-format",
        lambda t: _plan_on_model(
            {"kv": {"bf16_layers": [-1], "layer_formats": [{"layer": 3, "value_format": "int4"}]}}
        ),
        ["kv.bf16_layers: layer -1 is already given in kv.layer_formats (as 3)"],
    ),
    (
        "plan-duplicate-json-key",
        lambda t: _plan_json(
            t, '{"rules": [], "kv": {"key_format": "int4", "key_format": "int8"}}'
        ),
        ["plan.json", "key 'key_format' is given twice"],
    ),
    (
        "plan-duplicate-rule-key",
        lambda t: _plan_json(
            t, '{"rules": [{"pattern": ".*", "format": "int4", "format": "int8"}]}'
        ),
        ["key 'format' is given twice"],
    ),
    (
        "plan-duplicate-toml-key",
        lambda t: _plan_toml(t, '[kv]\nkey_format = "int4"\nkey_format = "int8"\n'),
        ["plan.toml", "cannot parse"],
    ),
    (
        "plan-group-on-bf16",
        lambda t: _plan_json(
            t, json.dumps({"rules": [{"pattern": "embed", "format": "bf16", "group_size": 128}]})
        ),
        ["rules[0] (pattern 'embed')", "group_size=128 on a bf16 rule does nothing"],
    ),
    (
        "plan-group-on-bf16-toml",
        lambda t: _plan_toml(t, '[[rules]]\npattern = ".*"\nformat = "bf16"\ngroup_size = 32\n'),
        ["plan.toml", "group_size=32 on a bf16 rule does nothing"],
    ),
    (
        "plan-asymmetric-bf16",
        lambda t: _plan_json(
            t, json.dumps({"rules": [{"pattern": ".*", "format": "bf16", "symmetric": False}]})
        ),
        ["symmetric=False on a bf16 rule"],
    ),
    (
        "plan-w8a8-untied-embed",
        lambda t: _plan_on_model(
            {"rules": [{"pattern": "embed", "format": "int8", "activations": "int8"}]}
        ),
        ["rule 'embed'", "activations='int8' on embed does nothing", "untied"],
    ),
    (
        "plan-layer-beyond-model",
        lambda t: _plan_on_model({"kv": {"key_format": "int8", "bf16_layers": [7]}}),
        ["kv.bf16_layers: layer 7 is out of range for a model of 4 layers"],
    ),
    ("plan-top-level-list", lambda t: _plan_json(t, "[1, 2]"), ["a plan must be an object"]),
    # ---- sensitivity profiles (evals.profile.read_profile_table / SensitivityProfile.load)
    (
        "profile-nan-kl",
        lambda t: _profile(t, [("layers/0/mlp/up_proj", 0.1), ("embed", math.nan)]),
        ["profile.parquet", "kl_mean of embed (int4) is nan", "finite number >= 0"],
    ),
    (
        "profile-inf-kl",
        lambda t: _profile(t, [("embed", math.inf)]),
        ["kl_mean of embed (int4) is inf"],
    ),
    (
        "profile-negative-kl",
        lambda t: _profile(t, [("embed", -0.5)]),
        ["kl_mean of embed (int4) is -0.5"],
    ),
    (
        "profile-kv-beyond-model",
        lambda t: _profile(t, [(f"kv/{i}", 0.1) for i in range(32)], on_model=True),
        ["row 'kv/4' names no KV layer", "4 layers", "kv/0..kv/3"],
    ),
    (
        "profile-kv-not-a-layer",
        lambda t: _profile(t, [("kv/x", 0.1)]),
        ["row 'kv/x' names no KV layer"],
    ),
    ("profile-empty-tensor", lambda t: _profile(t, [("", 0.1)]), ["a row has tensor ''"]),
    (
        "profile-other-model",
        lambda t: _profile(t, [("layers/9/mlp/up_proj", 0.1)], on_model=True),
        ["tensors not in the model", "layers/9/mlp/up_proj"],
    ),
    # ---- checkpoints (model.loader, model.tokenizer, evals.identity)
    (
        "ckpt-tied-with-trained-head",
        lambda t: _load_checkpoint(_reference_copy(t, {"tie_word_embeddings": True})),
        ["config.json: tie_word_embeddings is true", "lm_head.weight that differs", "false"],
    ),
    ("ckpt-folder-named-safetensors", _weights_named_folder, ["model.safetensors is a folder"]),
    (
        "ckpt-symlink-loop",
        _symlink_loop,
        ["loop.safetensors is a symbolic link that leads to no file"],
    ),
    ("ckpt-dangling-link", _dangling, ["gone.safetensors is a symbolic link"]),
    (
        "ckpt-identity-folder-weights",
        _identity_of_folder_weights,
        ["extra.safetensors is a folder"],
    ),
    (
        "tokenizer-garbage",
        lambda t: _tokenizer(t, "{not a tokenizer"),
        ["tokenizer.json: cannot be read as a tokenizer"],
    ),
    ("tokenizer-empty-object", lambda t: _tokenizer(t, "{}"), ["cannot be read as a tokenizer"]),
    ("tokenizer-missing", lambda t: _tokenizer(t, None), ["has no tokenizer.json"]),
    (
        "tokenizer-bigger-than-vocab",
        _small_vocab_tokenizer,
        ["2048 tokens, more than the model's vocab_size of 1000"],
    ),
    # ---- datasets (evals.data.load_documents)
    (
        "jsonl-number-text",
        lambda t: _jsonl(t, ['{"text": "ok"}', '{"text": 45}']),
        ["data.jsonl' line 2: 'text' must be a string, got int"],
    ),
    (
        "jsonl-null-text",
        lambda t: _jsonl(t, ['{"text": null}']),
        ["line 1: 'text' must be a string, got NoneType"],
    ),
    (
        "jsonl-list-text",
        lambda t: _jsonl(t, ['{"text": "a"}', "", '{"text": ["a"]}']),
        ["line 3: 'text' must be a string, got list"],
    ),
    (
        "jsonl-record-not-object",
        lambda t: _jsonl(t, ['["text"]']),
        ["line 1: expected an object with a 'text' text field, got list"],
    ),
    ("jsonl-missing-field", lambda t: _jsonl(t, ['{"body": "x"}']), ["line 1", "keys ['body']"]),
    (
        "jsonl-bad-line",
        lambda t: _jsonl(t, ['{"text": "a"}', "{oops"]),
        ["JSONDecodeError on line 2"],
    ),
    # ---- stores (tracking.check_sqlite_file through search.checks.check_store_files)
    (
        "optuna-db-not-a-database",
        lambda t: _store(t, "study.storage", b"hello, not sqlite"),
        ["study.storage", "store.db is not a SQLite database"],
    ),
    (
        "optuna-db-a-folder",
        lambda t: _store(t, "study.storage", None),
        ["study.storage", "is a folder"],
    ),
    (
        "mlflow-db-not-a-database",
        lambda t: _store(t, "tracking.uri", b"PK\x03\x04zip"),
        ["tracking.uri", "is not a SQLite database"],
    ),
    (
        "mlflow-db-a-folder",
        lambda t: _store(t, "tracking.uri", None),
        ["tracking.uri", "is a folder"],
    ),
    # ---- specs against the model and the deployment (search.checks.check_study)
    (
        "spec-context-beyond-model",
        lambda t: _study_spec(SPEC_HEAD.replace("256", "4096")),
        ["deployment.context_tokens: 4096 exceeds the model's max_position_embeddings of 1024"],
    ),
    (
        "spec-sinks-beyond-model",
        lambda t: _study_spec(
            SPEC_HEAD.replace("256", "4096") + "[space]\nsink_tokens = [0, 2000]\n"
        ),
        ["deployment.context_tokens: 4096"],
    ),
    (
        "spec-memory-below-weights",
        lambda t: _study_spec(SPEC_HEAD.replace("10MiB", "1MiB")),
        ["deployment: no plan of the space fits a tenant of 256 tokens", "int4"],
    ),
    (
        "spec-capacity-aware-no-quality",
        lambda t: _study_spec(
            SPEC_HEAD + '[sampler]\nkind = "capacity_aware"\n'
            '[[objectives]]\nmetric = "tenants"\ndirection = "maximize"\n'
        ),
        ["sampler.kind: 'capacity_aware' needs a quality objective"],
    ),
    (
        "spec-capacity-only-constraints",
        lambda t: _study_spec(
            SPEC_HEAD + '[[objectives]]\nmetric = "tenants"\ndirection = "maximize"\n'
            '[[constraints]]\nmetric = "fidelity.kl_mean"\ntolerance = 0.1\n'
        ),
        ["constraints: a capacity-only study", "measures no quality"],
    ),
    (
        "spec-suite-beyond-model",
        lambda t: _study_spec(SPEC_HEAD + f'[eval]\nsuite = "{_suite(t, LONG_NEEDLES)}"\n'),
        ["eval.suite: suite 'suite'", "needles.0.lengths [1500]"],
    ),
    # ---- round 3 (the review of round 2): checkpoint headers at --check, config fields
    (
        "study-checkpoint-empty-weights",
        lambda t: _study_on_model(_damaged_checkpoint(t, "empty")),
        ["model: ", "model.safetensors: not a safetensors file (0 bytes"],
    ),
    (
        "study-checkpoint-missing-tensor",
        lambda t: _study_on_model(_damaged_checkpoint(t, "missing")),
        ["model: tensor model.layers.1.self_attn.k_proj.weight", "is missing"],
    ),
    (
        "study-checkpoint-wrong-shape",
        lambda t: _study_on_model(_damaged_checkpoint(t, "shape")),
        ["model.layers.0.mlp.down_proj.weight", "has shape [192, 100]", "expected [192, 512]"],
    ),
    (
        "config-kv-heads-zero",
        lambda t: _config_of(t, {"num_key_value_heads": 0}),
        ["config.json: num_key_value_heads must be an integer >= 1, got 0"],
    ),
    (
        "config-hidden-not-divisible-no-head-dim",
        lambda t: _config_of(t, {"hidden_size": 190}, drop=("head_dim",)),
        ["config.json: hidden_size 190 is not a multiple of num_attention_heads 6", "head_dim"],
    ),
    (
        "suite-gate-on-unmeasured-metric",
        lambda t: _load_suite(
            t,
            FIDELITY + '[[gates]]\nmetric = "fidelity.kl_meen"\ntolerance = 0.1\n'
            "higher_is_better = false\n",
        ),
        ["gates.0.metric: 'fidelity.kl_meen' is not a delta", "did you mean 'fidelity.kl_mean'"],
    ),
    (
        "suite-gate-on-length-not-measured",
        lambda t: _load_suite(
            t,
            FIDELITY + '[[gates]]\nmetric = "needle.acc_delta.len999"\ntolerance = 0.1\n'
            "higher_is_better = true\n",
        ),
        ["gates.0.metric: 'needle.acc_delta.len999'", "its deltas: fidelity.kl_mean"],
    ),
    (
        "suite-gate-direction-contradicts-metric",
        lambda t: _load_suite(
            t,
            FIDELITY + '[[gates]]\nmetric = "fidelity.kl_mean"\ntolerance = 0.1\n'
            "higher_is_better = true\n",
        ),
        ["gates.0", "higher_is_better = true contradicts fidelity.kl_mean", "set false"],
    ),
    (
        "suite-structured-no-tasks",
        lambda t: _load_suite(t, "[structured]\ntasks = []\n"),
        ["structured.tasks: needs at least one task"],
    ),
    (
        "suite-structured-task-twice",
        lambda t: _load_suite(t, '[structured]\ntasks = ["close_line", "close_line"]\n'),
        ["structured.tasks: names 'close_line' twice"],
    ),
    (
        "suite-two-needle-entries-same-key",
        lambda t: _load_suite(
            t,
            "[[needles]]\nlengths = [300]\nper_length = 2\n"
            "[[needles]]\nlengths = [128, 300]\nper_length = 4\n",
        ),
        ["needles.1: 'single' needles of length 300", "needles.0", "'needle.acc_delta.len300'"],
    ),
    (
        "spec-kl-maximized",
        lambda t: _parsed_spec(
            SPEC_HEAD + '[[objectives]]\nmetric = "tenants"\ndirection = "maximize"\n'
            '[[objectives]]\nmetric = "fidelity.kl_mean"\ndirection = "maximize"\n'
        ),
        ["objectives.1: 'fidelity.kl_mean' is better when lower", "direction = 'minimize'"],
    ),
    (
        "spec-acc-delta-minimized",
        lambda t: _parsed_spec(
            SPEC_HEAD + '[[objectives]]\nmetric = "needle.acc_delta.len1019"\n'
            'direction = "minimize"\n'
        ),
        ["objectives.0: 'needle.acc_delta.len1019' is better when higher", "'maximize'"],
    ),
    (
        "study-calibration-windows-beyond-model",
        lambda t: _calibration_study(t, None, extra="sequence_tokens = 100000\n"),
        ["calibration.sequence_tokens: 100000 exceeds", "max_position_embeddings of 1024"],
    ),
    (
        "study-calibration-data-empty",
        lambda t: _calibration_study(t, "empty.txt", ""),
        ["calibration.data: dataset", "empty.txt' holds no text"],
    ),
    (
        "study-calibration-data-folder",
        lambda t: _calibration_study(t, "texts.txt", None),
        ["calibration.data", "texts.txt' is a folder, not a file"],
    ),
    (
        "study-calibration-data-too-short",
        lambda t: _calibration_study(t, "short.txt", "a short text. " * 40),
        ["calibration.data: ", "short.txt has", "windows of 511 (+ BOS), 128 asked for"],
    ),
    (
        "study-suite-fidelity-source-missing",
        lambda t: _study_spec(
            SPEC_HEAD + f'[eval]\nsuite = "{_suite(t, FIDELITY + _source(t / "no.jsonl"))}"\n'
        ),
        ["eval.suite: suite 'suite': fidelity.source: dataset", "no.jsonl' does not exist"],
    ),
    (
        "study-tracking-sqlite-folder-missing",
        lambda t: _study_spec(SPEC_HEAD + f'[tracking]\nuri = "sqlite:///{t}/nodir/m.db"\n'),
        ["tracking.uri: the folder of", "nodir/m.db", "does not exist"],
    ),
    (
        "plan-bf16-layer-twice",
        lambda t: _plan_json(t, '{"kv": {"key_format": "int8", "bf16_layers": [0, 0]}}'),
        ["plan.json: kv.bf16_layers: layer 0 is already given in kv.bf16_layers"],
    ),
    (
        "plan-bf16-layer-and-its-alias",
        lambda t: _plan_on_model({"kv": {"key_format": "int8", "bf16_layers": [0, -4]}}),
        ["kv.bf16_layers: layer -4 is already given in kv.bf16_layers (as 0)"],
    ),
    (
        "plan-sinks-with-bf16-kv",
        lambda t: _plan_json(t, '{"kv": {"sink_tokens": 4}}'),
        ["kv: sink_tokens=4 with bf16 keys and values does nothing", "fingerprint"],
    ),
    (
        "plan-layer-format-naming-no-format",
        lambda t: _plan_json(t, '{"kv": {"key_format": "int8", "layer_formats": [{"layer": 1}]}}'),
        ["kv.layer_formats[0]: layer 1 names neither key_format nor value_format"],
    ),
    (
        "plan-mx-group-names-file-and-rule",
        lambda t: _plan_json(
            t, '{"rules": [{"pattern": ".*", "format": "mxfp4", "group_size": 64}]}'
        ),
        ["plan.json: plan rules[0] (pattern '.*'): mxfp4 fixes its block at 32", "not 64"],
    ),
    (
        "plan-unknown-axis-plural",
        lambda t: _plan_json(t, '{"kv": {"key_format": "int8", "key_axis": "row"}}'),
        ["kv.key_axis: unknown key axis 'row'; valid key axes: channel, token"],
    ),
]


@pytest.mark.parametrize(("build", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_hostile_input_is_one_line_naming_it(build, expected, tmp_path) -> None:
    call = build(tmp_path)
    with pytest.raises(ValueError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message, message
    for part in expected:
        assert part in message, message


# ------------------------------------------------------------------ commands a user runs
def _spec_file(tmp: Path, extra: str = "", head: str = SPEC_HEAD) -> str:
    (tmp / "spec.toml").write_text(head + extra)
    return "spec.toml"


def _profile_file(tmp: Path, tensor: str, kl: float) -> str:
    pq.write_table(
        pa.table({"tensor": [tensor], "format": ["int4"], "kl_mean": pa.array([kl], pa.float64())}),
        tmp / "p.parquet",
    )
    return "p.parquet"


MODEL = str(REF)

# (id, setup(tmp) -> argv, the text after "error: " on the one line of stderr)
CLI_CASES = [
    (
        "search-tenants-minimized",
        lambda t: [
            "search",
            _spec_file(t, '[[objectives]]\nmetric = "tenants"\ndirection = "minimize"\n'),
            "--check",
        ],
        "spec.toml: objectives.0: 'tenants' must be maximized",
    ),
    (
        "search-negative-tolerance",
        lambda t: [
            "search",
            _spec_file(t, '[[constraints]]\nmetric = "fidelity.kl_mean"\ntolerance = -0.5\n'),
            "--check",
        ],
        "spec.toml: constraints.0.tolerance: Input should be greater than or equal to 0 (got -0.5)",
    ),
    (
        "search-nan-tolerance",
        lambda t: [
            "search",
            _spec_file(t, '[[constraints]]\nmetric = "fidelity.kl_mean"\ntolerance = nan\n'),
            "--check",
        ],
        "spec.toml: constraints.0.tolerance: Input should be a finite number (got nan)",
    ),
    (
        "search-context-beyond-model",
        lambda t: ["search", _spec_file(t, head=SPEC_HEAD.replace("256", "4096")), "--check"],
        "deployment.context_tokens: 4096 exceeds the model's max_position_embeddings of 1024",
    ),
    (
        "search-memory-below-weights",
        lambda t: ["search", _spec_file(t, head=SPEC_HEAD.replace("10MiB", "1MiB")), "--check"],
        "deployment: no plan of the space fits a tenant of 256 tokens",
    ),
    (
        "search-nan-profile",
        lambda t: [
            "search",
            _spec_file(
                t,
                '[space]\nkind = "sensitivity"\n'
                f'profile = "{_profile_file(t, "embed", math.nan)}"\n',
            ),
            "--check",
        ],
        "sensitivity profile p.parquet: kl_mean of embed (int4) is nan",
    ),
    (
        "search-optuna-db-text",
        lambda t: [
            (t / "optuna.db").write_text("not a database") and "search",
            _spec_file(t),
            "--no-progress",
        ],
        "study.storage: optuna.db is not a SQLite database",
    ),
    (
        "search-resume-missing-store",
        lambda t: ["search", _spec_file(t), "--resume", "--no-progress"],
        "--resume: study.storage 'sqlite:///optuna.db' does not exist",
    ),
    (
        "search-resume-unknown-study",
        lambda t: [
            __import__("optuna").create_study(study_name="other", storage="sqlite:///optuna.db")
            and "search",
            _spec_file(t),
            "--resume",
            "--no-progress",
        ],
        "--resume: no study 's' in sqlite:///optuna.db; studies there: other",
    ),
    (
        "report-tracking-uri-not-a-db",
        lambda t: [
            (t / "m.db").write_bytes(b"\x00\x01binary") and "report",
            "--experiment",
            "x",
            "--tracking-uri",
            "sqlite:///m.db",
        ],
        "--tracking-uri: m.db is not a SQLite database",
    ),
    (
        "sensitivity-resamples-zero",
        lambda t: ["sensitivity", "--model", MODEL, "--format", "int4", "--resamples", "0"],
        "--resamples must be at least 100",
    ),
    (
        "eval-plan-layer-alias",
        lambda t: [
            (t / "plan.json").write_text(
                json.dumps(
                    {
                        "kv": {
                            "layer_formats": [
                                {"layer": 0, "key_format": "int4"},
                                {"layer": -4, "key_format": "int8"},
                            ]
                        }
                    }
                )
            )
            and "eval",
            "--plan",
            "plan.json",
        ],
        "plan file plan.json: kv.layer_formats: layer -4 is already given",
    ),
    (
        "eval-plan-duplicate-key",
        lambda t: [
            (t / "plan.json").write_text('{"kv": {}, "kv": {}}') and "eval",
            "--plan",
            "plan.json",
        ],
        "plan file plan.json: key 'kv' is given twice",
    ),
    (
        "eval-suite-no-task",
        lambda t: [(t / "s.toml").write_text("seed = 1\n") and "eval", "--suite", "s.toml"],
        "suite file s.toml: the suite has no task",
    ),
    (
        "eval-garbage-tokenizer",
        lambda t: ["eval", "--model", str(_garbage_tokenizer_model(t)), "--suite", "s.toml"],
        "ckpt/tokenizer.json: cannot be read as a tokenizer",
    ),
]


def _garbage_tokenizer_model(tmp: Path) -> Path:
    (tmp / "s.toml").write_text(FIDELITY)
    folder = _reference_copy(tmp)
    (folder / "tokenizer.json").write_text("garbage")
    return folder


@pytest.mark.parametrize(
    ("setup", "expected"), [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES]
)
def test_each_hostile_command_is_one_line_and_creates_nothing(
    setup, expected, tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = setup(tmp_path)
    capsys.readouterr()  # what the setup printed (Optuna's log of a study it created)
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith(f"tenantq {argv[0]}: error: ") and expected in err, err
    # No store, no report, no plans; an empty cache folder may be created once the command's
    # own inputs are checked (`cli._args.cache_folder`), as it is before any long work.
    after = sorted(p.name for p in tmp_path.iterdir() if p.name != ".tenantq-cache")
    assert after == before


# ------------------------------------------------------------------ warnings and exit codes
@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ('[sampler]\nkind = "tpe"\npopulation_size = 8\n',
         "sampler.population_size = 8 is ignored: only the 'nsga2' sampler has a population"),
        ('[space]\nprofile = "p.parquet"\n', "space.profile = 'p.parquet' is ignored"),
        ("[space]\nmax_keep_bf16 = 3\n", "space.max_keep_bf16 = 3 is ignored"),
        ('[space]\nkind = "per_tensor"\nuniform_weights = true\n',
         "space.uniform_weights = True is ignored: it applies to space.kind = 'structured'"),
        ("[sampler]\nkind = \"nsga2\"\npopulation_size = 50\n",
         "sampler.population_size = 50 is more than study.trials = 2"),
        ('[eval]\nsuite = "needle_count.toml"\n',
         "eval.suite: suite 'needle_count' needles.0.count = 8 is ignored: only multikey and "
         "multivalue needles have a count"),
    ],
)  # fmt: skip
def test_an_ignored_option_is_a_named_warning_and_the_spec_is_valid(
    extra, expected, tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "needle_count.toml").write_text(
        FIDELITY + "[[needles]]\nlengths = [128]\nper_length = 2\ncount = 8\n"
    )
    assert main(["search", _spec_file(tmp_path, extra), "--check"]) == 0
    captured = capsys.readouterr()
    assert captured.err == f"tenantq search: warning: {expected}" + captured.err.split(expected)[1]
    assert captured.err.count("\n") == 1 and "valid" in captured.out


def test_a_study_with_no_completed_trial_exits_non_zero(tmp_path, monkeypatch, capsys) -> None:
    # The driver's outcome when every trial failed (the failures themselves are the worker
    # tests' subject): the command must not report success.
    from tenantq.search import driver

    def run(self):
        return driver.StudyOutcome(
            study_name="s", storage="sqlite:///optuna.db",
            counts={"complete": 0, "failed": 2, "duplicates": 0, "retries": 0, "done": 2, "asks": 2},  # noqa: E501
            front=[], table="(empty front)",
        )  # fmt: skip

    monkeypatch.setattr(driver.SearchDriver, "run", run)
    monkeypatch.chdir(tmp_path)
    assert main(["search", _spec_file(tmp_path), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "tenantq search: no trial completed (2 failed)" in err
    monkeypatch.setattr(driver.SearchDriver, "run", lambda self: run(self))
    assert main(["search", _spec_file(tmp_path), "--no-progress", "--json"]) == 1


def test_a_tied_checkpoint_whose_head_is_the_embedding_loads(tmp_path) -> None:
    # Some exports save lm_head.weight beside a tied embedding: the same bytes are no conflict.
    from tenantq.model.loader import iter_checkpoint

    tensors = hand.hf_tensors()
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    header, data = hand.raw_file(tensors)
    hand.write_raw(tmp_path / "model.safetensors", header, data)
    (tmp_path / "config.json").write_text(json.dumps(hand.CONFIG | {"tie_word_embeddings": True}))
    config = ModelConfig.from_file(tmp_path / "config.json")
    paths = [path for path, _ in iter_checkpoint(tmp_path, config)]
    assert "lm_head" not in paths and "embed" in paths


def test_report_gives_the_real_reason_a_figure_is_absent() -> None:
    from types import SimpleNamespace

    from tenantq.report.figures import sensitivity_figure
    from tenantq.report.html import _why_no_pareto, _why_no_sensitivity

    # A capacity-only study completed its trials: its Pareto section used to say it had none.
    capacity_only = SimpleNamespace(completed=[SimpleNamespace(duplicate_of=None)])
    assert "no quality objective" in _why_no_pareto(capacity_only)
    assert _why_no_pareto(SimpleNamespace(completed=[])) == "no completed trial"
    # A profile with only whole-model rows draws nothing; it used to read "no profile".
    table = pa.table({"tensor": ["embed"], "format": ["int4"], "kl_mean": [0.1]})
    assert sensitivity_figure(table) is None
    assert _why_no_sensitivity(table).startswith("the profile has no per-layer rows")
    assert _why_no_sensitivity(None).startswith("no sensitivity profile")


def test_report_checks_a_profile_s_kv_rows_against_the_study_s_model(tmp_path) -> None:
    # The report used to draw kv/0..kv/31 of a 4-layer model without a word.
    from types import SimpleNamespace

    from tenantq.report.html import load_profile

    path = tmp_path / "p.parquet"
    rows = [f"kv/{i}" for i in range(32)]
    pq.write_table(pa.table({"tensor": rows, "format": ["int4"] * 32, "kl_mean": [0.1] * 32}), path)
    study = SimpleNamespace(spec_text='model = "reference"\n')
    with pytest.raises(ValueError, match=r"row 'kv/4' names no KV layer of the model \(4 layers\)"):
        load_profile(study, path)


def test_the_tables_hold_the_issue_s_sixty_cases() -> None:
    # Issue 24 asks for at least 60 new hostile-input cases (with tests/search/test_spec.py's
    # additions); ids name each case once.
    ids = [c[0] for c in CASES + CLI_CASES]
    assert len(ids) >= 60 and len(set(ids)) == len(ids)


def test_a_worker_that_dies_loading_is_one_line_naming_the_fault() -> None:
    # NaN weights need the data, so a worker finds them; Ray keeps only the text of the
    # creation task's error (a traceback), and the run's message is its last line.
    from ray.exceptions import ActorDiedError, RayTaskError

    from tenantq.workers.pool import _start_error

    fault = "tensor w (layers/0/mlp/down_proj) in model.safetensors holds 1 non-finite values"
    try:
        raise ValueError(fault)
    except ValueError as err:
        import traceback

        died = ActorDiedError(RayTaskError("HostWorker.__init__", traceback.format_exc(), err))
    assert "\n" in str(died)  # what the run printed before
    assert _start_error(died) == f"ValueError: {fault}"


def test_a_suite_file_starting_with_a_byte_order_mark_is_read(tmp_path) -> None:
    # Some editors save UTF-8 with a BOM; tomllib refuses it as "Invalid statement".
    from tenantq.evals.suite import load_suite

    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + FIDELITY.encode())
    assert load_suite(path).fidelity.rows == 2


def test_a_locked_optuna_store_is_refused_before_mlflow_s_is_created(
    tmp_path, monkeypatch, capsys
) -> None:
    # Another process's study holds the store's write lock: the run failed only after MLflow's
    # store was created. The check takes the lock and gives it back (bound: LOCK_WAIT_S).
    import sqlite3

    from tenantq.search import checks

    monkeypatch.setattr(checks, "LOCK_WAIT_S", 0.05)
    monkeypatch.chdir(tmp_path)
    holder = sqlite3.connect(tmp_path / "optuna.db", isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        code = main(["search", _spec_file(tmp_path), "--no-progress"])
    finally:
        holder.close()
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "study.storage: optuna.db is locked by another process" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optuna.db", "spec.toml"]


def test_a_layer_format_entry_inherits_the_plan_s_format_it_leaves_out() -> None:
    # An entry with only key_format used to make the values of that layer bf16 silently.
    from tenantq.quant.plan import QuantPlan

    plan = QuantPlan.from_dict(
        {"kv": {"key_format": "int8", "value_format": "fp8_e4m3",
                "layer_formats": [{"layer": 1, "key_format": "int4"}]}}
    )  # fmt: skip
    assert plan.kv.layer_formats == ((1, "int4", "fp8_e4m3"),)
    written = QuantPlan.from_dict(
        {"kv": {"key_format": "int8", "value_format": "fp8_e4m3",
                "layer_formats": [{"layer": 1, "key_format": "int4",
                                   "value_format": "fp8_e4m3"}]}}
    )  # fmt: skip
    assert plan.fingerprint() == written.fingerprint()


def test_a_dataset_of_unknown_suffix_is_named_once(tmp_path) -> None:
    # The suffix error was raised inside the reader's try and wrapped as "unreadable (...)",
    # so "expected 'reference-test' or ..." appeared twice in one line.
    from tenantq.evals.data import load_documents

    (tmp_path / "a.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError) as err:
        load_documents(str(tmp_path / "a.csv"))
    message = str(err.value)
    assert "unknown suffix '.csv'" in message and message.count("expected") == 1, message
