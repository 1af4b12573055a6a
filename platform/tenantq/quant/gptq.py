"""GPTQ (Frantar et al. 2022): round one input row at a time, pushing each row's error onto
the rows not yet rounded through the Cholesky factor of H⁻¹, H = 2XᵀX/n + damping.

Weights here are [in, out], so the paper's columns are our rows. Rows are processed in
blocks; inside a block each rounding error updates the block at once and the rest of the
matrix lazily, once per block (the paper's "lazy batch updates"). Group scales are fixed
when their group starts (from the weights as updated so far); with activation order the
rows go by decreasing H diagonal and the group scales are fixed up front from the
original weights (static groups), since groups no longer start in order. Every rounding
goes through `compute_scale_zero_point` / `quantize_with_scale_zero_point`: GPTQ chooses
which values to round, the one codec decides how. Rows whose input never fires are zeroed
before any scale is taken; a Cholesky that fails (H + λI not positive definite in float32)
is retried with ten times the damping, each retry logged with the tensor's name.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tenantq.numerics import (
    QArray,
    compute_scale_zero_point,
    dequantize,
    get_format,
    quantize_with_scale_zero_point,
)
from tenantq.quant.plan import TensorQuant

DEFAULT_DAMP = 0.01  # fraction of mean(diag H) added to the diagonal (the paper's 1%)
DEFAULT_BLOCK_ROWS = 128  # lazy-update block when the format has no groups
DAMP_GROWTH = 10.0  # a failed Cholesky is retried with damping x this ...
MAX_DAMP = 10.0  # ... until λ = MAX_DAMP · mean diag H (the Hessian is then mostly λI)
MAX_RETRIES = 8  # ... and at most this many times, however small the damping started

log = logging.getLogger(__name__)


def _group_rows(fmt: str, group_size: int | None) -> int | None:
    spec = get_format(fmt)
    return spec.block_size or group_size or spec.default_group_size


def hessian_inverse_factor(hessian, damp: float = DEFAULT_DAMP) -> tuple[jax.Array, jax.Array]:
    """(upper Cholesky factor U of (H + λI)⁻¹ with λ = damp · mean diag H, dead-row mask).

    Rows whose input never fires (diag H = 0) get H_ii = 1 and are zeroed by the caller.
    A factorisation that fails comes back with NaNs (jnp.linalg.cholesky does not raise).
    """
    h = jnp.asarray(hessian, jnp.float32)
    diag = jnp.diagonal(h)
    dead = diag == 0
    h = h + jnp.diag(jnp.where(dead, 1.0, 0.0))
    h = h + jnp.eye(h.shape[0], dtype=h.dtype) * (damp * jnp.mean(jnp.diagonal(h)))
    lower = jnp.linalg.cholesky(h)
    h_inv = jax.scipy.linalg.cho_solve((lower, True), jnp.eye(h.shape[0], dtype=h.dtype))
    return jnp.linalg.cholesky(h_inv).T, dead


def damped_inverse_factor(hessian, damp: float = DEFAULT_DAMP, *, name: str = "weight"):
    """`hessian_inverse_factor`, retried while the factor is not finite (each retry logged,
    naming `name`); (U, dead mask, damping used). A retry multiplies the damping by
    DAMP_GROWTH; `damp = 0` (undamped GPTQ, exact when H is positive definite) retries from
    DEFAULT_DAMP, since ten times 0 is 0. Past MAX_DAMP or MAX_RETRIES retries a ValueError
    names the tensor; a negative or non-finite damp is refused at once."""
    if not np.all(np.isfinite(np.asarray(hessian))):
        raise ValueError(f"{name}: the calibration Hessian has non-finite entries")
    if not (np.isfinite(damp) and 0 <= damp <= MAX_DAMP):
        raise ValueError(
            f"{name}: GPTQ option damp={damp!r}; it must be a number in [0, {MAX_DAMP:g}] "
            f"(default {DEFAULT_DAMP})"
        )
    tried = float(damp)
    for retry in range(MAX_RETRIES + 1):
        u, dead = hessian_inverse_factor(hessian, tried)
        if bool(jnp.all(jnp.isfinite(u))):
            return u, dead, tried
        grown = tried * DAMP_GROWTH if tried > 0 else DEFAULT_DAMP
        if grown > MAX_DAMP or retry == MAX_RETRIES:
            break
        log.warning(
            "%s: GPTQ's Cholesky failed at damp=%g; retrying with damp=%g", name, tried, grown
        )
        tried = grown
    raise ValueError(
        f"{name}: GPTQ's Cholesky of H + λI failed up to damp={tried:g} (λ = damp · "
        "mean diag H); the Hessian is far from positive semi-definite: recollect the "
        "calibration statistics or use rtn for this tensor"
    )


def _take_group(scale, zero_point, g):
    """Group g's scale (and zero point) as a one-row scale: leading axis sliced at g."""

    def take(a):
        return a if a.ndim == 0 else jax.lax.dynamic_slice_in_dim(a, g, 1, axis=0)

    return jax.tree.map(take, scale), None if zero_point is None else take(zero_point)


