"""Accelerator profiles (memory, bandwidth and peak matmul rate per chip) and a deployment.

Each figure cites its source. TPU capacities are Google's, which its TPU7x page states in
GiB; NVIDIA capacities are what `nvidia-smi` reports as `memory.total` (the memory a
process can be given), not the rounder datasheet figure, which is kept in the description.
A `Deployment` adds what the budget needs besides the chip: tensor-parallel degree, the
KV page size and the runtime reserve.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from tenantq.capacity.units import GiB, MiB, exact_bytes, human_bytes, parse_bytes, parse_reserve
from tenantq.model.checks import check_positive_int

# The default runtime reserve (10% of HBM, as vLLM) is the one the engine sizes its pool with.
from tenantq.storage.pool import DEFAULT_RESERVE_FRACTION

GB_S = 10**9  # bandwidth figures are decimal: GB/s
TFLOP_S = 10**12  # peak matmul rates are decimal too: TFLOP/s (TOP/s for int8)
# The compute formats a matmul can run in: bf16 (weight-only formats dequantize to it),
# int8 and fp8 (W8A8 / W4A8 with int8 or fp8 activations).
COMPUTE_FORMATS = ("bf16", "int8", "fp8")
# Weight passes XLA:CPU runs before a dot (`HardwareProfile.shape_rates`): conversion to a bf16
# copy (a batch) or a float32 copy (one row), the batched bf16 dot's packing of its weight,
# and W4A8's unpacking of int4 nibbles to 8-bit codes (a batch; one row). "grouped" is not a
# pass but W4A8's grouped int8 product, in FLOP/s: XLA:CPU runs it far below a plain int8
# dot's peak, and a CPU profile that has it charges W4A8's FLOPs at it, after the unpack.
CPU_PASSES = ("convert", "convert_b1", "pack", "unpack", "unpack_b1", "grouped")


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator chip: the memory a model and its KV pool must share."""

    name: str
    hbm_bytes: int  # per chip
    hbm_bandwidth_bytes_per_s: int | None
    description: str
    # Dense peak matmul rate per chip and compute format (FLOP/s; OP/s for int8); None where
    # the vendor gives no figure for that format (the step model then runs it at bf16's).
    peak_bf16_flops_per_s: int | None = None
    peak_int8_ops_per_s: int | None = None
    peak_fp8_flops_per_s: int | None = None
    # Where a matmul converts its weight in a pass of its own before multiplying (XLA:CPU),
    # the weight elements per second of that pass, per stored format; empty on accelerators,
    # whose kernels dequantize in registers, hidden under the bytes. XLA:CPU has two paths:
    # a batched product (more than one row) runs a native bf16 dot on a bf16 copy that a
    # loop fusion dequantizes from int8/int4 first (a bf16 weight: no pass), and a one-row
    # product converts every weight, bf16 included, to a float32 copy for a float32
    # matrix-vector dot (`convert_b1_elements_per_s`). The dot then reads the copy (2 or 4
    # bytes per element), not the stored bytes. A format absent from a table has no pass
    # (see also `dot_pack_elements_per_s`).
    convert_elements_per_s: tuple[tuple[str, float], ...] = ()
    convert_b1_elements_per_s: tuple[tuple[str, float], ...] = ()
    # XLA:CPU's batched bf16 dot (YNNPACK) packs its weight operand into its own layout at
    # every call, a pass over every weight element before the products: elements/s of it.
    dot_pack_elements_per_s: float | None = None
    # The same passes by weight shape (XLA:CPU's rates differ between shapes of one model,
    # e.g. packing [2816, 1024] runs at ~60% of [1024, 2816]'s): (pass, format, shape one chip
    # stores, elements/s); shape () is that pass's rate for any shape not listed. Passes:
    # `CPU_PASSES`; "unpack" is W4A8's int4 nibbles to 8-bit codes before an int8 dot (its
    # format: the stored one, int4). Looked up by `pass_rate`, before the tables above.
    shape_rates: tuple[tuple[str, str, tuple[int, ...], float], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.hbm_bytes, int) or self.hbm_bytes <= 0:
            raise ValueError(f"hardware {self.name}: memory must be a positive byte count")
        for fmt in COMPUTE_FORMATS:
            value = self.peak_for(fmt)
            if value is not None and (isinstance(value, bool) or value <= 0):
                raise ValueError(f"hardware {self.name}: peak {fmt} rate must be positive")
        passes = [*self.convert_elements_per_s, *self.convert_b1_elements_per_s]
        if self.dot_pack_elements_per_s is not None:
            passes.append(("dot packing", self.dot_pack_elements_per_s))
        for kind, fmt, shape, rate in self.shape_rates:
            if kind not in CPU_PASSES:
                raise ValueError(
                    f"hardware {self.name}: shape_rates pass {kind!r} is unknown; valid: "
                    f"{', '.join(CPU_PASSES)}"
                )
            if not isinstance(shape, tuple) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape
            ):
                raise ValueError(
                    f"hardware {self.name}: shape_rates shape {shape!r} must be a tuple of "
                    "positive ints (() for any shape)"
                )
            passes.append((f"{kind} {fmt} {shape}", rate))
        for what, rate in passes:  # a zero rate divides by zero; leave a free pass out
            if isinstance(rate, bool) or not 0 < rate < float("inf"):
                raise ValueError(
                    f"hardware {self.name}: {what} pass rate {rate!r} must be a positive, "
                    "finite rate (elements/s); leave out a format that has no pass"
                )

    def pass_rate(self, kind: str, fmt: str, shape: tuple[int, ...]) -> float | None:
        """Elements/s of XLA:CPU's `kind` pass (`CPU_PASSES`) over a `fmt` weight that one chip
        stores as `shape`: that shape's measured rate, else the pass's any-shape rate, else the
        per-format tables (`convert_elements_per_s`, `convert_b1_elements_per_s`,
        `dot_pack_elements_per_s` for a bf16 dot's packing); None where there is no pass."""
        exact = anyshape = None
        for k, f, s, rate in self.shape_rates:
            if (k, f) == (kind, fmt):
                if s == tuple(shape):
                    exact = rate
                elif s == ():
                    anyshape = rate
        if exact is not None or anyshape is not None:
            return exact if exact is not None else anyshape
        if kind == "convert":
            return dict(self.convert_elements_per_s).get(fmt)
        if kind == "convert_b1":
            return dict(self.convert_b1_elements_per_s).get(fmt)
        if kind == "pack" and fmt == "bf16":
            return self.dot_pack_elements_per_s
        return None

    def peak_for(self, compute_format: str) -> int | float | None:
        """The vendor's dense peak for `compute_format` (bf16, int8, fp8), or None."""
        if compute_format not in COMPUTE_FORMATS:
            raise ValueError(
                f"unknown compute format {compute_format!r}; valid: {', '.join(COMPUTE_FORMATS)}"
            )
        suffix = "ops_per_s" if compute_format == "int8" else "flops_per_s"
        return getattr(self, f"peak_{compute_format}_{suffix}")


