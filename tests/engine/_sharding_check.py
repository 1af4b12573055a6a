"""Multi-device checks of tensor parallelism, run by test_sharding.py in a subprocess.

JAX fixes its device count at import, so this runs with
XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu and prints one JSON
object of measurements on its last line; the test asserts on it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np

from tenantq.engine import Engine
from tenantq.engine.sharding import device_bytes, make_mesh, shard_params
from tenantq.model.config import ModelConfig
from tenantq.model.decoder import init_params
from tenantq.numerics import QArray, dequantize
from tenantq.quant.apply import apply_plan, quantize_per_shard, quantize_tensor
from tenantq.quant.kv_calibration import KVScales
from tenantq.quant.plan import QuantPlan
from tenantq.storage.tp import tp_split_axis as split_axis
from tenantq.testing import tiny_checkpoint

CONFIG = ModelConfig(
    model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=8, num_kv_heads=4, head_dim=16, max_position_embeddings=64,
)  # fmt: skip
CACHE = dict(max_seqs=2, max_seq_tokens=32)
PLANS = {
    "bf16": None,
    "int8": QuantPlan.from_dict({"rules": [{"pattern": ".*", "format": "int8"}]}),
    "int4": QuantPlan.from_dict({"rules": [{"pattern": ".*", "format": "int4", "group_size": 16}]}),
    # A quantized KV pool: fp8 pages with per-channel scales, packed int4 values, sinks.
    "kv_fp8_int4": QuantPlan.from_dict(
        {
            "rules": [],
            "kv": {
                "key_format": "fp8_e4m3",
                "key_axis": "channel",
                "value_format": "int4",
                "value_axis": "token",
                "sink_tokens": 2,
            },
        }
    ),  # fmt: skip
    # Static scales: fp8 keys per KV head (sharded with the heads), int8 values per tensor.
    "kv_static": QuantPlan.from_dict(
        {
            "kv": {
                "key_format": "fp8_e4m3",
                "key_axis": "head",
                "value_format": "int8",
                "value_axis": "tensor",
            }
        }
    ),  # fmt: skip
}
# Column-split tensors only, one scale per output channel (axis 0, which is never split).
COLUMNS = QuantPlan.from_dict(
    {"rules": [{"pattern": r".*/(q|k|v|gate|up)_proj|lm_head", "format": "int8"}]}
)
# Per-tensor fp8 on every linear (a plan cannot say axis=None; its resolved form can).
PER_TENSOR = QuantPlan.from_dict(
    {"rules": [{"pattern": r"layers/.*|lm_head", "format": "fp8_e4m3"}]}
)
# Planner == engine at tp=4: weight and KV formats that shard with scales, packing, tensor
# scales, residual windows and sinks; the odd vocabulary is replicated on every device.
CAPACITY_PLANS = {
    "int4_g16_kv_int8_int4_sinks": {
        "rules": [{"pattern": ".*", "format": "int4", "group_size": 16}],
        "kv": {"key_format": "int8", "key_axis": "channel", "value_format": "int4",
               "value_axis": "token", "sink_tokens": 3, "bf16_layers": [-1]},
    },
    "nvfp4_mxfp4_kv_fp8_nvfp4": {
        "rules": [{"pattern": "layers/.*", "format": "nvfp4"},
                  {"pattern": ".*", "format": "mxfp4"}],
        "kv": {"key_format": "fp8_e4m3", "key_axis": "channel", "value_format": "nvfp4",
               "value_axis": "token", "sink_tokens": 2},
    },
    # static scales per head (sharded) and per tensor (replicated), int2 zero points, counters
    "kv_static_int2_head_fp8_tensor": {
        "kv": {"key_format": "int2", "key_axis": "head", "value_format": "fp8_e4m3",
               "value_axis": "tensor", "sink_tokens": 2},
    },
}  # fmt: skip
CAPACITY_POOL = dict(num_pages=6, max_seqs=3, page_tokens=8, max_seq_tokens=32)
E4M3_REL = 2.0**-4  # half an ulp of 3 mantissa bits, relative to the value
E4M3_SUB = 2.0**-10  # half the subnormal step 2^-9, in units of the scale


def static_scales(config: ModelConfig) -> KVScales:
    """Made-up K/V statistics (|x| <= 2 in every head) for plans with static KV axes."""
    shape = (config.num_layers, config.num_kv_heads)
    stats = {"absmax": np.full(shape, 2.0, np.float32), "min": np.full(shape, -2.0, np.float32),
             "max": np.full(shape, 2.0, np.float32), "percentile": np.ones(shape, np.float32),
             "layer_percentile": np.ones(shape[0], np.float32)}  # fmt: skip
    return KVScales("model", "data", 99.99, 0, {"keys": stats, "values": stats})


def engine(params, plan, **kw) -> Engine:
    if plan is not None and plan.needs_kv_scales:
        kw.setdefault("kv_scales", static_scales(CONFIG))
    return Engine(CONFIG, params, plan, dtype="float32", **CACHE, **kw)


def diff(a, b) -> dict:
    scale = float(np.abs(b).max())
    return {"max_abs": float(np.abs(a - b).max()), "max_ref": scale}


def kl(p_logits, q_logits) -> np.ndarray:
    """KL(p || q) per token, from logits, in float64."""
    lp = p_logits.astype(np.float64)
    lq = q_logits.astype(np.float64)
    lp = lp - np.logaddexp.reduce(lp, axis=-1, keepdims=True)
    lq = lq - np.logaddexp.reduce(lq, axis=-1, keepdims=True)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def same_qarrays(a: dict, b: dict) -> list[str]:
    """Paths whose QArrays differ in any field, bit for bit."""
    bad = []
    for path, qa in a.items():
        qb = b[path]
        if not isinstance(qa, QArray):
            continue
        fields = zip(jax.tree.leaves(qa), jax.tree.leaves(qb), strict=True)
        aux_equal = jax.tree.structure(qa) == jax.tree.structure(qb)
        if not aux_equal or not all(
            np.array_equal(np.asarray(x), np.asarray(y)) for x, y in fields
        ):
            bad.append(path)
    return bad


def spec_of(x) -> str:
    return str(x.sharding.spec)


def cache_placement(state) -> list[dict]:
    """Each cache array's shape, dtype, and whether it is split on axis 2 only."""
    out = []
    for a in jax.tree.leaves(state):
        spec = tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))
        head_only = a.ndim > 2 and spec[2] == "tp" and spec.count(None) == a.ndim - 1
        out.append({"shape": list(a.shape), "dtype": str(a.dtype), "head_sharded": head_only})
    return out


