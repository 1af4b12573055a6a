"""What the export refuses, how it says so, and that a failure leaves nothing behind.

No torch here: these run on the base install.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from _ct import write_folder

from tenantq.cli import main
from tenantq.export import NotExportable, export_checkpoint, export_command, export_problems
from tenantq.export.writer import pack_int32
from tenantq.model.compressed import unpack_int32
from tenantq.model.loader import hf_names
from tenantq.quant.plan import QuantPlan
from tenantq.testing import tiny_config, tiny_params

INT8_MLP = {"rules": [{"pattern": "layers/.*/mlp/.*", "format": "int8"}], "kv": {}}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    config = tiny_config()
    return write_folder(tmp_path_factory.mktemp("src") / "m", config, tiny_params(config))


@pytest.mark.parametrize(
    ("plan", "named"),
    [
        ({"rules": [{"pattern": "lm_head", "format": "nvfp4"}]}, "lm_head: nvfp4"),
        ({"rules": [{"pattern": "lm_head", "format": "mxfp4"}]}, "lm_head: mxfp4"),
        ({"rules": [{"pattern": "lm_head", "format": "fp8_e5m2"}]}, "lm_head: fp8_e5m2"),
        ({"rules": [{"pattern": "embed", "format": "int8"}]}, "embed: int8"),
        # hidden 32: a group of 24 leaves a partial group
        ({"rules": [{"pattern": "layers/0/attn/q_proj", "format": "int4", "group_size": 24}]},
         "group_size 24 does not divide"),
        ({"rules": [{"pattern": "layers/0/mlp/up_proj", "format": "int4", "group_size": 8,
                     "symmetric": False}]}, "asymmetric int4"),
        # vLLM's ParallelLMHead has no compressed-tensors method
        ({"rules": [{"pattern": "lm_head", "format": "int8"}]}, "quantized lm_head does not load"),
        # vLLM's fp8 schemes: tensor, channel or block scales
        ({"rules": [{"pattern": "layers/0/attn/q_proj", "format": "fp8_e4m3", "group_size": 8}]},
         "fp8 weights with group_size"),
        ({"kv": {"key_format": "int2", "value_format": "int2"}}, "kv layer 0: keys int2"),
        ({"kv": {"key_format": "fp8_e4m3", "key_axis": "tensor", "value_format": "fp8_e4m3",
                 "value_axis": "tensor", "sink_tokens": 4}}, "kv.sink_tokens = 4"),
        ({"kv": {"key_format": "fp8_e4m3", "value_format": "fp8_e4m3"}}, "kv.key_axis 'channel'"),
        ({"kv": {"key_format": "fp8_e4m3", "key_axis": "tensor", "value_format": "fp8_e4m3",
                 "value_axis": "tensor", "bf16_layers": [0]}}, "kv layer 0: keys bf16"),
    ],
)  # fmt: skip
def test_unexpressible_plan_part_is_one_line_naming_it(source, tmp_path, plan, named):
    plan = QuantPlan.from_dict({"rules": [], "kv": {}, **plan})
    problems = export_problems(plan, tiny_config())
    assert problems and any(named in p for p in problems), problems
    with pytest.raises(NotExportable) as err:
        export_checkpoint(source, plan, tmp_path / "out")
    assert named in str(err.value) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary folder


def test_opt_ins_write_the_rest_and_record_each_choice(source, tmp_path, caplog):
    plan = QuantPlan.from_dict(
        {"rules": [{"pattern": "lm_head", "format": "nvfp4"},
                   {"pattern": "layers/.*/mlp/.*", "format": "int8"}],
         "kv": {"key_format": "int4", "value_format": "int4"}}
    )  # fmt: skip
    out = tmp_path / "out"
    with caplog.at_level("WARNING", logger="tenantq.export.writer"):
        result = export_checkpoint(source, plan, out, dequantize_unsupported=True, kv_bf16=True)
    assert result.dequantized == ["lm_head"] and result.kv_cache_scheme is None
    assert len(result.quantized) == 6  # 2 layers x 3 MLP projections
    provenance = json.loads((out / "tenantq_export.json").read_text())
    assert provenance["choices"] == result.choices and len(result.choices) == 2
    umask = os.umask(0)
    os.umask(umask)  # the folder is as readable as a plain mkdir would make it
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask
    assert ((out / "model.safetensors").stat().st_mode & 0o777) == 0o666 & ~umask
    assert all(c in caplog.text for c in result.choices)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["kv_cache_scheme"] is None


def test_failure_while_writing_leaves_nothing(source, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.numpy.save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        export_checkpoint(source, QuantPlan.from_dict(INT8_MLP), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_existing_out_is_kept_unless_overwrite(source, tmp_path):
    out = tmp_path / "out"
    plan = QuantPlan.from_dict(INT8_MLP)
    export_checkpoint(source, plan, out)
    (out / "keep").write_text("x")
    with pytest.raises(ValueError, match="already exists"):
        export_checkpoint(source, plan, out)
    assert (out / "keep").is_file()
    (tmp_path / ".out.old").mkdir()  # left by a crash of an earlier overwrite
    (tmp_path / ".out.old" / "x").write_text("x")
    export_checkpoint(source, plan, out, overwrite=True)
    assert not (out / "keep").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.old", "out"]


def test_overwrite_replaces_only_a_tenantq_export(source, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(ValueError, match="has no tenantq_export.json") as err:
        export_checkpoint(source, QuantPlan.from_dict(INT8_MLP), out, overwrite=True)
    assert "\n" not in str(err.value) and (out / "keep").is_file()


@pytest.mark.parametrize(
    ("where", "relation"),
    [(lambda m: m, "is the source"), (lambda m: m.parent, "contains the source"),
     (lambda m: m / "sub", "is inside the source")],
)  # fmt: skip
def test_out_on_the_source_model_is_refused_even_with_overwrite(tmp_path, where, relation):
    """--out equal to, above or inside --model would delete the model on --overwrite."""
    config = tiny_config()
    model = write_folder(tmp_path / "a" / "model", config, tiny_params(config))
    (model / "tenantq_export.json").write_text("{}")  # even a model that is an export
    (model.parent / "tenantq_export.json").write_text("{}")
    before = sorted(p.name for p in model.iterdir())
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=relation) as err:
            export_checkpoint(
                model, QuantPlan.from_dict(INT8_MLP), where(model), overwrite=overwrite
            )
        assert "\n" not in str(err.value)
    assert sorted(p.name for p in model.iterdir()) == before
    assert sorted(p.name for p in model.parent.iterdir()) == ["model", "tenantq_export.json"]


def test_static_kv_without_scales_is_refused_by_name(source, tmp_path):
    plan = QuantPlan.uniform("bf16", "fp8_e4m3")  # static per-tensor fp8 KV
    with pytest.raises(ValueError, match="needs calibrated static scales"):
        export_checkpoint(source, plan, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bits", [4, 8])
def test_int32_packing_round_trips_and_matches_the_layout(bits):
    """Element i sits at bit i*bits of little-endian int32 words, offset by 2^(bits-1)
    (compressed-tensors' pack_to_int32); unpacking gives the codes back."""
    rng = np.random.default_rng(bits)
    low = -(1 << (bits - 1))
    codes = rng.integers(low, -low, size=(3, 37), dtype=np.int8)
    packed = pack_int32(codes, bits)
    assert packed.shape == (3, -(-37 * bits // 32)) and packed.dtype == np.int32
    np.testing.assert_array_equal(unpack_int32(packed, bits, 37), codes)
    word = int(np.uint32(packed.view(np.uint32)[1, 0]))
    per_word = 32 // bits
    expect = sum((int(c) - low) << (bits * i) for i, c in enumerate(codes[1, :per_word]))
    assert word == expect


def test_cli_exports_and_refuses_in_one_line(source, tmp_path, capsys):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(INT8_MLP))
    out = tmp_path / "out"
    args = ["export", "--model", str(source), "--plan", str(plan_file), "--out", str(out)]
    assert main([*args, "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["quantized"]) == 6
    assert main(args) == 2  # exists
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "already exists" in err

    plan_file.write_text(json.dumps({"rules": [{"pattern": "lm_head", "format": "nvfp4"}]}))
    assert main([*args[:-1], str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "lm_head: nvfp4" in err and "--dequantize-unsupported" in err
    assert not (tmp_path / "other").exists()


def test_export_command_quotes_its_paths():
    command = export_command("models/my model", "plans/a.json", "out dir")
    assert command == "tenantq export --model 'models/my model' --plan plans/a.json --out 'out dir'"


def test_stream_refuses_calibrated_algorithms_by_name(source, tmp_path):
    plan = QuantPlan.from_dict({"rules": [{"pattern": "layers/0/mlp/up_proj", "format": "int8",
                                           "algorithm": "gptq"}]})  # fmt: skip
    with pytest.raises(ValueError, match="layers/0/mlp/up_proj: gptq needs calibration"):
        export_checkpoint(source, plan, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_cli_reads_a_trial_plan_from_mlflow(source, tmp_path, capsys):
    """The report's export command names the trial's plan.json in MLflow (real sqlite store)."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())
    run = client.create_run(experiment)
    (tmp_path / "plan.json").write_text(json.dumps(INT8_MLP))
    client.log_artifact(run.info.run_id, str(tmp_path / "plan.json"))
    out = tmp_path / "out"
    plan_uri = f"runs:/{run.info.run_id}/plan.json"
    args = ["export", "--model", str(source), "--plan", plan_uri, "--tracking-uri", uri]
    assert main([*args, "--out", str(out), "--json", "--log-mlflow"]) == 0
    assert len(json.loads(capsys.readouterr().out)["quantized"]) == 6
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "export")}
    assert logged == {"export/config.json", "export/tenantq_export.json"}
    assert client.get_run(run.info.run_id).data.tags["tenantq.export"] == str(out.resolve())
    missing = ["export", "--model", str(source), "--plan", "runs:/0123abcd/plan.json"]
    assert main([*missing, "--tracking-uri", uri, "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--plan runs:/0123abcd/plan.json" in err


def test_report_front_row_carries_the_export_command():
    from types import SimpleNamespace

    from tenantq.report.figures import export_command as report_command

    study = SimpleNamespace(params={"model.path": "/m/llama"}, tracking_uri="sqlite:///x.db")
    trial = SimpleNamespace(run_id="abc123", fingerprint="f00d")
    assert report_command(study, trial) == (
        "tenantq export --model /m/llama --plan runs:/abc123/plan.json "
        "--tracking-uri sqlite:///x.db --out export-f00d"
    )


def test_front_export_writes_the_exportable_and_names_the_rest(source, tmp_path):
    from tenantq.export import export_plans

    front = {
        "trial-3": QuantPlan.from_dict(INT8_MLP),
        "trial-7": QuantPlan.from_dict({"rules": [{"pattern": "lm_head", "format": "nvfp4"}]}),
    }
    results = export_plans(source, front, tmp_path / "front")
    assert (tmp_path / "front" / "trial-3" / "model.safetensors").is_file()
    assert isinstance(results["trial-7"], str) and "lm_head: nvfp4" in results["trial-7"]
    assert sorted(p.name for p in (tmp_path / "front").iterdir()) == ["trial-3"]


def test_fused_projections_in_different_formats_are_warned(source, tmp_path, caplog):
    plan = QuantPlan.from_dict(
        {"rules": [{"pattern": "layers/0/attn/q_proj", "format": "int4", "group_size": 16},
                   {"pattern": "layers/.*/attn/.*", "format": "int8"}]}
    )  # fmt: skip
    with caplog.at_level("WARNING", logger="tenantq.export.writer"):
        export_checkpoint(source, plan, tmp_path / "out")
    assert "layers/0: q_proj/k_proj/v_proj differ in format" in caplog.text
    assert "layers/1" not in caplog.text  # one rule for all three: nothing to say


def test_lm_head_quantized_only_by_opt_in_which_names_vllm(source, tmp_path, caplog):
    plan = QuantPlan.from_dict({"rules": [{"pattern": "lm_head", "format": "int8"}]})
    with caplog.at_level("WARNING", logger="tenantq.export.writer"):
        result = export_checkpoint(source, plan, tmp_path / "out", quantize_lm_head=True)
    assert result.quantized == {"lm_head": "int8"}
    assert len(result.choices) == 1 and "vLLM" in result.choices[0] and "vLLM" in caplog.text
    provenance = json.loads((tmp_path / "out" / "tenantq_export.json").read_text())
    assert provenance["choices"] == result.choices


def test_ignore_lists_every_unquantized_linear(source, tmp_path):
    """llm-compressor names each Linear it leaves unquantized (lm_head included) in
    `ignore`; a reader matching targets by class must not take them as quantized."""
    export_checkpoint(source, QuantPlan.from_dict(INT8_MLP), tmp_path / "out")
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    attn = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"]
    assert sorted(qc["ignore"]) == sorted([*attn, "lm_head"])
    quantized = {m for g in qc["config_groups"].values() for m in g["targets"]}
    assert len(quantized) == 6 and not quantized & set(qc["ignore"])


def test_plan_without_quantized_weights_is_dense(source, tmp_path):
    """compressed-tensors' own summary of a model without quantized weights is "dense"."""
    export_checkpoint(source, QuantPlan.from_dict({"rules": [], "kv": {}}), tmp_path / "out")
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "dense" and qc["config_groups"] == {}


def test_every_side_file_is_copied_and_a_missing_tokenizer_warned(tmp_path, caplog):
    config = tiny_config()
    model = write_folder(tmp_path / "model", config, tiny_params(config))
    side = ["tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
            "chat_template.json", "special_tokens_map.json", "tokenizer_config.json"]  # fmt: skip
    for name in side:
        (model / name).write_text("{}")
    index = {"weight_map": {hf: "model.safetensors" for hf, _ in hf_names(config).values()}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))  # not copied
    export_checkpoint(model, QuantPlan.from_dict(INT8_MLP), tmp_path / "out")
    got = sorted(p.name for p in (tmp_path / "out").iterdir())
    want = [*side, "config.json", "generation_config.json", "model.safetensors"]
    assert got == sorted([*want, "tenantq_export.json"])

    bare = write_folder(tmp_path / "bare", config, tiny_params(config))
    with caplog.at_level("WARNING", logger="tenantq.export.writer"):
        export_checkpoint(bare, QuantPlan.from_dict(INT8_MLP), tmp_path / "out2")
    assert "has no tokenizer file" in caplog.text


def test_cli_os_error_is_one_line_naming_the_path(source, tmp_path, capsys, monkeypatch):
    def full(tensors, filename, metadata=None):
        raise OSError(28, "No space left on device", filename)

    monkeypatch.setattr("safetensors.numpy.save_file", full)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(INT8_MLP))
    args = ["export", "--model", str(source), "--plan", str(plan_file)]
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "No space left on device" in err and "model.safetensors" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_overwrite_failing_at_the_swap_keeps_the_earlier_export(source, tmp_path, monkeypatch):
    out = tmp_path / "out"
    export_checkpoint(source, QuantPlan.from_dict(INT8_MLP), out)
    (out / "mark").write_text("earlier")
    rename = os.rename

    def failing(src, dst):
        if str(src).endswith(".tmp"):  # the new folder's move into place
            raise OSError(5, "Input/output error", str(src))
        rename(src, dst)

    monkeypatch.setattr("tenantq.export.writer.os.rename", failing)
    with pytest.raises(OSError, match="Input/output error"):
        export_checkpoint(source, QuantPlan.from_dict(INT8_MLP), out, overwrite=True)
    assert (out / "mark").read_text() == "earlier"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no .old, no .tmp left