# Peak rates are dense (no 2:4 sparsity): NVIDIA's datasheets print Tensor Core figures
# "with sparsity", which are twice the dense rate, so they are halved here.
_PROFILES = (
    # Cloud TPU v5e page, "Key chip specifications": HBM2 16 GB, 819 GBps (2 stacks; the
    # newer spec table's "800 GiBps" is not used). Peak per chip: bf16 197 TFLOPs, Int8 393
    # TOPs. No fp8 figure: fp8 matmuls run at the bf16 rate. One stack set of 16 GiB;
    # Google's TPU7x page gives its sibling chips' capacities in GiB.
    HardwareProfile(
        "tpu-v5e", 16 * GiB, 819 * GB_S, "Cloud TPU v5e, 16 GB HBM2, 819 GB/s",
        peak_bf16_flops_per_s=197 * TFLOP_S, peak_int8_ops_per_s=393 * TFLOP_S,
    ),
    # Cloud TPU v5p page: HBM2e 95 GB, 2765 GBps; TPU7x page table: 95 GiB per chip, BF16
    # 459 TFLOPs and FP8 459 TFLOPs (fp8 at the bf16 rate). Int8 918 TOPS per chip: Google
    # Cloud's v5p launch post ("Introducing Cloud TPU v5p and AI Hypercomputer", 6 Dec 2023:
    # 459 teraFLOPS bf16 or 918 teraOPS int8); the docs' tables give no int8 figure.
    HardwareProfile(
        "tpu-v5p", 95 * GiB, 2765 * GB_S, "Cloud TPU v5p, 95 GiB HBM2e, 2,765 GB/s",
        peak_bf16_flops_per_s=459 * TFLOP_S, peak_int8_ops_per_s=918 * TFLOP_S,
        peak_fp8_flops_per_s=459 * TFLOP_S,
    ),
    # Cloud TPU v6e (Trillium) page: HBM capacity per chip 32 GB, bandwidth 1638 GBps; peak
    # per chip bf16 918 TFLOPs, Int8 1836 TOPs; TPU7x page table: 32 GiB per chip, FP8 918
    # TFLOPs (the bf16 rate).
    HardwareProfile(
        "tpu-v6e", 32 * GiB, 1638 * GB_S, "Cloud TPU v6e (Trillium), 32 GiB HBM",
        peak_bf16_flops_per_s=918 * TFLOP_S, peak_int8_ops_per_s=1836 * TFLOP_S,
        peak_fp8_flops_per_s=918 * TFLOP_S,
    ),
    # Cloud TPU7x (Ironwood) page table: HBM capacity per chip 192 GiB; peak per chip BF16
    # 2307 TFLOPs, FP8 4614 TFLOPs (no Int8 figure), HBM bandwidth per chip 7380 GBps (the
    # same table; Google's April 2025 announcement rounds it to 7.37 TB/s).
    HardwareProfile(
        "tpu-v7", 192 * GiB, 7380 * GB_S, "Cloud TPU7x (Ironwood), 192 GiB HBM",
        peak_bf16_flops_per_s=2307 * TFLOP_S, peak_fp8_flops_per_s=4614 * TFLOP_S,
    ),
    # H100 SXM datasheet: 80 GB HBM3, 3.35 TB/s; nvidia-smi memory.total 81,559 MiB. Tensor
    # Core (with sparsity): BF16 1,979 TFLOPS, FP8 3,958 TFLOPS, INT8 3,958 TOPS; dense =
    # half: 989.4 / 1,978.9 / 1,978.9 (the Hopper whitepaper's dense table).
    HardwareProfile(
        "h100-sxm", 81559 * MiB, 3350 * GB_S, "NVIDIA H100 SXM, 80 GB HBM3",
        peak_bf16_flops_per_s=989_400 * 10**9, peak_int8_ops_per_s=1_978_900 * 10**9,
        peak_fp8_flops_per_s=1_978_900 * 10**9,
    ),
    # H200 datasheet: 141 GB HBM3e, 4.8 TB/s; nvidia-smi memory.total 143,771 MiB. The same
    # GH100 compute as H100 SXM (datasheet, with sparsity: BF16 1,979 TFLOPS, FP8 3,958,
    # INT8 3,958 TOPS): dense 989.4 / 1,978.9 / 1,978.9.
    HardwareProfile(
        "h200", 143771 * MiB, 4800 * GB_S, "NVIDIA H200 SXM, 141 GB HBM3e",
        peak_bf16_flops_per_s=989_400 * 10**9, peak_int8_ops_per_s=1_978_900 * 10**9,
        peak_fp8_flops_per_s=1_978_900 * 10**9,
    ),
    # HGX B200 datasheet, per GPU: 180 GB HBM3e at 7.7 TB/s (the earlier 192 GB / 8 TB/s
    # figure is the 8-stack raw part); nvidia-smi memory.total 183,359 MiB. Tensor Core
    # (with sparsity): FP16/BF16 4.5 PFLOPS, FP8 9 PFLOPS, INT8 9 POPS; dense = half.
    HardwareProfile(
        "b200", 183359 * MiB, 7700 * GB_S, "NVIDIA B200 (HGX), 180 GB HBM3e, 7.7 TB/s",
        peak_bf16_flops_per_s=2250 * TFLOP_S, peak_int8_ops_per_s=4500 * TFLOP_S,
        peak_fp8_flops_per_s=4500 * TFLOP_S,
    ),
)  # fmt: skip

