"""Accelerator profiles (memory and bandwidth per chip) and a deployment: profile x chips.

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

# The default runtime reserve (10% of HBM, as vLLM) is the one the engine sizes its pool with.
from tenantq.quant.storage import DEFAULT_RESERVE_FRACTION

GB_S = 10**9  # bandwidth figures are decimal: GB/s


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator chip: the memory a model and its KV pool must share."""

    name: str
    hbm_bytes: int  # per chip
    hbm_bandwidth_bytes_per_s: int | None
    description: str

    def __post_init__(self) -> None:
        if not isinstance(self.hbm_bytes, int) or self.hbm_bytes <= 0:
            raise ValueError(f"hardware {self.name}: memory must be a positive byte count")


_PROFILES = (
    # Cloud TPU v5e page, "Key chip specifications": HBM2 16 GB, 819 GBps. One stack set of
    # 16 GiB; Google's TPU7x page gives its sibling chips' capacities in GiB.
    HardwareProfile("tpu-v5e", 16 * GiB, 819 * GB_S, "Cloud TPU v5e, 16 GB HBM2, 819 GB/s"),
    # Cloud TPU v5p page: HBM2e 95 GB, 2765 GBps; TPU7x page table: 95 GiB per chip.
    HardwareProfile("tpu-v5p", 95 * GiB, 2765 * GB_S, "Cloud TPU v5p, 95 GiB HBM2e, 2,765 GB/s"),
    # Cloud TPU v6e (Trillium) page: HBM capacity per chip 32 GB, bandwidth 1638 GBps;
    # TPU7x page table: 32 GiB per chip.
    HardwareProfile("tpu-v6e", 32 * GiB, 1638 * GB_S, "Cloud TPU v6e (Trillium), 32 GiB HBM"),
    # Cloud TPU7x (Ironwood) page table: HBM capacity per chip 192 GiB; bandwidth 7.37 TB/s
    # as Google's Ironwood announcement (April 2025) gives it.
    HardwareProfile("tpu-v7", 192 * GiB, 7370 * GB_S, "Cloud TPU7x (Ironwood), 192 GiB HBM"),
    # H100 SXM datasheet: 80 GB HBM3, 3.35 TB/s; nvidia-smi memory.total 81,559 MiB.
    HardwareProfile("h100-sxm", 81559 * MiB, 3350 * GB_S, "NVIDIA H100 SXM, 80 GB HBM3"),
    # H200 datasheet: 141 GB HBM3e, 4.8 TB/s; nvidia-smi memory.total 143,771 MiB.
    HardwareProfile("h200", 143771 * MiB, 4800 * GB_S, "NVIDIA H200 SXM, 141 GB HBM3e"),
    # HGX B200: 180 GB HBM3e per GPU (8 stacks, 192 GB raw), 8 TB/s; nvidia-smi
    # memory.total 183,359 MiB.
    HardwareProfile("b200", 183359 * MiB, 8000 * GB_S, "NVIDIA B200 (HGX), 180 GB HBM3e"),
)

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
        if not isinstance(self.chips, int) or isinstance(self.chips, bool) or self.chips < 1:
            raise ValueError(f"chips must be a positive integer, got {self.chips!r}")
        if not isinstance(self.page_tokens, int) or self.page_tokens < 1:
            raise ValueError(f"page_tokens must be a positive integer, got {self.page_tokens!r}")
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
