"""W4A8: int4 weights (groups along the input) multiplied on 8-bit activation codes.

The reference is numpy on the stored bytes: nibbles unpacked by hand (low nibble first, two's
complement), per-group products summed exactly in int64 (int8 activations) or float64 (fp8
activations: every fp8 x int4 product is exact in float64), then rescaled. The engine's
float32 path may differ only by float32 rounding: one rounding per group sum (fp8: per
product added, g of them) and per rescale, so |got - want| <= (g + G + 2) 2^-24 x the sum
of |terms|.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tenantq.model.layers import matmul
from tenantq.numerics import quantize
from tenantq.quant.plan import QuantPlan, Rule

IN, OUT, GROUP = 320, 24, 128  # 320 = 2 x 128 + 64: a partial last group


def _nibbles_by_hand(data: np.ndarray, n: int) -> np.ndarray:
    data = data.astype(np.int16)
    both = np.stack([data & 0xF, data >> 4], axis=-1).reshape(*data.shape[:-1], -1)[..., :n]
    return np.where(both >= 8, both - 16, both)


def _reference(x_codes, x_scale, w, groups: int) -> tuple[np.ndarray, np.ndarray]:
    codes = _nibbles_by_hand(np.asarray(w.data), OUT).astype(np.float64)
    w_scale = np.asarray(w.scale, np.float64)  # [G, OUT]
    want = np.zeros((x_codes.shape[0], OUT))
    size = np.zeros_like(want)
    for g in range(groups):
        sl = slice(g * GROUP, min((g + 1) * GROUP, IN))
        part = x_codes[:, sl] @ codes[sl]  # exact: integers, or fp8 x int4 products
        want += part * w_scale[g]
        size += (np.abs(x_codes[:, sl]) @ np.abs(codes[sl])) * np.abs(w_scale[g])
    return want * x_scale, size * x_scale


def _activation_codes(x: np.ndarray, activations: str) -> tuple[np.ndarray, np.ndarray]:
    top = np.float32(127.0 if activations == "int8" else 448.0)
    scale = np.abs(x).max(axis=-1, keepdims=True).astype(np.float32) / top  # float32, [T, 1]
    ratio = x.astype(np.float32) / scale
    if activations == "int8":
        codes = np.clip(np.rint(ratio), -127, 127)
    else:
        codes = np.clip(ratio, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return codes.astype(np.float64), scale.astype(np.float64)


@pytest.mark.parametrize("activations", ["int8", "fp8_e4m3"])
def test_w4a8_product_equals_numpy_on_the_stored_codes(activations: str) -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, IN)).astype(np.float32)
    x[1, 3] = 30.0  # an outlier: its token's scale grows, the rest of its row loses bits
    w = quantize(jnp.asarray(rng.standard_normal((IN, OUT)) / np.sqrt(IN), jnp.float32),
                 "int4", axis=0, group_size=GROUP)  # fmt: skip
    assert w.scale.shape == (3, OUT)
    got = np.asarray(matmul(jnp.asarray(x), w, dtype=jnp.float32, activations=activations))

    # The activation codes built here, not read back from the codec: per token, float32
    # scale = amax / 127 (int8) or amax / 448 (fp8 e4m3's largest), IEEE-rounded as the codec
    # divides; int8 codes round half to even, clipped to [-127, 127]; fp8 codes cast by
    # ml_dtypes (round to nearest even) after clipping to +-448.
    x_codes, x_scale = _activation_codes(x, activations)
    want, size = _reference(x_codes, x_scale, w, groups=3)
    slack = (GROUP + 3 + 2) * 2.0**-24 * size
    assert (np.abs(got - want) <= slack).all()
    # The test can fail: a codec that floors instead of rounding lands outside the slack.
    if activations == "int8":
        floored = np.clip(np.floor(x / x_scale.astype(np.float32)), -127, 127)
        floor_want, _ = _reference(floored.astype(np.float64), x_scale, w, groups=3)
        assert (np.abs(floor_want - want) > slack).any()
    # The test can fail: the codes read high nibble first land far outside the slack.
    swapped = _nibbles_by_hand(np.asarray(w.data), OUT).reshape(IN, -1, 2)[..., ::-1]
    wrong = x_codes[:, :GROUP] @ swapped.reshape(IN, OUT)[:GROUP].astype(np.float64)
    assert np.abs(wrong * np.asarray(w.scale)[0] * x_scale - want).max() > slack.max()


def test_w4a8_decode_activations_run_the_same_rank3_grouped_dot_as_a_2d_batch() -> None:
    # The engine's decode step multiplies hidden states [B, 1, in]; the roofline bench times
    # the W4A8 matmul on [B, in]. Left 4-D ([B, 1, G, g] against [G, g, out]), XLA:CPU ran the
    # grouped dot about twice as slow at 64 rows (8 int4/g128 [1024, 2816] weights: 158 ms
    # against 82 ms for [64, 1024]; [2816, 1024]: 202 against 84; one core, process CPU
    # time, load ~19, 13:30 UTC): the step's -51% at batch 64 in docs/results/roofline.md.
    # So every leading axis is flattened first: one [M, G, g] x [G, g, out] dot, whatever
    # the activations' rank, and the same values as the 2-D product.
    import jax

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, 1, IN)), jnp.float32)
    w = quantize(jnp.asarray(rng.standard_normal((IN, OUT)) / np.sqrt(IN), jnp.float32),
                 "int4", axis=0, group_size=GROUP)  # fmt: skip

    def dots(x):
        jaxpr = jax.make_jaxpr(lambda x: matmul(x, w, dtype=jnp.float32, activations="int8"))(x)
        return [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]

    (dot,) = dots(x)
    assert [v.aval.ndim for v in dot.invars] == [3, 3], [v.aval.shape for v in dot.invars]
    assert dot.invars[0].aval.shape == (4, 3, GROUP)
    got = matmul(x, w, dtype=jnp.float32, activations="int8")
    flat = matmul(x[:, 0], w, dtype=jnp.float32, activations="int8")
    assert got.shape == (4, 1, OUT)
    np.testing.assert_array_equal(np.asarray(got[:, 0]), np.asarray(flat))


def test_w4a8_close_to_the_float_product_within_the_int4_step() -> None:
    # Against the unquantized product: each weight is off by at most half its group's step
    # (amax_g / 14) and each int8 input by half its token's step (amax_x / 254).
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, IN)).astype(np.float32)
    wf = (rng.standard_normal((IN, OUT)) / np.sqrt(IN)).astype(np.float32)
    w = quantize(jnp.asarray(wf), "int4", axis=0, group_size=GROUP)
    got = np.asarray(matmul(jnp.asarray(x), w, dtype=jnp.float32, activations="int8"))
    groups = np.array_split(np.abs(wf), [GROUP, 2 * GROUP], axis=0)
    w_err = np.concatenate([np.broadcast_to(g.max(0) / 14, g.shape) for g in groups])
    x_err = np.abs(x).max(axis=1, keepdims=True) / 254
    bound = np.abs(x) @ w_err + x_err * (np.abs(wf) + w_err).sum(axis=0) + 1e-5
    assert (np.abs(got - x @ wf) <= bound).all()


def test_w4a8_rules_take_groups_but_8bit_w8a8_does_not() -> None:
    plan = QuantPlan((Rule(".*_proj", "int4", group_size=64, activations="fp8_e4m3"),))
    assert QuantPlan.from_json(plan.to_json()) == plan
    Rule(".*", "int4", activations="int8")  # int4's default group (128) applies
    with pytest.raises(ValueError, match="symmetric per-channel"):
        Rule(".*", "int8", group_size=64, activations="int8")
    with pytest.raises(ValueError, match="symmetric per-channel"):
        Rule(".*", "int4", symmetric=False, activations="int8")
    with pytest.raises(ValueError, match="needs weights in"):
        Rule(".*", "mxfp4", activations="int8")


TP_SCRIPT = """
import json
import sys
import numpy as np
from tenantq.engine import Engine
from tenantq.engine.sharding import device_bytes
from tenantq.quant.plan import QuantPlan, Rule
from tenantq.testing import tiny_config, tiny_params
pattern, tied = sys.argv[1], sys.argv[2] == "tied"
config = tiny_config(tie_word_embeddings=tied)
params = tiny_params(config)
plan = QuantPlan((Rule(pattern, "int4", group_size=16, activations="int8"),))
prompts = [[3, 4, 5, 6, 7], [9, 8, 7]]
one = Engine(config, params, plan, max_seqs=2, max_seq_tokens=32)
two = Engine(config, params, plan, tp=2, max_seqs=2, max_seq_tokens=32)
a, b = one.logits(prompts), two.logits(prompts)
held = {p: sorted(device_bytes(v).values()) for p, v in two.params.items()}
print(json.dumps({"diff": float(np.abs(a - b).max()), "top": float(np.abs(a).max()),
                  "held": held}))
