"""Where the scales of a quantized tensor go and how many bytes it takes, by arithmetic.

`resolve_layout` validates (shape, format, axis, group_size, symmetric) once and fixes
the grouping; `quantize` and `storage_nbytes` both read it, which is what keeps the
capacity planner's byte counts equal to the real allocation without building arrays.
"""

from __future__ import annotations

import dataclasses
import math
import operator

from tenantq.numerics.formats import FormatSpec, get_format


def packed_length(n: int, per_byte: int = 2) -> int:
    """Bytes along the last axis that hold `n` packed values, `per_byte` to a byte (2 for
    4-bit formats, 4 for int2)."""
    return -(-n // per_byte)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static arrangement of one quantized tensor.

    `axis` is the normalised quantization axis (None: one scale for the whole tensor, or
    no scale at all for casts); groups of `group_length` elements run along it, `n_groups`
    of them, the last one possibly partial. `group_size` is what QArray records (None
    when the whole axis is one group).
    """

    spec: FormatSpec
    shape: tuple[int, ...]
    axis: int | None
    group_size: int | None
    group_length: int
    n_groups: int
    symmetric: bool

    @classmethod
    def along_axis(cls, spec, shape, axis: int, group_size: int | None, symmetric: bool):
        """Groups of `group_size` along normalised `axis` (None: the whole axis)."""
        length = shape[axis]
        if group_size is None:
            return cls(spec, shape, axis, None, length, 1, symmetric)
        n_groups = -(-length // group_size)
        group_length = group_size if n_groups > 1 else length  # one group: no padding
        return cls(spec, shape, axis, group_size, group_length, n_groups, symmetric)

    @property
    def data_shape(self) -> tuple[int, ...]:
        if self.spec.packed:
            per_byte = self.spec.elements_per_byte
            return self.shape[:-1] + (packed_length(self.shape[-1], per_byte),)
        return self.shape

    @property
    def scale_shape(self) -> tuple[int, ...] | None:
        if self.spec.scale_dtype is None:
            return None
        if self.axis is None:
            return (1,) * len(self.shape)
        return tuple(self.n_groups if i == self.axis else d for i, d in enumerate(self.shape))

    @property
    def data_nbytes(self) -> int:
        bytes_per_element = 1 if self.spec.packed else self.spec.element_bits // 8
        return math.prod(self.data_shape) * bytes_per_element

    @property
    def scale_nbytes(self) -> int:
        shape = self.scale_shape
        return 0 if shape is None else math.prod(shape) * self.spec.scale_bytes

    @property
    def zero_point_nbytes(self) -> int:
        if self.symmetric:
            return 0
        return math.prod(self.scale_shape) * self.spec.zero_point_bytes  # one per scale

    @property
    def tensor_scale_nbytes(self) -> int:
        return 4 if self.spec.has_tensor_scale else 0

    @property
    def nbytes(self) -> int:
        return (
            self.data_nbytes + self.scale_nbytes + self.zero_point_nbytes + self.tensor_scale_nbytes
        )


def _as_int(value) -> int | None:
    """`value` as a Python int if it is an integer (numpy ints included), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def resolve_layout(
    shape, fmt: str | FormatSpec, *, axis: int | None = -1, group_size=None, symmetric=True
) -> Layout:
    """Validate the arguments of `quantize` for a tensor of `shape` and fix its layout."""
    spec = get_format(fmt)
    shape = tuple(int(d) for d in shape)
    if any(d <= 0 for d in shape):
        raise ValueError(f"{spec.name}: cannot quantize an empty tensor of shape {shape}")
    if spec.packed and not shape:
        raise ValueError(f"{spec.name} packs along the last axis and needs ndim >= 1; got 0-d")
    if not symmetric and not spec.is_int:
        raise ValueError(
            f"{spec.name}: symmetric=False (zero points) exists only for int8, int4 and int2"
        )
    if spec.asymmetric_only:
        symmetric = False  # int2 is KIVI's asymmetric code: a zero point always
    if group_size is not None:
        given_group_size, group_size = group_size, _as_int(group_size)
        if group_size is None or group_size <= 0:
            raise ValueError(
                f"{spec.name}: group_size must be a positive int or None, got {given_group_size!r}"
            )

    if spec.scale_dtype is None:  # plain casts: no scale, axis irrelevant
        if group_size is not None:
            raise ValueError(f"{spec.name} is a plain cast with no scale; pass group_size=None")
        return Layout(spec, shape, None, None, 1, 1, True)

    if axis is None:
        if spec.block_size is not None:
            raise ValueError(
                f"{spec.name} scales blocks of {spec.block_size} along an axis; "
                f"axis=None (one scale per tensor) is not allowed, pass axis=-1 or another axis"
            )
        if group_size is not None:
            raise ValueError(
                f"{spec.name}: group_size={group_size} needs an axis to group along; "
                f"pass axis=k or group_size=None for one scale per tensor"
            )
        return Layout(spec, shape, None, None, math.prod(shape), 1, symmetric)

    ndim = len(shape)
    if ndim == 0:
        raise ValueError(f"{spec.name}: a 0-d tensor has no axis {axis!r}; pass axis=None")
    given_axis, axis = axis, _as_int(axis)
    if axis is None or not -ndim <= axis < ndim:
        raise ValueError(
            f"{spec.name}: axis={given_axis!r} is out of range for a {ndim}-d tensor of shape "
            f"{shape}; pass an int in [{-ndim}, {ndim - 1}] or None"
        )
    axis = axis % ndim
    if spec.block_size is not None:
        if group_size not in (None, spec.block_size):
            raise ValueError(
                f"{spec.name} fixes its block at {spec.block_size} elements; "
                f"pass group_size=None or {spec.block_size}, not {group_size}"
            )
        group_size = spec.block_size
    elif group_size is None:
        group_size = spec.default_group_size
    return Layout.along_axis(spec, shape, axis, group_size, symmetric)


def storage_nbytes(
    shape, fmt: str | FormatSpec, *, axis: int | None = -1, group_size=None, symmetric=True
) -> int:
    """True bytes `quantize(x, fmt, ...)` stores for an x of `shape`, without any array.

    data (a packed byte holds two elements) + scales + zero points + tensor scale.
    """
    layout = resolve_layout(shape, fmt, axis=axis, group_size=group_size, symmetric=symmetric)
    return layout.nbytes


def effective_bits(
    shape, fmt: str | FormatSpec, *, axis: int | None = -1, group_size=None, symmetric=True
) -> float:
    """Stored bits per logical element: 8 * storage_nbytes / numel."""
    nbytes = storage_nbytes(shape, fmt, axis=axis, group_size=group_size, symmetric=symmetric)
    return 8.0 * nbytes / math.prod(tuple(int(d) for d in shape))
