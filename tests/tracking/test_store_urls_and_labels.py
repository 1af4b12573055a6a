"""The tracking checks and labels that need no store: which URLs MLflow can track to, what a
sqlite URL's file must be, where a sqlite store keeps its artifacts, and the plan labels
(`flatten_plan`) for mixes, absent classes and repeated configs.

The schemes and sqlite URL forms are MLflow's and SQLAlchemy's (a file path after
`sqlite:///`, `:memory:` or nothing for an in-memory database); the 16-byte header is
SQLite's file format (sqlite.org/fileformat.html, 1.3.1).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tenantq.capacity import get_model_config
from tenantq.quant.plan import KVPlan, QuantPlan, Rule
from tenantq.tracking import check_sqlite_file, check_tracking_uri, flatten
from tenantq.tracking.flatten import flatten_plan
from tenantq.tracking.runs import SQLITE_MAGIC, _artifacts_beside, sqlite_file

CONFIG = get_model_config("tenantq-ref")


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("sqlite:///rel/m.db", Path("rel/m.db")),
        ("sqlite:////abs/m.db", Path("/abs/m.db")),
        ("sqlite:///~/m.db", Path("~/m.db").expanduser()),
        ("sqlite://", None),  # in memory
        ("sqlite:///", None),  # no file named
        ("sqlite:///:memory:", None),
        ("postgresql://h/db", None),
        ("mlruns", None),
        ("sqlite:///a.db?x=1", Path("a.db")),
    ],
)
def test_a_sqlite_urls_file_is_the_path_after_the_three_slashes(url, expected):
    assert sqlite_file(url) == expected


def test_a_malformed_sqlite_url_names_no_file():
    assert sqlite_file("sqlite:bad") is None  # left to the URL checks to name


def test_a_sqlite_file_that_is_missing_empty_or_a_database_passes(tmp_path):
    check_sqlite_file(f"sqlite:///{tmp_path}/missing.db", "k")
    (tmp_path / "empty.db").write_bytes(b"")
    check_sqlite_file(f"sqlite:///{tmp_path}/empty.db", "k")
    (tmp_path / "real.db").write_bytes(SQLITE_MAGIC + b"\x10\x00" * 10)
    check_sqlite_file(f"sqlite:///{tmp_path}/real.db", "k")
    assert SQLITE_MAGIC == b"SQLite format 3\x00"


def test_a_folder_at_a_sqlite_path_is_named_with_its_key(tmp_path):
    with pytest.raises(ValueError) as err:
        check_sqlite_file(f"sqlite:///{tmp_path}", "tracking.uri")
    assert str(err.value) == (
        f"tracking.uri: {tmp_path} is a folder; give a sqlite:/// path to a database file"
    )


def test_a_file_that_is_not_sqlite_is_named_with_its_first_bytes(tmp_path):
    (tmp_path / "notes.db").write_bytes(b"hello world, not a database")
    with pytest.raises(ValueError) as err:
        check_sqlite_file(f"sqlite:///{tmp_path}/notes.db", "study.storage")
    assert str(err.value) == (
        f"study.storage: {tmp_path}/notes.db is not a SQLite database (it starts with "
        "b'hello wo'); move it away, or point the URL at another file"
    )
    # one byte short of the header is not the header
    (tmp_path / "short.db").write_bytes(SQLITE_MAGIC[:-1])
    with pytest.raises(ValueError, match="is not a SQLite database"):
        check_sqlite_file(f"sqlite:///{tmp_path}/short.db", "k")


def test_an_unreadable_sqlite_file_is_named(tmp_path, monkeypatch):
    (tmp_path / "locked.db").write_bytes(SQLITE_MAGIC)

    def refuse(self, *a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "open", refuse)
    with pytest.raises(ValueError) as err:
        check_sqlite_file(f"sqlite:///{tmp_path}/locked.db", "k")
    assert str(err.value) == f"k: cannot read {tmp_path}/locked.db (Permission denied)"


@pytest.mark.parametrize("uri", ["sqlite:///m.db", "http://h:5000", "https://h", "mlruns"])
def test_uris_mlflow_tracks_to_pass(uri):
    check_tracking_uri(uri)


def test_an_unknown_scheme_is_one_line_naming_the_key_and_what_would_do():
    with pytest.raises(ValueError) as err:
        check_tracking_uri("ftp://host/x", "tracking.uri")
    assert str(err.value) == (
        "tracking.uri: MLflow cannot track to 'ftp://host/x' (scheme 'ftp'); write "
        "sqlite:///mlflow.db, a folder, or http://HOST:PORT of an MLflow server"
    )
    with pytest.raises(ValueError, match=r"^tracking\.uri: MLflow cannot track"):
        check_tracking_uri("ftp://host/x")  # the default key
    with pytest.raises(ValueError, match=r"\(scheme 'ftp'\)"):  # the part before the first ":"
        check_tracking_uri("ftp://host:21/x", "k")


def test_the_sqlite_check_runs_before_the_scheme_check(tmp_path):
    with pytest.raises(ValueError, match=r"^spec\.tracking: .* is a folder"):
        check_tracking_uri(f"sqlite:///{tmp_path}", "spec.tracking")


def test_artifacts_of_a_sqlite_store_go_to_a_fresh_folder_beside_the_database(tmp_path):
    first = _artifacts_beside(f"sqlite:///{tmp_path}/m.db")
    second = _artifacts_beside(f"sqlite:///{tmp_path}/m.db")
    root = (tmp_path / "mlruns").as_uri() + "/"
    assert first.startswith(root) and second.startswith(root) and first != second
    assert len(first) == len(root) + 32  # one uuid4 hex folder per experiment
    assert _artifacts_beside("http://h:5000") is None
    assert _artifacts_beside("sqlite://") is None


def test_a_class_the_model_lacks_is_absent():
    # a config with one layer fewer and no lm_head of its own (tied to the embedding)
    tied = dataclasses.replace(CONFIG, tie_word_embeddings=True, name="tied")
    flat = flatten_plan(QuantPlan.uniform("int8", "bf16"), tied)
    has_head = "lm_head" in {p for p, i in tied.tensors().items() if i.quantizable}
    assert flat["weights.lm_head"] == ("int8" if has_head else "absent")
    assert flat["weights.embed"] != "absent"


def test_a_mix_is_listed_by_label_with_counts_in_label_order():
    plan = QuantPlan(
        rules=(
            Rule("layers/0/.*", "bf16"),
            Rule(r"layers/1/attn/.*", "int8", group_size=32),
            Rule(r"layers/\d+/attn/.*", "int4", group_size=64),
        ),
        kv=KVPlan(key_format="int8", key_axis="channel", value_format="int4", value_axis="token",
                  sink_tokens=2, bf16_layers=(1,)),
    )  # fmt: skip
    flat = flatten_plan(plan, CONFIG)
    assert flat["weights.attn_qkv"] == "bf16 x3, int4/g64 x6, int8/g32 x3"
    assert flat["weights.attn_o"] == "bf16 x1, int4/g64 x2, int8/g32 x1"
    assert flat["weights.mlp_gate_up"] == "bf16"
    assert flat["kv.key_format"] == "int8" and flat["kv.key_axis"] == "channel"
    assert flat["kv.value_format"] == "int4" and flat["kv.value_axis"] == "token"
    assert flat["kv.sink_tokens"] == "2" and flat["kv.bf16_layers"] == "1"
    assert flat["kv.scale_dtype"] == plan.kv.scale_dtype
    assert flat["plan.rules"] == "3"
    assert sorted(flat) == sorted(
        [f"weights.{c}" for c in flatten.PARAM_CLASSES]
        + ["kv.key_format", "kv.key_axis", "kv.value_format", "kv.value_axis",
           "kv.sink_tokens", "kv.bf16_layers", "kv.scale_dtype", "plan.rules", "plan.fingerprint"]
    )  # fmt: skip


def test_each_tensor_class_holds_exactly_its_paths():
    members = flatten._class_members(CONFIG)
    assert members["attn_qkv"] == [
        f"layers/{i}/attn/{x}_proj" for i in range(4) for x in ("q", "k", "v")
    ]
    assert members["attn_o"] == [f"layers/{i}/attn/o_proj" for i in range(4)]
    assert members["mlp_gate_up"] == [
        f"layers/{i}/mlp/{x}_proj" for i in range(4) for x in ("gate", "up")
    ]
    assert members["mlp_down"] == [f"layers/{i}/mlp/down_proj" for i in range(4)]
    assert members["embed"] == ["embed"] and members["lm_head"] == ["lm_head"]


def test_class_members_are_kept_for_at_most_eight_configs(monkeypatch):
    monkeypatch.setattr(flatten, "_MEMBERS", {})
    configs = [dataclasses.replace(CONFIG, name=f"c{i}") for i in range(9)]
    for c in configs:
        assert flatten._class_members(c)["embed"] == ["embed"]
        assert len(flatten._MEMBERS) <= 8
    assert id(configs[-1]) in flatten._MEMBERS
    # the same object is served from the cache; another object at a reused id is not
    held = flatten._class_members(configs[-1])
    assert flatten._class_members(configs[-1]) is held
    smaller = dataclasses.replace(CONFIG, num_layers=1, layer_types=("full",), name="one")
    flatten._MEMBERS[id(smaller)] = (CONFIG, {"stale": []})
    assert flatten._class_members(smaller)["attn_o"] == ["layers/0/attn/o_proj"]


def test_the_kv_bf16_layers_list_is_comma_joined():
    flat = flatten_plan(QuantPlan(kv=KVPlan(key_format="int8", bf16_layers=(0, 2, -1))), CONFIG)
    assert flat["kv.bf16_layers"] == "0,2,-1"