HARDWARE: dict[str, HardwareProfile] = {p.name: p for p in _PROFILES}
_ALIASES = {"tpu-v7x": "tpu-v7", "ironwood": "tpu-v7", "trillium": "tpu-v6e", "h100": "h100-sxm"}


def hardware_names() -> list[str]:
    return [*HARDWARE, "cpu"]


def get_hardware(name: str, *, memory_bytes: int | str | None = None) -> HardwareProfile:
    """The profile called `name`; `cpu` needs `memory_bytes` (or is spelled `cpu:64GiB`)."""
    key = str(name).strip().lower()
    if key.startswith("cpu:"):
        key, memory_bytes = "cpu", key[4:]
    if key == "cpu":
        if memory_bytes is None:
            raise ValueError("hardware cpu needs a memory size: --memory 64GiB (or cpu:64GiB)")
        size = parse_bytes(memory_bytes, what="cpu memory")
        if size <= 0:
            raise ValueError("cpu memory must be positive")
        return HardwareProfile("cpu", size, None, f"host memory {human_bytes(size)}")
    key = _ALIASES.get(key, key)
    if key not in HARDWARE:
        raise ValueError(
            f"unknown hardware {name!r}; valid: {', '.join(hardware_names())} "
            "(cpu with a memory size)"
        )
    if memory_bytes is not None:
        have = human_bytes(HARDWARE[key].hbm_bytes)
        raise ValueError(f"a memory size applies to cpu only; {key} has {have} per chip")
    return HARDWARE[key]


