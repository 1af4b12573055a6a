"""Element codecs: float32 values in, stored element codes out, and back.

Casts saturate (clip to the format's largest finite value first) because jnp/ml_dtypes
turn an out-of-range float into NaN for E4M3FN and inf for fp16. E2M1 and E8M0 are
done with explicit integer arithmetic so the codes are exact and portable; XLA on CPU
flushes float32 subnormals to zero, so power-of-two scalings are split to stay normal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# OCP MX v1.0, section 5.3.3: FP4 E2M1 magnitudes for codes 0..7 (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_TABLE = np.array(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=np.float32)
# Midpoints between neighbouring magnitudes. Round half to even: a tie goes to the code
# whose mantissa bit (bit 0) is 0, so a tie at an odd->even step rounds up (>=) and at
# an even->odd step stays down (>).
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False))
_E2M1_MIDPOINTS += ((3.5, True), (5.0, False))

E8M0_BIAS = 127  # OCP MX v1.0, 5.4.1: value 2^(bits - 127); 0xFF is NaN.
E8M0_NAN = 255


def saturating_cast(y: jax.Array, dtype: str, max_finite: float) -> jax.Array:
    """Clip float32 `y` to +-max_finite, then cast (round to nearest even) to `dtype`."""
    return jnp.clip(y, -max_finite, max_finite).astype(jnp.dtype(dtype))


def encode_e2m1(y: jax.Array) -> jax.Array:
    """E2M1 codes (uint8, 0..15) of float32 `y`: round half to even, saturate at +-6.

    The sign bit is y's sign bit, so a negative value that rounds to zero (and -0.0
    itself) gets the -0 code 8, as ml_dtypes' float4_e2m1fn cast and fp8 casts store it.
    """
    magnitude = jnp.abs(y)
    code = jnp.zeros(y.shape, jnp.uint8)
    for midpoint, tie_goes_up in _E2M1_MIDPOINTS:
        above = magnitude >= midpoint if tie_goes_up else magnitude > midpoint
        code = code + above.astype(jnp.uint8)
    return code | (jnp.signbit(y).astype(jnp.uint8) << 3)


def decode_e2m1(codes: jax.Array) -> jax.Array:
    """Float32 values of E2M1 codes (uint8, low 4 bits used)."""
    return jnp.asarray(_E2M1_TABLE)[(codes & 0xF).astype(jnp.int32)]


def floor_log2(x: jax.Array) -> jax.Array:
    """floor(log2(x)) as int32 for positive normal float32 `x`, read from the exponent bits.

    Zero and subnormals give -127 (every caller clamps below that); inf/NaN give 128.
    """
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return ((bits >> 23) & 0xFF) - 127


def pow2(exponent: jax.Array) -> jax.Array:
    """2^exponent as float32 for int exponents in [-126, 127] (built from the bits)."""
    bits = (exponent.astype(jnp.int32) + 127) << 23
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def scale_by_e8m0(values: jax.Array, e8m0: jax.Array) -> jax.Array:
    """values * 2^(e8m0 - 127), NaN where the scale code is 0xFF.

    2^-127 (code 0) is a float32 subnormal that XLA:CPU reads as zero, so code 0 is
    applied as 2^-1 * 2^-126; every other code is a normal power of two and exact.
    """
    code = e8m0.astype(jnp.int32)
    exponent = jnp.maximum(code - E8M0_BIAS, -126)
    half = jnp.where(code == 0, jnp.float32(0.5), jnp.float32(1.0))
    out = (values * half) * pow2(jnp.minimum(exponent, 127))
    return jnp.where(code == E8M0_NAN, jnp.float32(jnp.nan), out)


def e8m0_code_at_least(x: jax.Array) -> jax.Array:
    """uint8 E8M0 codes of the smallest power of two >= float32 `x` > 0 (a scale rounded *up*,
    so nothing scaled by it clips), clamped to [0, 254] (2^-127..2^127); inf/NaN give 0xFF.

    The OCP MX v1.0 scale type (sec. 5.4.1); MX itself derives its code from floor(log2
    amax) (sec. 6.3), this rounds a given scale instead (the KV pool's E8M0 page scales).
    """
    x = jnp.asarray(x, jnp.float32)
    exponent = floor_log2(x)
    below = pow2(jnp.clip(exponent, -126, 127)) < x  # x is not a power of two: one up
    code = jnp.clip(exponent + below.astype(jnp.int32), -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    return jnp.where(jnp.isfinite(x), code, E8M0_NAN).astype(jnp.uint8)


def e8m0_to_float32(e8m0) -> np.ndarray:
    """The scales 2^(code-127) as a numpy float32 array (code 0: 2^-127; 0xFF: NaN).

    Computed on the host with numpy, which keeps subnormals; inside jit use `scale_by_e8m0`.
    """
    code = np.asarray(e8m0).astype(np.int64)
    nan = code == E8M0_NAN
    # 2^128 overflows float32: the NaN code is given a finite exponent before ldexp (no
    # overflow warning), then replaced.
    exponent = (np.where(nan, E8M0_BIAS, code) - E8M0_BIAS).astype(np.int32)
    out = np.ldexp(np.float32(1.0), exponent).astype(np.float32)
    return np.where(nan, np.float32(np.nan), out)