def field_specs(value) -> dict[str, str]:
    if not isinstance(value, QArray):
        return {"value": spec_of(value)}
    fields = {"data": value.data, "scale": value.scale, "zero_point": value.zero_point}
    return {k: spec_of(v) for k, v in fields.items() if v is not None}


def e4m3_within_bound(weight, q: QArray, tp: int, axis: int | None) -> float:
    """max over elements of |w - deq| / (2^-4 |w| + 2^-10 s), s the element's own scale."""
    w = np.asarray(weight, np.float64)
    err = np.abs(np.asarray(dequantize(q), np.float64) - w)
    if axis is None:
        s = np.full_like(w, np.abs(w).max() / 448.0)
    else:
        s = np.concatenate(
            [np.full_like(p, np.abs(p).max() / 448.0) for p in np.split(w, tp, axis=axis)], axis
        )
    return float((err / (E4M3_REL * np.abs(w) + E4M3_SUB * s)).max())


def main() -> None:
    began = time.perf_counter()
    out: dict = {"devices": len(jax.devices())}
    params = init_params(CONFIG, seed=0)
    tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 12))

    # (1) sharded logits (prefill, and one decode step) equal unsharded ones.
    parity = {}
    for name, plan in PLANS.items():
        ref = engine(params, plan)
        ref_logits = ref.logits(tokens)
        # The engine's own float32 noise: the same 12 positions, 4 more tokens after them
        # (causally irrelevant; only XLA's blocking of the reductions changes).
        if not name.startswith("kv"):  # (a KV page's scales would see the new tokens)
            longer = ref.logits(np.concatenate([tokens, tokens[:, :4]], axis=1))[:, :12]
            parity[f"{name}/noise_floor"] = diff(longer, ref_logits)
        for tp in (2, 4):
            sharded = engine(params, plan, tp=tp)
            parity[f"{name}/tp{tp}"] = diff(sharded.logits(tokens), ref_logits)
            if name == "kv_fp8_int4" and tp == 4:
                out["cache_arrays"] = cache_placement(sharded.cache.state)
            if name == "int4" and tp == 4:
                out["memory_total"] = {
                    "unsharded": ref.memory_report().total_bytes,
                    "tp4": sharded.memory_report().total_bytes,
                }
                per_device = device_bytes((sharded.params, sharded.cache.state))
                out["device_bytes"] = sorted(per_device.values())
                out["specs"] = {
                    p: field_specs(sharded.params[p])
                    for p in ("embed", "lm_head", "layers/0/input_norm", "layers/0/attn/q_proj",
                              "layers/0/attn/o_proj", "layers/0/mlp/down_proj")
                }  # fmt: skip
        if name == "bf16":
            # The model's float32 conditioning: every weight moved by about one ulp (2^-23).
            signs = np.random.default_rng(1)
            nudged = {
                p: v
                * (1 + np.float32(2.0**-23) * signs.choice([-1, 1], v.shape).astype(np.float32))
                if p in CONFIG.tensors() and CONFIG.tensors()[p].kind == "linear"
                else v
                for p, v in params.items()
            }
            parity["bf16/ulp_weights"] = diff(engine(nudged, plan).logits(tokens), ref_logits)
            batch, first = ref.prefill(tokens.tolist(), reserve_tokens=2)
            step = ref.decode(batch, [3, 5])
            ref.release(batch)
            sharded = engine(params, plan, tp=4)
            batch, first_tp = sharded.prefill(tokens.tolist(), reserve_tokens=2)
            step_tp = sharded.decode(batch, [3, 5])
            sharded.release(batch)
            parity["bf16/tp4/prefill_last"] = diff(first_tp, first)
            parity["bf16/tp4/decode"] = diff(step_tp, step)
            out["cache_arrays_after_decode"] = cache_placement(sharded.cache.state)
    out["parity"] = parity

    # (2) per-channel scales along an unsharded axis: per-shard == whole-tensor, bit for bit.
    identical = {}
    for name, plan in (("int8_columns", COLUMNS), ("int4_g16_aligned", PLANS["int4"])):
        by_scope = {s: engine(params, plan, tp=4, scale_scope=s) for s in ("global", "shard")}
        identical[name] = {
            "differing_qarrays": same_qarrays(by_scope["global"].params, by_scope["shard"].params),
            "logits_equal": bool(
                np.array_equal(by_scope["global"].logits(tokens), by_scope["shard"].logits(tokens))
            ),
        }
    out["identical"] = identical

    # (3) per-tensor fp8 scales: per shard vs whole tensor, measured against full precision.
    mesh = make_mesh(4, CONFIG)
    resolved = {
        p: dataclasses.replace(t, axis=None, group_size=None)
        for p, t in PER_TENSOR.resolve(CONFIG).items()
    }
    full = engine(params, None, tp=4).logits(tokens)
    logits, bound = {}, {}
    for scope in ("global", "shard"):
        quantized = {
            p: v if p not in resolved
            else quantize_tensor(v, resolved[p]) if scope == "global"
            else quantize_per_shard(v, resolved[p], split_axis(p, CONFIG, 4), 4)
            for p, v in params.items()
        }  # fmt: skip
        placed = shard_params(quantized, CONFIG, mesh)
        # Already quantized and placed: the engine checks them against the plan, quantizes
        # nothing and keeps them as they are.
        logits[scope] = engine(placed, PER_TENSOR, tp=4).logits(tokens)
        bound[scope] = max(
            e4m3_within_bound(
                params[p], placed[p], 4, None if scope == "global" else split_axis(p, CONFIG, 4)
            )
            for p in resolved
        )
        out.setdefault("per_tensor_scale_shapes", {})[scope] = str(
            placed["layers/0/attn/q_proj"].scale.shape
        )
    delta = np.abs(logits["shard"] - logits["global"])
    out["per_tensor"] = {
        "max_abs_dlogits": float(delta.max()),
        "kl_global_shard_mean": float(kl(logits["global"], logits["shard"]).mean()),
        "kl_global_shard_max": float(kl(logits["global"], logits["shard"]).max()),
        "kl_full_global_mean": float(kl(full, logits["global"]).mean()),
        "kl_full_shard_mean": float(kl(full, logits["shard"]).mean()),
        "max_abs_dlogits_full_global": float(np.abs(logits["global"] - full).max()),
        "max_abs_dlogits_full_shard": float(np.abs(logits["shard"] - full).max()),
        "bound_ratio": bound,  # <= 1: every element within its format's rounding bound
    }

    # from_checkpoint(tp=2, scale_scope=...) builds the same engine as in-memory params.
    with tempfile.TemporaryDirectory() as folder:
        tiny_checkpoint(folder, CONFIG, params, dtype="float32")
        loaded = {}
        for scope in ("global", "shard"):
            from_disk = Engine.from_checkpoint(
                folder, PLANS["int4"], dtype="float32", tp=2, scale_scope=scope, **CACHE
            )
            in_memory = engine(params, PLANS["int4"], tp=2, scale_scope=scope)
            loaded[scope] = bool(np.array_equal(from_disk.logits(tokens), in_memory.logits(tokens)))
    out["from_checkpoint_equal"] = loaded

    # (4) what each device holds, per weight tensor and per KV layer, for the planner test.
    capacity = {}
    for vocab in (CONFIG.vocab_size, CONFIG.vocab_size + 2):  # 128 splits over 4; 130 does not
        config = dataclasses.replace(CONFIG, vocab_size=vocab)
        weights = init_params(config, seed=0)
        for name, raw in CAPACITY_PLANS.items():
            eng = Engine(config, weights, QuantPlan.from_dict(raw), dtype="bfloat16", tp=4,
                         kv_scales=static_scales(config), **CAPACITY_POOL)  # fmt: skip
            capacity[f"{name}/vocab{vocab}"] = {
                "weights": {p: sorted(device_bytes(v).values()) for p, v in eng.params.items()},
                "kv": [sorted(device_bytes(layer).values()) for layer in eng.cache.state],
                "num_pages": eng.cache.num_pages,
            }
    out["capacity_tp4"] = capacity

    # (6) params quantized beforehand (a calibrator's, apply_plan's) under scale_scope="shard":
    # placed as they are when every scale stays inside a shard (asymmetric groups of 16 in
    # shards of 32 rows; per-shard fp8 scales), so the logits are the unsharded engine's on
    # the same params; refused in one line when a scale spans shards.
    asym = QuantPlan.from_dict(
        {"rules": [{"pattern": ".*", "format": "int4", "group_size": 16, "symmetric": False}]}
    )
    fp8 = QuantPlan.from_dict({"rules": [{"pattern": "layers/.*", "format": "fp8_e4m3"}]})
    axes = {p: split_axis(p, CONFIG, 4) for p in params}
    given = {}
    for name, plan, quantized in (
        ("int4_g16_asym", asym, apply_plan(params, asym, CONFIG)),
        ("fp8_per_shard", fp8, apply_plan(params, fp8, CONFIG, shard_axes=axes, tp=4)),
    ):
        want = engine(quantized, plan).logits(tokens)
        placed = engine(quantized, plan, tp=4, scale_scope="shard")
        given[name] = diff(placed.logits(tokens), want)
    refused = {}
    nvfp4 = QuantPlan.from_dict({"rules": [{"pattern": "layers/.*", "format": "nvfp4"}]})
    for name, plan in (("int8_over_rows", PLANS["int8"]), ("nvfp4", nvfp4)):
        try:
            engine(apply_plan(params, plan, CONFIG), plan, tp=4, scale_scope="shard")
            refused[name] = None
        except ValueError as err:
            refused[name] = str(err)
    out["given_quantized"] = {"parity": given, "refused": refused}

    # (5) bad tp values are ValueErrors that name the valid ones.
    errors = {}
    for name, make in (("tp3", lambda: engine(params, None, tp=3)), ("tp8", lambda: make_mesh(8))):
        try:
            make()
            errors[name] = None
        except ValueError as err:
            errors[name] = str(err)
    out["errors"] = errors
    out["seconds"] = time.perf_counter() - began
    print(json.dumps(out))


if __name__ == "__main__":
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        sys.exit("run with XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu")
    main()
