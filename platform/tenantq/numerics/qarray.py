"""`QArray`: a quantized tensor as it is held in memory, and a JAX pytree.

The arrays (data, scale, zero_point, tensor_scale) are pytree children so a QArray can
sit in a params tree and cross jax.jit; the layout (logical shape, format, axis, group)
is static aux data, so changing it recompiles instead of silently changing meaning.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from tenantq.numerics.formats import FormatSpec, get_format


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class QArray:
    """A tensor stored in format `fmt`; `dequantize(q)` gives back float32 of `shape`.

    data: the stored elements. Logical `shape` for unpacked formats (bfloat16, float16,
        float8_e4m3fn, float8_e5m2, int8); packed uint8 of shape
        `shape[:-1] + (ceil(shape[-1] / 2),)` for int4, mxfp4, nvfp4 (see packing.py).
    scale: None for bf16/fp16. Same ndim as `shape`; along `axis` its length is the number
        of groups, ceil(shape[axis] / group), every other axis is full; (1,)*ndim when
        axis is None. float32 for fp8/int; uint8 E8M0 biased exponents (2^(s-127), 255 =
        NaN) for mxfp8/mxfp4; float8_e4m3fn block scales for nvfp4.
    zero_point: int8, shaped like `scale`, only for asymmetric int8/int4; else None.
    tensor_scale: float32 scalar (shape ()) for nvfp4, else None.
    axis: the normalised quantization axis, None for one scale per tensor or for casts.
    group_size: elements per group along `axis`, None when the whole axis is one group.
    """

    data: jax.Array
    scale: jax.Array | None
    zero_point: jax.Array | None
    tensor_scale: jax.Array | None
    shape: tuple[int, ...]
    fmt: str
    axis: int | None = None
    group_size: int | None = None

    def tree_flatten(self):
        children = (self.data, self.scale, self.zero_point, self.tensor_scale)
        return children, (self.shape, self.fmt, self.axis, self.group_size)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @property
    def spec(self) -> FormatSpec:
        return get_format(self.fmt)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """True storage bytes: data + scale + zero_point + tensor_scale.

        Packed data is uint8 holding two elements per byte, so its byte count is its size;
        no array is ever stored in a sub-byte jnp dtype (whose .nbytes would count a
        4-bit element as a whole byte).
        """
        total = 0
        for array in (self.data, self.scale, self.zero_point, self.tensor_scale):
            if array is not None:
                total += _array_nbytes(array)
        return total

    def __repr__(self) -> str:
        scale = None if self.scale is None else tuple(self.scale.shape)
        return (
            f"QArray(fmt={self.fmt!r}, shape={self.shape}, axis={self.axis}, "
            f"group_size={self.group_size}, data={tuple(self.data.shape)}:{self.data.dtype}, "
            f"scale={scale}, asymmetric={self.zero_point is not None})"
        )


def _array_nbytes(array) -> int:
    # itemsize, not jnp's .nbytes: all our arrays have whole-byte dtypes (packed = uint8).
    return math.prod(array.shape) * np.dtype(array.dtype).itemsize
