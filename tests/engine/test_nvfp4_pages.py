"""nvfp4 values scaled per token in the paged pool: every 16-element block within its own step.

A token-scaled nvfp4 page fixes one float32 tensor scale G when it is opened; each block of
16 then gets an E4M3 block scale e4m3(amax_b / 6 / G), and the element step is that scale
times G. While the block-scale target amax_b / (6 G) lies in E4M3's normal range
[2^-6, 448] its rounding is within 2^-4 relative (3 mantissa bits, round to nearest), so
step <= (1 + 2^-4) amax_b / 6. E2M1 (0, .5, 1, 1.5, 2, 3, 4, 6) rounds within half its
largest gap, one step; a value clipped at 6 steps errs by at most amax_b * 2^-4 < one step.
Hence per element |v - v^| <= (1 + 2^-4) amax_b / 6, the block's own amax, not the page's.

The documented headroom (paged.NVFP4_TOKEN_HEADROOM: later tokens up to 16x the opening
token's amax still fit) puts that normal range at blocks with amax in [A/1792, 16 A] for an
opening amax A: G = 16 A / (448 * 6), so amax_b/(6G) = 448 amax_b / (16 A). The blocks below
span A/1500 to 15.9 A. A single page-wide bound (max|v|/6) cannot see a quiet block's error.
"""

from __future__ import annotations

import numpy as np

from tenantq.engine.pool import PagedPool
from tenantq.quant.plan import KVPlan, QuantPlan

BLOCK = 16
E4M3_HALF_ULP = 2.0**-4
F32_SLACK = 2.0**-20  # float32 rounding of x/step and code*step, relative to amax_b


def _write_run(pool: PagedPool, seq: int, start: int, keys, values) -> None:
    """One step's write of tokens start.. of `seq` into layer 0 (the pool's jit-side layout)."""
    s = keys.shape[1]
    pool.make_room([seq], [start + s])
    positions = (start + np.arange(s, dtype=np.int32))[None]
    pool.state = pool.layout.write(
        pool.state, 0, pool.table([seq]), positions, np.ones((1, s), bool), keys, values
    )


def test_each_block_is_within_its_own_step(make_config) -> None:
    config = make_config(head_dim=32)  # two blocks of 16 per (token, head)
    h, d = config.num_kv_heads, config.head_dim
    pool = PagedPool(
        config, QuantPlan(kv=KVPlan("bf16", "channel", "nvfp4", "token")), dtype="float32",
        page_tokens=8, max_seqs=1, max_seq_tokens=32,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    v = rng.uniform(0.5, 1.0, (6, h, d)) * rng.choice([-1.0, 1.0], (6, h, d))
    v[0] /= np.abs(v[0]).max()  # the opening token: amax A = 1
    # Later tokens (same page): block amaxes from A/1500 to 15.9 A, loud next to quiet.
    block_amax = np.array(
        [[[1, 1], [1, 1]], [[12, 1 / 100], [1 / 300, 3]], [[1 / 10, 1 / 100], [12, 1 / 300]],
         [[1 / 50, 5], [1, 1 / 20]], [[2, 2], [1 / 200, 8]],
         [[1 / 1000, 1 / 1500], [1 / 1200, 15.9]]],
    )  # fmt: skip
    v = v.reshape(6, h, 2, BLOCK)
    v = v / np.abs(v).max(axis=-1, keepdims=True) * block_amax[..., None]
    v = v.reshape(6, h, d).astype(np.float32)
    k = np.zeros_like(v)
    seq = pool.allocate(6)
    _write_run(pool, seq, 0, k[None, :1], v[None, :1])  # opens the page, fixes G
    _write_run(pool, seq, 1, k[None, 1:], v[None, 1:])  # later tokens keep that G
    _, values, _ = pool.layout.read(pool.state, 0, pool.table([seq]), 8)
    got = np.asarray(values[0, :6], np.float64).reshape(6, h, 2, BLOCK)
    want = v.astype(np.float64).reshape(6, h, 2, BLOCK)
    amax_b = np.abs(want).max(axis=-1, keepdims=True)
    bound = (1 + E4M3_HALF_ULP) * amax_b / 6 + F32_SLACK * amax_b
    err = np.abs(got - want)
    worst = (err / bound).max(axis=-1)
    assert (err <= bound).all(), f"error / per-block bound by (token, head, block):\n{worst}"
    assert err.max() > 0  # really quantized
