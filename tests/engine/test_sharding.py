"""Tensor parallelism (tenantq.engine.sharding).

Single-device parts (specs, per-shard quantization, errors) run here; the multi-device
parts run once in a subprocess with 4 forced CPU devices (`_sharding_check.py`), since
JAX fixes its device count at import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tenantq.engine.sharding import make_mesh, param_spec
from tenantq.model.config import ModelConfig
from tenantq.numerics import dequantize, quantize
from tenantq.quant.apply import quantize_per_shard
from tenantq.quant.plan import QuantPlan, TensorQuant
from tenantq.storage.tp import tp_split_axis as split_axis

CONFIG = ModelConfig(
    model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=8, num_kv_heads=4, head_dim=16, max_position_embeddings=64,
)  # fmt: skip
RNG = np.random.default_rng(0)
# Sharded and unsharded float32 logits differ only by the order of float32 sums (split
# contractions plus the all-reduce). A K-term float32 sum reordered moves by at most
# 2*gamma_K*sum|terms|, gamma_K = K*2^-24 (Higham 2002, sec. 3.1): ~1.5e-5 relative to
# sum|terms| for K = 128. Most logits agree to 1e-5, but this random model is
# ill-conditioned at some positions: there the unsharded engine moves by ~5e-5 when only
# the padding changes (`noise_floor`) and by ~4e-4 when every linear weight moves by one
# ulp (`ulp_weights`). Hence 1e-5 relative plus 1e-4 absolute, and sharding must move
# logits less than that one-ulp nudge of the weights does.
LOGITS_RTOL, LOGITS_ATOL = 1e-5, 1e-4


def how(fmt: str, path: str = "w", axis: int | None = 0, group: int | None = None):
    return TensorQuant(path, fmt, axis, group, True, "rtn", None)


# ---------------------------------------------------------------- single device


def test_split_axes_follow_the_megatron_layout():
    axes = {p: split_axis(p, CONFIG, 4) for p in CONFIG.tensors()}
    assert axes["embed"] == 0 and axes["lm_head"] == 1
    for name in ("attn/q_proj", "attn/k_proj", "attn/v_proj", "mlp/gate_proj", "mlp/up_proj"):
        assert axes[f"layers/1/{name}"] == 1  # output columns
    assert axes["layers/1/attn/o_proj"] == 0 and axes["layers/1/mlp/down_proj"] == 0  # rows
    assert axes["layers/1/input_norm"] is None and axes["final_norm"] is None
    # A vocabulary tp does not divide stays whole (NamedSharding needs even shards).
    odd = ModelConfig(**{**CONFIG.__dict__, "vocab_size": 130})
    assert split_axis("embed", odd, 4) is None


def test_qarray_specs_keep_data_and_scales_together():
    w = RNG.standard_normal((128, 64)).astype(np.float32)
    column = param_spec(
        "layers/0/attn/q_proj", quantize(w.T, "int4", axis=0, group_size=16), CONFIG, 4
    )
    assert (column.data, column.scale) == (P(None, "tp"), P(None, "tp"))  # packed along out
    rows = param_spec(
        "layers/0/mlp/down_proj", quantize(w, "int4", axis=0, group_size=16), CONFIG, 4
    )
    assert (rows.data, rows.scale) == (P("tp", None), P("tp", None))  # 8 groups, 2 per shard
    per_channel = param_spec("layers/0/mlp/down_proj", quantize(w, "int8", axis=0), CONFIG, 4)
    assert (per_channel.data, per_channel.scale) == (P("tp", None), P())  # scale [1, out]
    asym = param_spec(
        "layers/0/mlp/down_proj", quantize(w, "int4", axis=0, group_size=32, symmetric=False),
        CONFIG, 4,
    )  # fmt: skip
    assert asym.zero_point == asym.scale == P("tp", None)


def test_static_w8a8_weight_keeps_its_node_type_and_replicates_its_scale():
    # A StaticActQArray's spec must be the same pytree node (device_put takes the specs as a
    # tree prefix of the params), with its one activation scale replicated on every shard.
    from tenantq.model.layers import StaticActQArray

    w = RNG.standard_normal((64, 128)).astype(np.float32)
    value = StaticActQArray.wrap(quantize(w, "int8", axis=0), 0.5)
    spec = param_spec("layers/0/mlp/gate_proj", value, CONFIG, 4)
    assert isinstance(spec, StaticActQArray) and spec.act_scale == P()
    assert spec.data == P(None, "tp")  # column parallel, as the plain QArray
    paired = jax.tree.map(lambda v, s: s, value, spec, is_leaf=lambda x: isinstance(x, P))
    assert jax.tree.structure(paired) == jax.tree.structure(value)


def test_a_shard_that_would_split_a_packed_byte_is_refused():
    # int4 packs 2 elements per byte along the last axis: 12 columns over tp=4 is 3 a shard.
    w = RNG.standard_normal((64, 12)).astype(np.float32)
    packed = quantize(w, "int4", axis=0)
    with pytest.raises(ValueError, match="packs 2 elements per byte along axis 1; a shard of 3"):
        param_spec("layers/0/mlp/gate_proj", packed, CONFIG, 4)
    assert param_spec("layers/0/mlp/gate_proj", packed, CONFIG, 2).data == P(None, "tp")


def test_groups_straddling_shards_are_an_error_under_global_scales():
    w = RNG.standard_normal((128, 64)).astype(np.float32)
    q = quantize(w, "int4", axis=0, group_size=64)  # 2 groups, 4 shards of 32 rows
    with pytest.raises(ValueError, match="do not align.*dividing 32"):
        param_spec("layers/0/mlp/down_proj", q, CONFIG, 4)


def test_per_shard_quantization_is_each_slice_quantized_alone():
    w = RNG.standard_normal((128, 64)).astype(np.float32)
    cases = [  # (format, quant axis, group, split axis)
        ("int4", 0, 64, 0),  # one group per shard becomes groups of one shard (32)
        ("int8", 0, None, 0),  # per-channel over split rows: one scale per shard per column
        ("fp8_e4m3", None, None, 1),  # per-tensor: tp scales along the split axis
        ("fp8_e4m3", None, None, 0),
        ("mxfp4", 0, None, 1),
    ]
    for fmt, axis, group, split in cases:
        q = quantize_per_shard(w, how(fmt, axis=axis, group=group), split, 4)
        expected = np.concatenate(
            [
                np.asarray(dequantize(quantize(s, fmt, axis=axis, group_size=group)))
                for s in np.split(w, 4, axis=split)
            ],
            axis=split,
        )
        np.testing.assert_array_equal(np.asarray(dequantize(q)), expected, err_msg=fmt)
        param_spec("layers/0/mlp/down_proj" if split == 0 else "layers/0/mlp/up_proj", q, CONFIG, 4)
    per_tensor = quantize_per_shard(w, how("fp8_e4m3", axis=None), 1, 4)
    assert per_tensor.scale.shape == (1, 4) and per_tensor.nbytes == w.size + 4 * 4


def test_per_shard_refusals():
    w = RNG.standard_normal((64, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="nvfp4.*tensor scale"):
        quantize_per_shard(w, how("nvfp4"), 1, 4)
    with pytest.raises(ValueError, match="partial group"):
        quantize_per_shard(w, how("int4", group=24), 0, 2)  # shards of 32, groups of 24
    with pytest.raises(ValueError, match="split a packed byte"):
        quantize_per_shard(w[:, :6], how("int4", group=16), 1, 2)  # 3 columns per shard


def test_bad_tp_is_a_clear_error():
    with pytest.raises(ValueError, match="valid tp values are 1, 2, 4"):
        make_mesh(3, CONFIG)
    with pytest.raises(ValueError, match="valid tp values are 1, 2"):
        make_mesh(4, ModelConfig(**{**CONFIG.__dict__, "num_kv_heads": 2}))
    with pytest.raises(ValueError, match=r"sees \d+ cpu device"):
        make_mesh(len(jax.local_devices()) + 1)
    with pytest.raises(ValueError, match="positive integer"):
        make_mesh(0)


def test_engine_tp1_is_the_unsharded_engine(config, params):
    # The runner's hook on the one device this process has: a 1-device mesh changes nothing.
    from tenantq.engine import Engine

    tokens = [[1, 5, 9, 3], [7, 2]]
    options = dict(dtype="float32", max_seqs=2, max_seq_tokens=16)
    plain = Engine(config, params, **options)
    on_mesh = Engine(config, params, tp=1, scale_scope="shard", **options)
    assert on_mesh.mesh.shape == {"tp": 1}
    np.testing.assert_array_equal(on_mesh.logits(tokens), plain.logits(tokens))
    assert on_mesh.memory_report().total_bytes == plain.memory_report().total_bytes


def test_engine_shard_scope_takes_quantized_params(config, params):
    # Quantized params (a calibrator's, apply_plan's) are placed as they are under
    # scale_scope="shard" when their scales stay inside a shard: on one device every scale
    # does, and the engine equals the one that quantized the same params itself.
    from tenantq.engine import Engine
    from tenantq.quant.apply import apply_plan

    plan = QuantPlan.from_dict({"rules": [{"pattern": ".*", "format": "int4", "group_size": 16}]})
    options = dict(dtype="float32", max_seqs=2, max_seq_tokens=16)
    own = Engine(config, params, plan, tp=1, scale_scope="shard", **options)
    given = Engine(config, apply_plan(params, plan, config), plan, tp=1, scale_scope="shard",
                   **options)  # fmt: skip
    tokens = [[1, 5, 9, 3]]
    np.testing.assert_array_equal(given.logits(tokens), own.logits(tokens))


def test_shard_scope_refuses_a_scale_that_spans_shards():
    # tp=2 over CONFIG: o_proj splits its input rows (axis 0). One scale over the whole tensor,
    # or one per column over all rows, spans both shards: refused in one line naming the
    # tensor; the same tensor quantized per shard (or in groups inside a shard) passes.
    from tenantq.engine.sharding import check_shard_scales

    path = "layers/0/attn/o_proj"
    w = RNG.standard_normal((128, 64)).astype(np.float32)
    for axis, words in (
        (None, "one scale for the whole tensor"),
        (0, "groups of 128 along axis 0"),
    ):
        with pytest.raises(ValueError, match=f"{path} has {words}, which spans its 2 shards") as e:
            check_shard_scales({path: quantize(w, "int8", axis=axis)}, CONFIG, 2)
        assert "\n" not in str(e.value)
        per_shard = quantize_per_shard(w, how("int8", path, axis=axis), 0, 2)
        check_shard_scales({path: per_shard}, CONFIG, 2)
    grouped = quantize(w, "int4", axis=0, group_size=16)  # groups of 16 inside shards of 64
    check_shard_scales({path: grouped}, CONFIG, 2)
    # Groups of 64 divide the tensor's 128 rows and 2 shards of 64, not 4 shards of 32.
    halves = quantize(w, "int4", axis=0, group_size=64)
    check_shard_scales({path: halves}, CONFIG, 2)
    with pytest.raises(ValueError, match="groups of 64 along axis 0, which spans its 4 shards"):
        check_shard_scales({path: halves}, CONFIG, 4)
    check_shard_scales({path: quantize(w, "int8", axis=None)}, CONFIG, 1)  # one shard: fine


def test_shard_scope_refusal_names_the_way_that_works():
    # Scales with no per-shard form (quantize_per_shard refuses them: nvfp4's tensor scale,
    # the embedding's per-tensor scale, a static W8A8 weight over split rows) cannot be
    # "quantized per shard": the one-line refusal says scale_scope='global' instead. Scales
    # that have one keep the per-shard advice (and name 'global' as the other way).
    from tenantq.engine.sharding import check_shard_scales
    from tenantq.model.layers import StaticActQArray

    w = RNG.standard_normal((128, 64)).astype(np.float32)
    no_per_shard = {
        "layers/0/attn/q_proj": quantize(w.T, "nvfp4", axis=0, group_size=16),
        "embed": quantize(w, "int8", axis=None),
        "layers/0/attn/o_proj": StaticActQArray.wrap(quantize(w, "int8", axis=0), 0.02),
    }
    for path, q in no_per_shard.items():
        with pytest.raises(ValueError, match=f"{path}.*use scale_scope='global'") as e:
            check_shard_scales({path: q}, CONFIG, 2)
        assert "apply_plan with shard_axes" not in str(e.value), path
        assert "\n" not in str(e.value)
        with pytest.raises(ValueError):  # indeed no per-shard form
            quantize_per_shard(
                w.T if path.endswith("q_proj") else w,
                TensorQuant(path, q.fmt, q.axis, q.group_size, True, "rtn",
                            "int8" if isinstance(q, StaticActQArray) else None),
                split_axis(path, CONFIG, 2), 2,
            )  # fmt: skip
    with pytest.raises(
        ValueError, match="apply_plan with shard_axes and tp=2.*scale_scope='global'"
    ):
        check_shard_scales({"layers/0/attn/o_proj": quantize(w, "int8", axis=0)}, CONFIG, 2)


# ---------------------------------------------------------------- 4 CPU devices


@pytest.fixture(scope="module")
def check() -> dict:
    env = dict(os.environ)
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    script = Path(__file__).with_name("_sharding_check.py")
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4
    return result


@pytest.mark.slow
def test_sharded_logits_equal_unsharded(check):
    for case, d in check["parity"].items():
        if "/tp" not in case:
            continue  # noise_floor, ulp_weights: reference measurements, not sharded runs
        bound = LOGITS_ATOL + LOGITS_RTOL * d["max_ref"]
        assert d["max_abs"] <= bound, (case, d)
    ulp = check["parity"]["bf16/ulp_weights"]["max_abs"]
    assert check["parity"]["bf16/tp2"]["max_abs"] < ulp
    assert check["parity"]["bf16/tp4"]["max_abs"] < ulp
    assert {
        "bf16/tp2",
        "int8/tp4",
        "int4/tp2",
        "kv_fp8_int4/tp4",
        "kv_static/tp4",
        "bf16/tp4/decode",
    } <= set(check["parity"])


@pytest.mark.slow
def test_per_channel_scales_on_an_unsharded_axis_are_identical_either_way(check):
    for case, r in check["identical"].items():
        assert r["differing_qarrays"] == [], case
        assert r["logits_equal"], case


@pytest.mark.slow
def test_per_tensor_scales_per_shard_vs_global(check):
    r = check["per_tensor"]
    print("per-tensor fp8_e4m3 scales, per shard vs whole tensor (tp=4):", json.dumps(r))
    assert check["per_tensor_scale_shapes"] == {"global": "(1, 1)", "shard": "(1, 4)"}
    assert all(np.isfinite(v) for k, v in r.items() if k != "bound_ratio")
    # Each scheme's dequantized weights within e4m3 rounding of its own scales:
    # |w - w^| <= 2^-4 |w| + 2^-10 s (half an ulp of 3 mantissa bits; half the subnormal step).
    assert max(r["bound_ratio"].values()) <= 1.0
    # KL(p || q) = E_p[d] + log E_p[e^-d] for logits differing by d, <= range(d)^2 / 8 by
    # Hoeffding's lemma, and range(d) <= 2 max|d|: per token KL <= max|d|^2 / 2. The two
    # schemes' scales differ, so their logits must too (KL > 0).
    assert 0 < r["kl_global_shard_max"] <= r["max_abs_dlogits"] ** 2 / 2
    for scope in ("global", "shard"):
        assert r[f"kl_full_{scope}_mean"] <= r[f"max_abs_dlogits_full_{scope}"] ** 2 / 2


@pytest.mark.slow
def test_params_and_cache_state_are_sharded(check):
    specs = check["specs"]
    assert specs["layers/0/attn/q_proj"] == {"data": "P(None, 'tp')", "scale": "P(None, 'tp')"}
    assert specs["layers/0/mlp/down_proj"] == {"data": "P('tp', None)", "scale": "P('tp', None)"}
    assert specs["embed"]["data"] == "P('tp', None)" and specs["lm_head"]["data"] == "P(None, 'tp')"
    assert specs["layers/0/input_norm"] == {"value": "P()"}
    # Every pool array (pages, scales, residual, sinks) split on its KV-head axis, index 2.
    arrays = check["cache_arrays"]
    # The plan's pool holds several kinds of arrays: quantized pages (uint8: fp8 bits, packed
    # int4), float32 scales and float32 residual windows (a float32 engine's unquantized KV).
    assert {a["dtype"] for a in arrays} >= {"uint8", "float32"}, arrays
    assert len({tuple(a["shape"]) for a in arrays}) >= 3, arrays  # pages, scales, residual
    assert all(a["head_sharded"] for a in arrays), arrays
    assert all(a["head_sharded"] for a in check["cache_arrays_after_decode"])


@pytest.mark.slow
def test_memory_report_stays_logical_and_devices_split_it(check):
    totals = check["memory_total"]
    assert totals["tp4"] == totals["unsharded"]
    per_device = check["device_bytes"]
    assert len(per_device) == 4 and max(per_device) < totals["tp4"]


@pytest.mark.slow
def test_bad_tp_errors_on_four_devices(check):
    assert "valid tp values are 1, 2, 4" in check["errors"]["tp3"]
    assert "sees 4 cpu device(s)" in check["errors"]["tp8"]


@pytest.mark.slow
def test_from_checkpoint_with_tp_matches_in_memory_params(check):
    assert check["from_checkpoint_equal"] == {"global": True, "shard": True}


@pytest.mark.slow
def test_capacity_equals_what_each_of_four_devices_holds(check):
    # DESIGN: "capacity is arithmetic and must equal the engine's real allocation". At tp=4,
    # every device holds exactly the planner's per-chip bytes, per weight tensor (shard
    # shapes, scales, packing, nvfp4 tensor scales, replicated norms and an odd vocabulary)
    # and per KV layer (pages sharded by KV head, per-page tensor scales replicated, residual
    # windows and sinks per slot): 4 equal figures, each equal to the planner's.
    import dataclasses

    from tenantq.capacity.kv import kv_pool_bytes
    from tenantq.capacity.weights import tensor_bytes
    from tenantq.quant.plan import QuantPlan

    sys.path.insert(0, str(Path(__file__).parent))
    from _sharding_check import CAPACITY_PLANS, CAPACITY_POOL

    assert len(check["capacity_tp4"]) == 6
    for case, held in check["capacity_tp4"].items():
        name, vocab = case.split("/vocab")
        config = dataclasses.replace(CONFIG, vocab_size=int(vocab))
        plan = QuantPlan.from_dict(CAPACITY_PLANS[name])
        planned = {t.path: t.bytes_per_chip for t in tensor_bytes(config, plan, tp=4)}
        assert set(held["weights"]) == set(planned), case
        for path, per_device in held["weights"].items():
            assert per_device == [planned[path]] * 4, (case, path)
        kv = kv_pool_bytes(
            config, plan, held["num_pages"], CAPACITY_POOL["max_seqs"],
            CAPACITY_POOL["page_tokens"], tp=4,
        )  # fmt: skip
        assert held["num_pages"] == CAPACITY_POOL["num_pages"]
        for layer, (per_device, row) in enumerate(zip(held["kv"], kv["layers"], strict=True)):
            assert per_device == [row["total_bytes"]] * 4, (case, layer)
        if int(vocab) % 4:  # replicated whole: every device holds the whole embedding
            assert planned["embed"] == tensor_bytes(config, plan, tp=1)[0].bytes_per_chip


@pytest.mark.slow
def test_quantized_params_under_shard_scope_are_placed_or_refused(check):
    # Scales inside a shard: placed as they are, logits within test_sharded_logits_equal_
    # unsharded's bound of the unsharded engine on the same params. A scale over all rows
    # (int8 per channel on o_proj/down_proj) or nvfp4's tensor scale: one line, no engine.
    given = check["given_quantized"]
    assert set(given["parity"]) == {"int4_g16_asym", "fp8_per_shard"}
    for case, d in given["parity"].items():
        assert d["max_abs"] <= LOGITS_ATOL + LOGITS_RTOL * d["max_ref"], (case, d)
    for case, message in given["refused"].items():
        assert message is not None and message.startswith("scale_scope='shard': "), case
        assert "spans its 4 shards" in message and "\n" not in message, case
    assert "use scale_scope='global'" in given["refused"]["nvfp4"]
