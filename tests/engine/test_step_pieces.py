"""The step as per-piece executables (`tenantq.engine.steps`): same numbers, fewer compiles.

Bounds: in float32 the pieces give the same bits as the whole-model step they replace (the
same ops on the same values; the reference below is that step, body + head jits as before).
In bfloat16 XLA may keep a value in float32 across what the code rounds to bf16
(`xla_allow_excess_precision`, on by default), which a piece boundary cannot: with that off,
the bits are equal too (checked in a subprocess). Logits equal the cacheless
`decoder.forward` within 1e-4 of the logit scale (float32, the same math in another order:
the bound of tests/reference's cacheless check). Compile counts are arithmetic on the plan:
one executable per distinct piece layout per step shape.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tenantq.engine import Engine, steps
from tenantq.engine.cache import CacheView
from tenantq.model.decoder import forward, init_params
from tenantq.quant.plan import KVPlan, QuantPlan, Rule

NO_EXCESS = "--xla_allow_excess_precision=false"
ROWS = [[5, 9, 13, 1, 22, 40, 7], [7, 3], [11, 12, 60, 4, 30, 8, 2, 2, 9]]


def _mixed_plan(kv: KVPlan | None = None) -> QuantPlan:
    """Layer 0 and 3 bf16; layers 1 and 2 alike (int8 attention, int4 g8 MLP); KV int8 keys
    per channel with sinks, fp8 values per token, bf16 in layers 0 and 3."""
    return QuantPlan(
        rules=(
            Rule(r"layers/(1|2)/attn/.*", "int8"),
            Rule(r"layers/(1|2)/mlp/.*", "int4", group_size=8),
        ),
        kv=kv
        or KVPlan(
            key_format="int8",
            key_axis="channel",
            value_format="fp8_e4m3",
            value_axis="token",
            sink_tokens=2,
            bf16_layers=(0, -1),
        ),  # fmt: skip
    )


# Qwen2's q/k/v biases, Qwen3's q/k norms; both with Mistral's sliding window in layers 0, 2
ARCHITECTURES = {
    "qwen2": dict(model_type="qwen2", attention_bias=True),
    "qwen3": dict(model_type="qwen3", qk_norm=True),
}


def _config(make_config, arch: str = "qwen3"):
    return make_config(
        num_layers=4, layer_types=("sliding", "full", "sliding", "full"), sliding_window=5,
        **ARCHITECTURES[arch],
    )  # fmt: skip


def _whole_body(graphdef, layout, kv_tokens, state, cache_state, table, tokens, positions, valid):
    # The step before the split: the whole decoder merged into one executable.
    model = nnx.merge(graphdef, state)
    view = CacheView(layout, cache_state, table, positions, valid, kv_tokens)
    hidden = model(tokens, positions, view)
    last = jnp.maximum(valid.sum(axis=1) - 1, 0)
    logits = model.logits(hidden[jnp.arange(hidden.shape[0]), last])
    return (hidden, logits, jnp.argmax(logits, axis=-1).astype(jnp.int32)), view.state


def _whole_head(graphdef, state, hidden, targets):
    logits = nnx.merge(graphdef, state).logits(hidden)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return logits, jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def _whole_model_step(model):
    """A `steps.run_step` stand-in running `model` whole, as the engine did before the split."""
    graphdef, state = nnx.split(model)
    body = jax.jit(_whole_body, static_argnums=(0, 1, 2), donate_argnums=(4,))
    head = jax.jit(_whole_head, static_argnums=(0,))

    def run_step(*, model, cache, output, kv_tokens, table, tokens, positions, valid, targets,
                 stats):  # fmt: skip
        rows = tokens.shape[0]
        if tokens.shape[1] == 1:
            kv_tokens = max(kv_tokens, min(steps.DECODE_MIN_KV_TOKENS, cache.max_seq_tokens))
            table, tokens, positions, valid = steps._pad_rows(
                cache, cache.max_seqs - rows, table, tokens, positions, valid
            )
        (hidden, logits, top1), cache.state = body(
            graphdef, cache.layout, kv_tokens, state, cache.state, table, tokens, positions, valid
        )
        if output == "last":
            return logits[:rows], top1[:rows]
        return head(graphdef, state, hidden, targets)

    return run_step


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_pieces_give_the_whole_model_steps_bits(make_config, monkeypatch, arch, dtype):
    if dtype == "bfloat16" and NO_EXCESS not in os.environ.get("XLA_FLAGS", ""):
        pytest.skip(f"bfloat16 bits are compared with {NO_EXCESS} (the subprocess test)")
    config = _config(make_config, arch)
    params = init_params(config, seed=4)
    plan = _mixed_plan()

    def run(engine):
        logits = engine.logits(ROWS)
        scores = engine.score([r[:3] for r in ROWS], [r[3:] for r in ROWS])
        generated = engine.generate(ROWS, 6, stop_tokens=())
        return logits, scores, generated, engine.kv_clip_rate()

    split = run(Engine(config, params, plan, dtype=dtype, max_seqs=4, max_seq_tokens=64))
    whole_engine = Engine(config, params, plan, dtype=dtype, max_seqs=4, max_seq_tokens=64)
    monkeypatch.setattr(steps, "run_step", _whole_model_step(whole_engine.model))
    whole = run(whole_engine)
    np.testing.assert_array_equal(split[0], whole[0])
    for got, want in zip(split[1], whole[1], strict=True):
        np.testing.assert_array_equal(got, want)
    assert split[2] == whole[2]  # greedy decode through the quantized pool, token for token
    assert split[3] == whole[3]


@pytest.mark.slow
def test_bfloat16_steps_differ_only_by_xlas_excess_precision():
    env = {**os.environ, "XLA_FLAGS": NO_EXCESS, "JAX_PLATFORMS": "cpu"}
    test = f"{__file__}::test_pieces_give_the_whole_model_steps_bits"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test, "-k", "bfloat16"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout[-3000:]


def test_pieces_match_the_cacheless_forward_on_a_mixed_weight_plan(make_config):
    config = _config(make_config)
    params = init_params(config, seed=5)
    plan = _mixed_plan(KVPlan())  # bf16 KV (float32 in a float32 engine): weights only
    engine = Engine(config, params, plan, dtype="float32", max_seqs=4, max_seq_tokens=64)
    got = engine.logits([ROWS[2]])
    want = np.asarray(forward(engine.params, config, jnp.asarray([ROWS[2]])))
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)


def _distinct_layers(config, plan) -> dict[str, int]:
    """Distinct layer layouts per piece, from the plan: pre (q/k/v formats), kv (the
    layer's key and value formats and its window), o, mlp (gate/up/down formats)."""
    how = plan.resolve(config)
    kv = plan.kv_layers(config)

    def fmt(layer: int, names: tuple[str, ...]) -> tuple:
        return tuple(
            None if how.get(f"layers/{layer}/{n}") is None else how[f"layers/{layer}/{n}"].format
            for n in names
        )

    layers = range(config.num_layers)
    return {
        "pre": len({fmt(i, ("attn/q_proj", "attn/k_proj", "attn/v_proj")) for i in layers}),
        "kv": len({(kv[i].keys, kv[i].values, config.layer_types[i]) for i in layers}),
        "o": len({fmt(i, ("attn/o_proj",)) for i in layers}),
        "mlp": len({fmt(i, ("mlp/gate_proj", "mlp/up_proj", "mlp/down_proj")) for i in layers}),
    }


def test_layers_stored_alike_compile_once_and_a_new_plan_compiles_only_new_pieces(
    make_config, monkeypatch
):
    monkeypatch.setattr(steps, "_EXECUTABLES", OrderedDict())  # counts from an empty cache
    config = make_config(num_layers=4)
    params = init_params(config, seed=6)
    first = _mixed_plan()
    distinct = _distinct_layers(config, first)
    # layers 0/3 and 1/2 alike: 2 layouts of each piece instead of 4
    assert distinct == {"pre": 2, "kv": 2, "o": 2, "mlp": 2}
    engine = Engine(config, params, first, max_seqs=4, max_seq_tokens=64)
    engine.logits(ROWS)  # one step shape: embed, the layers' pieces, final, head
    assert engine.stats.compiles == 1 + sum(distinct.values()) + 1 + 1  # 11, not 4 * 4 + 3

    # Same attention and KV, a new MLP format in layers 1 and 2: only their MLP piece is new.
    second = QuantPlan(
        rules=(Rule(r"layers/(1|2)/attn/.*", "int8"), Rule(r"layers/(1|2)/mlp/.*", "fp8_e4m3")),
        kv=first.kv,
    )
    other = Engine(config, init_params(config, seed=7), second, max_seqs=4, max_seq_tokens=64)
    other.logits(ROWS)
    assert other.stats.compiles == 1
    # The same plan again (other weights): nothing to compile.
    again = Engine(config, init_params(config, seed=8), first, max_seqs=4, max_seq_tokens=64)
    again.logits(ROWS)
    assert again.stats.compiles == 0


def test_layer_views_are_equal_for_layers_stored_alike(make_config):
    config = make_config(num_layers=4)
    engine = Engine(config, init_params(config), _mixed_plan(), max_seqs=2, max_seq_tokens=32)
    layout = engine.cache.layout
    views = [layout.layer_view(i) for i in range(4)]
    assert views[0] == views[3] and views[1] == views[2] and views[0] != views[1]
    assert hash(views[1]) == hash(views[2]) and len(views[1].layers) == 1
    with pytest.raises(ValueError, match="layer 4 is outside 0..3"):
        layout.layer_view(4)
