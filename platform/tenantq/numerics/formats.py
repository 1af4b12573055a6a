"""The catalogue of number formats tenantq can store a tensor in.

A `FormatSpec` is the static description (element type, block, scale type, range) that
the capacity planner, the quantizers and the CLI all read; nothing here touches arrays.
Figures follow the OCP 8-bit FP spec (E4M3FN/E5M2), OCP Microscaling v1.0 (MXFP8/MXFP4)
and NVIDIA's NVFP4 (E2M1 elements, E4M3 block scale per 16, FP32 tensor scale). int2 is
KIVI's asymmetric 2-bit code (Liu et al. 2024): codes 0..3 over [min, max] of a group.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class FormatSpec:
    """What one storage format is, independent of any tensor.

    `element_dtype` is the ml_dtypes/jnp name of one element before packing; `scale_dtype`
    is None for plain casts, else "float32", "e8m0" (stored as its uint8 biased exponent)
    or "e4m3" (stored as float8_e4m3fn). `block_size` is fixed by the format (MX, nvfp4);
    `default_group_size` is the group a caller gets when it gives an axis but no group.
    """

    name: str
    element_dtype: str
    element_bits: int
    block_size: int | None
    scale_dtype: str | None
    max_finite: float
    packed: bool
    default_group_size: int | None = None
    has_tensor_scale: bool = False
    family: str = "cast"  # "cast" | "float" | "int" | "mx" | "nvfp4": which quantizer runs
    # int2: always asymmetric (scale + float32 zero point over the group's [min, max], codes
    # 0..3, as KIVI); `symmetric` is not a choice for it.
    asymmetric_only: bool = False

    @property
    def is_int(self) -> bool:
        return self.family == "int"

    @property
    def elements_per_byte(self) -> int:
        """Elements one stored byte holds: 2 for 4-bit packed formats, 4 for int2, else 1."""
        return 8 // self.element_bits if self.packed else 1

    def int_codes(self, symmetric: bool) -> tuple[int, int]:
        """(lowest, highest) stored integer code: symmetric int [-qmax, qmax], asymmetric
        [-qmax - 1, qmax], int2 [0, 3]."""
        if self.asymmetric_only:
            return 0, int(self.max_finite)
        qmax = int(self.max_finite)
        return (-qmax if symmetric else -qmax - 1), qmax

    @property
    def zero_point_bytes(self) -> int:
        """Bytes of one stored zero point: float32 for int2 (KIVI keeps the min in float),
        int8 for asymmetric int8/int4."""
        return 4 if self.asymmetric_only else 1

    @property
    def scale_bytes(self) -> int:
        """Bytes of one stored scale (0 for casts)."""
        return {None: 0, "float32": 4, "e8m0": 1, "e4m3": 1}[self.scale_dtype]


_SPECS = (
    FormatSpec("bf16", "bfloat16", 16, None, None, 3.3895313892515355e38, False),
    FormatSpec("fp16", "float16", 16, None, None, 65504.0, False),
    FormatSpec("fp8_e4m3", "float8_e4m3fn", 8, None, "float32", 448.0, False, family="float"),
    FormatSpec("fp8_e5m2", "float8_e5m2", 8, None, "float32", 57344.0, False, family="float"),
    FormatSpec("int8", "int8", 8, None, "float32", 127.0, False, family="int"),
    FormatSpec("int4", "int4", 4, None, "float32", 7.0, True, default_group_size=128, family="int"),
    FormatSpec("mxfp8", "float8_e4m3fn", 8, 32, "e8m0", 448.0, False, family="mx"),
    FormatSpec("mxfp4", "float4_e2m1fn", 4, 32, "e8m0", 6.0, True, family="mx"),
    FormatSpec(
        "nvfp4", "float4_e2m1fn", 4, 16, "e4m3", 6.0, True, has_tensor_scale=True, family="nvfp4"
    ),
    # KIVI groups 32 elements (Liu et al. 2024, sec. 4: G = 32); max_finite is the top code.
    FormatSpec(
        "int2",
        "uint8",
        2,
        None,
        "float32",
        3.0,
        True,
        default_group_size=32,
        family="int",
        asymmetric_only=True,
    ),
)

FORMATS: dict[str, FormatSpec] = {spec.name: spec for spec in _SPECS}


def get_format(name: str | FormatSpec) -> FormatSpec:
    """The spec called `name`; ValueError listing the valid names for an unknown one."""
    if isinstance(name, FormatSpec):
        return name
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        valid = ", ".join(FORMATS)
        raise ValueError(f"unknown number format {name!r}; valid formats: {valid}") from None