def _put_group(table, new, g):
    def put(t, n):
        return t if t.ndim == 0 else jax.lax.dynamic_update_slice_in_dim(t, n, g, axis=0)

    return jax.tree.map(put, table, new)


@functools.partial(jax.jit, static_argnames=("fmt", "group_rows", "block_rows", "dynamic"))
def _gptq_rows(w, u, group_of_row, scale, zero_point, *, fmt, group_rows, block_rows, dynamic):
    """The GPTQ sweep over rows of w [n, out] (n a multiple of block_rows), u = chol(H⁻¹)ᵀ.

    `scale`/`zero_point`: the group table (leading axis = groups); with `dynamic` each
    block is one group whose scales are computed from the block's rows when it starts.
    Returns the rounded weights (dequantized) and the final group table.
    """
    n, _ = w.shape

    def rowwise(b, carry):
        w, q, scale, zero_point = carry
        i1 = b * block_rows
        w1 = jax.lax.dynamic_slice_in_dim(w, i1, block_rows, axis=0)
        if dynamic:  # the group starts here: fix its scale from the rows as updated so far
            s_new, z_new = compute_scale_zero_point(
                w1, fmt, axis=0, group_size=group_rows, symmetric=zero_point is None,
                **({"tensor_scale": scale.tensor} if get_format(fmt).family == "nvfp4" else {}),
            )  # fmt: skip
            scale = _put_group(scale, s_new, b)
            zero_point = None if zero_point is None else _put_group(zero_point, z_new, b)
        u1 = jax.lax.dynamic_slice(u, (i1, i1), (block_rows, block_rows))

        def one_row(i, c):
            w1, q1, e1 = c
            row = w1[i][None, :]
            s, z = _take_group(scale, zero_point, group_of_row[i1 + i])
            qa = quantize_with_scale_zero_point(row, fmt, s, z, axis=0, group_size=group_rows)
            q_row = dequantize(qa)[0]
            err = (w1[i] - q_row) / u1[i, i]
            w1 = w1 - u1[i][:, None] * err[None, :]  # u1 is upper: only rows >= i move
            return w1, q1.at[i].set(q_row), e1.at[i].set(err)

        zeros = jnp.zeros_like(w1)
        _, q1, e1 = jax.lax.fori_loop(0, block_rows, one_row, (w1, zeros, zeros))
        q = jax.lax.dynamic_update_slice_in_dim(q, q1, i1, axis=0)
        # Lazy batch update: every later row takes this block's errors at once (rows of this
        # block and earlier ones move too, but they are already rounded and never read).
        u_rows = jax.lax.dynamic_slice_in_dim(u, i1, block_rows, axis=0)  # [B, n]
        w = w - u_rows.T @ e1
        return w, q, scale, zero_point

    _, q, scale, zero_point = jax.lax.fori_loop(
        0, n // block_rows, rowwise, (w, jnp.zeros_like(w), scale, zero_point)
    )
    return q, scale, zero_point


