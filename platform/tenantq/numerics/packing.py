"""Two 4-bit values per byte (int4, mxfp4, nvfp4) or four 2-bit codes per byte (int2).

Packing runs along the LAST axis: element 2i goes to the low nibble of byte i and element
2i+1 to its high nibble; an odd length gets one zero nibble of padding. int4 nibbles are
two's complement and sign-extended on unpack; fp4 nibbles are E2M1 codes (sign bit 3).
int2 codes (0..3) go four to a byte, element 4i + j in bits 2j..2j+1, zero-padded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tenantq.numerics.layout import packed_length


def pack_nibbles(nibbles) -> jax.Array:
    """Pack uint8 values 0..15 along the last axis into uint8 bytes (low nibble first)."""
    nibbles = jnp.asarray(nibbles)
    if nibbles.ndim == 0:
        raise ValueError("packing needs at least one axis; got a 0-d array")
    return _pack_jit(nibbles)


def unpack_nibbles(packed, n: int) -> jax.Array:
    """uint8 nibbles (0..15) of the first `n` packed values along the last axis."""
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise ValueError(f"packed data must be uint8, got {packed.dtype}")
    if packed.ndim == 0 or packed.shape[-1] != packed_length(n):
        got = "a 0-d array" if packed.ndim == 0 else f"last axis {packed.shape[-1]}"
        raise ValueError(
            f"n={n} values need a last axis of {packed_length(n)} packed bytes; got {got}"
        )
    return _unpack_jit(packed, int(n))


@jax.jit
def _pack_jit(nibbles):
    nibbles = nibbles.astype(jnp.uint8) & 0xF
    if nibbles.shape[-1] % 2:
        nibbles = jnp.pad(nibbles, [(0, 0)] * (nibbles.ndim - 1) + [(0, 1)])
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


@functools.partial(jax.jit, static_argnums=1)
def _unpack_jit(packed, n: int):
    both = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    return both.reshape(packed.shape[:-1] + (2 * packed.shape[-1],))[..., :n]


def _check_range(values, lo: int, hi: int, what: str) -> None:
    """Eagerly reject out-of-range values; inside jit the nibble mask applies silently."""
    if isinstance(values, jax.core.Tracer):
        return
    arr = np.asarray(values)
    if arr.size and (arr.min() < lo or arr.max() > hi):
        raise ValueError(f"{what} must lie in [{lo}, {hi}]; got min {arr.min()}, max {arr.max()}")


def pack_int4(values) -> jax.Array:
    """Pack signed ints in [-8, 7] two per byte along the last axis (two's complement).

    Example: [-8, 7, -1, 0] -> bytes [0x78, 0x0F]. Eager calls reject values out of range;
    under jit each value is taken modulo 16 (its low 4 bits).
    """
    _check_range(values, -8, 7, "int4 values")
    return pack_nibbles(values)  # int -> uint8 conversion keeps the two's complement bits


def unpack_int4(packed, n: int) -> jax.Array:
    """int8 values of the first `n` int4 elements along the last axis, sign-extended."""
    return sign_extend_int4(unpack_nibbles(packed, n))


@jax.jit
def sign_extend_int4(nibbles):
    """int8 values of two's complement 4-bit nibbles (uint8 0..15): 0xF -> -1, 0x8 -> -8."""
    return (nibbles.astype(jnp.int8) ^ 8) - 8


def pack_fp4(codes) -> jax.Array:
    """Pack E2M1 codes (0..15: sign bit 3, exponent bits 2-1, mantissa bit 0) two per byte."""
    _check_range(codes, 0, 15, "fp4 codes")
    return pack_nibbles(codes)


def unpack_fp4(packed, n: int) -> jax.Array:
    """uint8 E2M1 codes (0..15) of the first `n` fp4 elements along the last axis."""
    return unpack_nibbles(packed, n)


def pack_int2(codes) -> jax.Array:
    """Pack int2 codes (0..3) four per byte along the last axis: element 4i + j in bits
    2j..2j+1 of byte i; a length not divisible by 4 is padded with zero codes.

    Example: [1, 2, 3, 0, 3] -> bytes [0b00_11_10_01, 0b00_00_00_11] = [0x39, 0x03]."""
    codes = jnp.asarray(codes)
    if codes.ndim == 0:
        raise ValueError("packing needs at least one axis; got a 0-d array")
    _check_range(codes, 0, 3, "int2 codes")
    return _pack2_jit(codes)


def unpack_int2(packed, n: int) -> jax.Array:
    """uint8 int2 codes (0..3) of the first `n` packed values along the last axis."""
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise ValueError(f"packed data must be uint8, got {packed.dtype}")
    if packed.ndim == 0 or packed.shape[-1] != packed_length(n, 4):
        got = "a 0-d array" if packed.ndim == 0 else f"last axis {packed.shape[-1]}"
        raise ValueError(
            f"n={n} int2 values need a last axis of {packed_length(n, 4)} packed bytes; got {got}"
        )
    return _unpack2_jit(packed, int(n))


@jax.jit
def _pack2_jit(codes):
    codes = codes.astype(jnp.uint8) & 0x3
    pad = -codes.shape[-1] % 4
    if pad:
        codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, pad)])
    return (
        codes[..., 0::4]
        | (codes[..., 1::4] << 2)
        | (codes[..., 2::4] << 4)
        | (codes[..., 3::4] << 6)
    )


@functools.partial(jax.jit, static_argnums=1)
def _unpack2_jit(packed, n: int):
    parts = jnp.stack([(packed >> shift) & 0x3 for shift in (0, 2, 4, 6)], axis=-1)
    return parts.reshape(packed.shape[:-1] + (4 * packed.shape[-1],))[..., :n]