@dataclass(frozen=True)
class Reserve:
    """Memory per chip kept back from the KV pool: a fraction of HBM or a fixed byte count."""

    fraction: Fraction | None = None
    fixed_bytes: int | None = None

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.fixed_bytes is None):
            raise ValueError("a reserve is either a fraction of HBM or a byte count")
        if self.fraction is not None and not 0 <= self.fraction < 1:
            raise ValueError(f"reserve fraction must be in [0, 1), got {float(self.fraction)}")
        if self.fixed_bytes is not None and self.fixed_bytes < 0:
            raise ValueError("reserve bytes must not be negative")

    def bytes_for(self, hbm_bytes: int) -> int:
        if self.fixed_bytes is not None:
            return self.fixed_bytes
        return int(self.fraction * hbm_bytes)  # floor: the fraction is exact (a Fraction)

    def describe(self) -> str:
        if self.fixed_bytes is not None:
            return f"fixed {exact_bytes(self.fixed_bytes)} B"
        pct = float(self.fraction * 100)
        label = f"{pct:g}% of HBM"
        return label + (", default" if self.fraction == DEFAULT_RESERVE_FRACTION else "")

    @classmethod
    def parse(cls, value: Reserve | str | int | float | None = None) -> Reserve:
        """`None` -> the default; a Python int -> that many bytes; text (or a float) in one
        of three forms (`units.parse_reserve`): a fraction below 1 (`0.1`), a percentage
        (`"10%"`) or bytes with a unit (`"4GiB"`); a bare `"1"` or `"4096"` is an error."""
        if value is None:
            return cls(fraction=DEFAULT_RESERVE_FRACTION)
        if isinstance(value, Reserve):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(fixed_bytes=value)
        fraction, fixed_bytes = parse_reserve(str(value))
        return cls(fraction=fraction, fixed_bytes=fixed_bytes)


@dataclass(frozen=True)
class Deployment:
    """`chips` chips of one profile serving one model copy with tensor parallelism = chips."""

    hardware: HardwareProfile
    chips: int = 1
    page_tokens: int = 16
    reserve: Reserve = field(default_factory=Reserve.parse)

    def __post_init__(self) -> None:
        check_positive_int("chips", self.chips)
        check_positive_int("page_tokens", self.page_tokens)
        object.__setattr__(self, "reserve", Reserve.parse(self.reserve))

    @property
    def reserve_bytes_per_chip(self) -> int:
        return self.reserve.bytes_for(self.hardware.hbm_bytes)

    @classmethod
    def of(
        cls,
        hardware: str | HardwareProfile,
        chips: int = 1,
        *,
        memory_bytes: int | str | None = None,
        page_tokens: int = 16,
        reserve: Reserve | str | int | float | None = None,
    ) -> Deployment:
        profile = (
            hardware
            if isinstance(hardware, HardwareProfile)
            else get_hardware(hardware, memory_bytes=memory_bytes)
        )
        return cls(profile, chips, page_tokens, Reserve.parse(reserve))