def gptq_quantize(
    weight,
    hessian,
    fmt: str,
    *,
    group_size: int | None = None,
    symmetric: bool = True,
    damp: float = DEFAULT_DAMP,
    act_order: bool = False,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    name: str = "weight",
) -> QArray:
    """GPTQ-round `weight` [in, out] (quantized along axis 0) given H [in, in]; `name` is
    what a damping retry or a failure names."""
    w = jnp.asarray(weight, jnp.float32)
    if w.ndim != 2 or np.shape(hessian) != (w.shape[0], w.shape[0]):
        raise ValueError(
            f"GPTQ needs weight [in, out] and hessian [in, in]; got {w.shape} and "
            f"{np.shape(hessian)}"
        )
    spec = get_format(fmt)
    if spec.scale_dtype is None:
        raise ValueError(f"GPTQ rounds to a scaled format; {fmt} is a plain cast (use rtn)")
    n, out = w.shape
    group = _group_rows(fmt, group_size)
    h = jnp.asarray(hessian, jnp.float32)
    perm = np.arange(n)
    if act_order:
        perm = np.argsort(-np.asarray(jnp.diagonal(h)), kind="stable")
        h = h[perm][:, perm]
    u, dead, _ = damped_inverse_factor(h, damp, name=name)
    # dead rows (their input never fires) are zeroed first, so no scale is taken over them
    w = jnp.where(dead[np.argsort(perm)][:, None], 0.0, w)
    dynamic = group is not None and not act_order
    # The group table: with `dynamic` these values are placeholders, overwritten as each
    # group starts; otherwise (per channel, or act order's static groups) they are final,
    # from the original rows. nvfp4's tensor scale is always fixed here, from the whole w.
    scale, zero_point = compute_scale_zero_point(
        w, fmt, axis=0, group_size=group, symmetric=symmetric
    )
    n_groups = 1 if group is None else -(-n // group)
    block = group if dynamic else block_rows
    padded = -(-n // block) * block
    wp = jnp.zeros((padded, out), jnp.float32).at[:n].set(w[perm])
    up = jnp.eye(padded, dtype=jnp.float32).at[:n, :n].set(u)
    rows = np.full(padded, n_groups - 1, np.int32)  # padding rows: zeros, any group
    rows[:n] = perm // group if group is not None else 0
    q, scale, zero_point = _gptq_rows(
        wp, up, jnp.asarray(rows), scale, zero_point,
        fmt=spec.name, group_rows=group, block_rows=block, dynamic=dynamic,
    )  # fmt: skip
    q = q[:n][np.argsort(perm)]
    # The rounded values lie on the grid of their group's scale, so storing them with that
    # scale reproduces them exactly.
    return quantize_with_scale_zero_point(q, fmt, scale, zero_point, axis=0, group_size=group)


def gptq_weight(
    weight,
    how: TensorQuant,
    *,
    hessian=None,
    damp: float = DEFAULT_DAMP,
    act_order: bool = False,
    **_: Any,
) -> QArray:
    """The `gptq` algorithm of a plan rule; `hessian` comes from the calibration statistics."""
    if hessian is None:
        raise ValueError(
            f"{how.path}: algorithm 'gptq' needs calibration statistics (its input's Hessian); "
            "run tenantq.quant.site_inputs.site_inputs(params, plan, config, stats) and pass its "
            "inputs to apply_plan"
        )
    if how.axis != 0:
        raise ValueError(f"{how.path}: GPTQ applies to linear weights [in, out] (axis 0)")
    return gptq_quantize(
        weight, hessian, how.format, group_size=how.group_size, symmetric=how.symmetric,
        damp=damp, act_order=act_order, name=how.path,
    )  # fmt: skip