"""


def _tp2(pattern: str, tied: bool) -> dict:
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")  # fmt: skip
    argv = [sys.executable, "-c", TP_SCRIPT, pattern, "tied" if tied else "untied"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a subprocess that imports JAX and builds a sharded engine
def test_w4a8_under_tensor_parallelism_matches_one_chip_and_the_planner() -> None:
    # W4A8 with groups along the input splits its row-parallel weights (o, down) between
    # groups: each device multiplies whole groups, so the sharded engine sums the same exact
    # group products (int32) in another order. Bound: float32 re-association of the logits'
    # sums, 1e-5 of the largest logit (about 2^-17: a few hundred terms at 2^-24 each).
    from tenantq.capacity.weights import tensor_bytes
    from tenantq.testing import tiny_config

    out = _tp2("layers/.*", tied=False)
    assert out["diff"] <= 1e-5 * out["top"]
    plan = QuantPlan((Rule("layers/.*", "int4", group_size=16, activations="int8"),))
    for t in tensor_bytes(tiny_config(), plan, tp=2):
        assert out["held"][t.path] == [t.bytes_per_chip] * 2, t.path


@pytest.mark.slow  # a subprocess that imports JAX and builds a sharded engine
def test_w4a8_tied_head_under_tensor_parallelism_matches_one_chip_and_the_planner() -> None:
    # A tied embedding in W4A8 ([vocab, hidden], int4 groups along hidden) is split along the
    # vocabulary at tp=2: each device runs the grouped E^T product for its half of the
    # logits over whole groups, the same group products as one chip. Bound as the untied
    # test's: float32 re-association, 1e-5 of the largest logit. Bytes: each device holds
    # what the planner counts per chip, the embedding's half included.
    from tenantq.capacity.weights import tensor_bytes
    from tenantq.testing import tiny_config

    out = _tp2(".*", tied=True)
    assert out["diff"] <= 1e-5 * out["top"]
    config = tiny_config(tie_word_embeddings=True)
    plan = QuantPlan((Rule(".*", "int4", group_size=16, activations="int8"),))
    counted = tensor_bytes(config, plan, tp=2)
    assert "embed" in {t.path for t in counted} and "lm_head" not in out["held"]
    embed = next(t for t in counted if t.path == "embed")
    assert embed.shard_shape[0] == config.vocab_size // 2  # split, not replicated
    for t in counted:
        assert out["held"][t.path] == [t.bytes_per_chip] * 2, t.path
    assert set(out["held"]) == {t.path for t in counted}


@pytest.mark.parametrize("activations", ["int8", "fp8_e4m3"])
def test_w4a8_tied_head_is_the_same_product_as_its_untied_layout(activations: str) -> None:
    # A tied embedding [vocab, hidden] is the output head as x @ E^T, its int4 groups along
    # hidden (the contracted axis). Quantized along hidden, E and E^T hold the same codes and
    # scales, so the transposed product must equal the [in, out] one (tested against numpy
    # above) to float32 rounding: one group sum order, so bitwise here.
    rng = np.random.default_rng(3)
    e = jnp.asarray(rng.standard_normal((OUT, IN)) / np.sqrt(IN), jnp.float32)
    x = jnp.asarray(rng.standard_normal((4, IN)), jnp.float32)
    tied = quantize(e, "int4", axis=1, group_size=GROUP)
    untied = quantize(e.T, "int4", axis=0, group_size=GROUP)
    assert np.array_equal(np.asarray(untied.scale), np.asarray(tied.scale).T)
    got = matmul(x, tied, dtype=jnp.float32, activations=activations, transpose=True)
    want = matmul(x, untied, dtype=jnp.float32, activations=activations)
    assert np.array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("tied", [False, True])
def test_w4a8_rule_on_every_tensor_builds_the_engine_the_planner_counts(tied: bool) -> None:
    # `.*` int4 with groups and int8 activations: the plan accepts it on both layouts (an
    # untied embed is a lookup; a tied one is the head) and the capacity planner counts it,
    # so the engine must build and run it with the planner's bytes. Its logits stay within
    # the W4A8 error of the bf16 engine's: bound 0.5 of the largest logit, a loose check that
    # the head is the embedding's product (a wrong scale layout gives garbage or NaN).
    from tenantq.capacity.weights import tensor_bytes
    from tenantq.engine import Engine
    from tenantq.testing import tiny_config, tiny_params

    config = tiny_config(tie_word_embeddings=tied)
    params = tiny_params(config)
    plan = QuantPlan((Rule(".*", "int4", group_size=16, activations="int8"),))
    engine = Engine(config, params, plan, max_seqs=2, max_seq_tokens=32)
    reference = Engine(config, params, QuantPlan(), max_seqs=2, max_seq_tokens=32)
    prompts = [[3, 4, 5, 6, 7], [9, 8, 7]]
    got, want = np.asarray(engine.logits(prompts)), np.asarray(reference.logits(prompts))
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= 0.5 * np.abs(want).max()
    counted = {t.path: t.bytes_per_chip for t in tensor_bytes(config, plan, 1)}
    assert engine.memory_report().weight_bytes == counted
