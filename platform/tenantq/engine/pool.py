"""Host half of the paged KV pool: sequences, slots, tenants and the block tables.

`PagedPool` is the engine's default `KVCache`. Its arrays are allocated from the plan's
`LayerKVStorage` (the description the capacity planner counts from) and `kv_report` reads
the bytes back from the real arrays. Pages are granted on demand as a sequence grows
(`make_room` before each step), through `PageAllocator`'s tenant quotas; a refusal is a
`PoolExhausted`, a sequence whose pages were taken by another tenant's guarantee raises
`SequencePreempted` at its next step. Unless told its size, the pool takes the memory its
device has left after the weights and the runtime reserve (`device_memory_bytes`). A plan with
static (tensor/head) KV axes needs `kv_scales` (calibrated: `tenantq.quant.kv_calibration`);
`kv_clip_report` says what share of the written elements those scales clipped.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tenantq.engine.allocator import DEFAULT_TENANT, PageAllocator, PoolExhausted
from tenantq.engine.cache import CacheFull
from tenantq.engine.paged import PagedLayout, layout_nbytes
from tenantq.model.checks import check_positive_int
from tenantq.model.config import ModelConfig
from tenantq.quant.kv_calibration import KVScales
from tenantq.quant.plan import LayerKV, QuantPlan
from tenantq.storage.kv import kv_storage, layer_bytes_row
from tenantq.storage.pool import (
    DEFAULT_RESERVE_FRACTION,
    kv_sums,
    pages_that_fit,
    pool_bytes_left,
)

__all__ = [
    "CPU_MEMORY_FRACTION",
    "PagedPool",
    "PoolExhausted",
    "SequencePreempted",
    "device_memory_bytes",
]

# JAX on CPU has no device memory of its own: it shares the host's RAM with the OS and every
# other process. The engine takes this fraction of physical memory as its "device" (weights
# and reserve come out of it too); pass `pool_bytes` or `num_pages` to size the pool exactly.
CPU_MEMORY_FRACTION = Fraction(1, 2)


class SequencePreempted(CacheFull):
    """A sequence lost its pages to another tenant's guarantee; release it and retry."""


def device_memory_bytes(device=None) -> tuple[int, str]:
    """(bytes, where the figure comes from) of the memory one device offers the engine.

    An accelerator reports its allocator's `bytes_limit` (`Device.memory_stats()`); a CPU
    device is `CPU_MEMORY_FRACTION` of the host's physical memory.
    """
    device = device or jax.local_devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if stats.get("bytes_limit"):
            return int(stats["bytes_limit"]), f"{device.device_kind} memory (bytes_limit)"
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(physical * CPU_MEMORY_FRACTION), (
        f"{CPU_MEMORY_FRACTION} of the host's {physical:,} bytes of physical memory (CPU)"
    )


class PagedPool:
    """`KVCache` over one pool of `num_pages` pages of `page_tokens` tokens per layer.

    Options: `page_tokens` (16); `max_seqs` (16, live sequences, each holding one slot);
    `max_seq_tokens` (the model's context by default); and the size, one of
    - `num_pages`: exactly that many pages in every layer;
    - `pool_bytes`: as many pages as fit once the `max_seqs` slots' residual and sink
      buffers are paid for (bytes per device under tensor parallelism);
    - neither: the device's memory (`device_memory_bytes`) less `weights_bytes` and a 10%
      reserve, capped at what `max_seqs` sequences of `max_seq_tokens` can use; an error
      naming the figures when not one such sequence fits.
    `tp` is the tensor-parallel degree: arrays are allocated whole and sharded by KV head,
    so each device holds the bytes of `kv_storage(..., tp=tp)`. `kv_scales` (a
    `tenantq.quant.kv_calibration.KVScales`) gives the static scales of tensor/head axes.
    """

    def __init__(
        self,
        config: ModelConfig,
        plan: QuantPlan | None = None,
        *,
        dtype: str = "bfloat16",
        page_tokens: int = 16,
        num_pages: int | None = None,
        pool_bytes: int | None = None,
        max_seqs: int = 16,
        max_seq_tokens: int | None = None,
        weights_bytes: int = 0,
        tp: int = 1,
        kv_scales: KVScales | None = None,
    ):
        plan = plan or QuantPlan()
        if plan.needs_kv_scales and kv_scales is None:
            raise ValueError(
                "the plan's KV uses static scales (key_axis/value_axis 'tensor' or 'head'); "
                "pass kv_scales=tenantq.quant.kv_calibration.kv_static_scales(model_path, plan)"
            )
        check_positive_int("page_tokens", page_tokens, numpy_ints=True)
        check_positive_int("max_seqs", max_seqs, numpy_ints=True)
        tokens = config.max_position_embeddings if max_seq_tokens is None else max_seq_tokens
        check_positive_int("max_seq_tokens", tokens, numpy_ints=True)
        if tokens > config.max_position_embeddings:
            raise ValueError(
                f"max_seq_tokens={tokens} exceeds the model's context "
                f"({config.max_position_embeddings} tokens)"
            )
        max_pages = -(-tokens // page_tokens)
        if num_pages is not None and pool_bytes is not None:
            raise ValueError("pass num_pages or pool_bytes, not both")
        store = "float32" if jnp.dtype(dtype) == jnp.float32 else "bfloat16"
        per_device = kv_storage(config, plan, page_tokens, tp=tp, store_dtype=store)
        self.sized_by = "num_pages"
        if pool_bytes is not None:
            if isinstance(pool_bytes, bool) or not isinstance(pool_bytes, int | np.integer):
                raise ValueError(
                    f"pool_bytes must be a whole number of bytes, got {pool_bytes!r}; "
                    "for '2GiB'-style sizes use tenantq.capacity.parse_bytes('2GiB')"
                )
            num_pages = pages_that_fit(per_device, int(pool_bytes), max_seqs)
            self.sized_by = f"pool_bytes={int(pool_bytes):,}"
        elif num_pages is None:
            num_pages = self._pages_from_memory(per_device, max_seqs, tokens, weights_bytes)
        check_positive_int("num_pages", num_pages, numpy_ints=True)
        self.layout = PagedLayout(
            num_pages=int(num_pages),
            max_seqs=max_seqs,
            max_pages=max_pages,
            layers=kv_storage(config, plan, page_tokens, store_dtype=store),
            dtype=str(jnp.dtype(dtype)),
        )
        self.storage_per_device = per_device
        self.state = self._with_static_scales(self.layout.init_state(), kv_scales)
        self.kv_scales = kv_scales
        self.max_seqs, self.max_seq_tokens, self.page_tokens = max_seqs, tokens, page_tokens
        self.num_pages = int(num_pages)
        self.allocator = PageAllocator(self.num_pages, page_tokens)
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._slot: dict[int, int] = {}  # live sequence id -> slot
        self._tokens: dict[int, int] = {}  # tokens the next step leaves in the sequence
        self._preempted: set[int] = set()
        self._next_id = 0

    def _with_static_scales(self, state, kv_scales):
        """`state` with each static tensor's calibrated scale (and int2 zero point) written."""
        if kv_scales is None:
            return state
        out = []
        for storage, arrays in zip(self.layout.layers, state, strict=True):
            layer = dict(arrays)
            for name, spec in storage.tensors:
                if not spec.static:
                    continue
                scale, zp = kv_scales.for_tensor(storage.layer, name, spec)
                want = arrays[name]["static_scale"].shape
                if np.size(scale) != np.prod(want):
                    raise ValueError(
                        f"kv_scales give {np.size(scale)} {name} scales for layer "
                        f"{storage.layer} (axis {spec.axis!r}); this model needs "
                        f"{int(np.prod(want))}: calibrate on this model"
                    )
                tensor = dict(arrays[name])
                tensor["static_scale"] = jnp.asarray(scale, jnp.float32).reshape(want)
                if "static_zero_point" in tensor:
                    tensor["static_zero_point"] = jnp.asarray(zp, jnp.float32).reshape(want)
                layer[name] = tensor
            out.append(layer)
        return tuple(out)

    def kv_clip_report(self) -> list[dict]:
        """Per static (tensor/head) KV tensor: elements written, elements clipped at the
        format's range under the calibrated scale, and their ratio (`clip_rate`)."""
        rows = []
        per_token = self.layout.kv_heads * self.layout.head_dim
        for storage, arrays in zip(self.layout.layers, self.state, strict=True):
            for name, spec in storage.tensors:
                if "clip_counts" not in arrays[name]:
                    continue
                clipped, tokens = (int(v) for v in np.asarray(arrays[name]["clip_counts"]))
                elements = tokens * per_token
                rows.append(
                    {
                        "layer": storage.layer, "tensor": name, "format": spec.format,
                        "axis": spec.axis, "elements": elements, "clipped": clipped,
                        "clip_rate": clipped / elements if elements else 0.0,
                    }
                )  # fmt: skip
        return rows

    def _pages_from_memory(self, per_device, max_seqs, max_seq_tokens, weights_bytes) -> int:
        max_pages = -(-max_seq_tokens // per_device[0].page_tokens)
        memory, source = device_memory_bytes()
        reserve = int(DEFAULT_RESERVE_FRACTION * memory)
        pool = pool_bytes_left(memory, weights_bytes, reserve)
        sums = kv_sums(per_device)
        page, slots = sums.page_bytes, sums.fixed_bytes(max_seqs)
        one_sequence = max_pages * page + slots
        if pool < one_sequence:
            raise ValueError(
                f"the KV pool gets {pool:,} bytes ({source}: {memory:,}, less weights "
                f"{weights_bytes:,} and the {DEFAULT_RESERVE_FRACTION} reserve {reserve:,}), "
                f"but one sequence of {max_seq_tokens:,} tokens "
                f"needs {max_pages * page:,} bytes of pages plus {slots:,} of slot buffers; "
                "lower max_seq_tokens or max_seqs, or pass pool_bytes/num_pages"
            )
        self.sized_by = f"memory: {pool:,} of {source}"
        return min(max_seqs * max_pages, (pool - slots) // page)

    # ---------------------------------------------------------------- engine questions
    def check_plan(self, plan: QuantPlan, config: ModelConfig) -> None:
        """Raise unless `plan` stores the KV cache as this pool was built to (per layer: key
        and value formats, axes, sink tokens): an engine whose params follow one plan and
        whose pool follows another would run and report a plan nobody asked for."""
        for layer, (want, built) in enumerate(
            zip(plan.kv_layers(config), self.kv_layers(), strict=True)
        ):
            if want != built:
                raise ValueError(
                    f"the KV pool of layer {layer} was built for {built} but the engine's plan "
                    f"stores {want}; build the pool (PagedPool(config, plan, ...)) from the "
                    "plan the params were quantized under"
                )

    def settings(self, compute_dtype: str) -> dict[str, Any]:
        """The pool's part of `Engine.settings()`; static KV scales change results, so their
        fingerprint is in it where a plan uses them."""
        scales = {} if self.kv_scales is None else {"kv_scales": self.kv_scales.fingerprint()}
        return {
            **scales,
            "cache": "paged",
            "kv_store_dtype": self.layout.store_dtype,
            "page_tokens": self.page_tokens,
            "pool_pages": self.num_pages,
            "max_seqs": self.max_seqs,
            "max_seq_tokens": self.max_seq_tokens,
        }

    def kv_layers(self) -> list[LayerKV]:
        return [storage.kv for storage in self.layout.layers]

    # ---------------------------------------------------------------- tenants
    def add_tenant(self, name: str, guaranteed_pages: int = 0) -> None:
        self.allocator.add_tenant(name, guaranteed_pages)

    def tenant_usage(self) -> dict[str, tuple[int, int]]:
        """tenant -> (pages used, pages guaranteed)."""
        return self.allocator.tenant_usage()

    @property
    def free_pages(self) -> int:
        return self.allocator.free_pages

    # ---------------------------------------------------------------- KVCache
    def allocate(self, num_tokens: int, tenant: str = DEFAULT_TENANT) -> int:
        """Open a sequence that may grow to `num_tokens`; pages come later, in `make_room`."""
        if num_tokens > self.max_seq_tokens:
            raise CacheFull(
                f"a sequence of {num_tokens} tokens exceeds max_seq_tokens={self.max_seq_tokens}"
            )
        if not self._free_slots:
            raise CacheFull(f"all {self.max_seqs} sequence slots are in use")
        seq_id = self._next_id
        self.allocator.open(seq_id, tenant)  # unknown tenant: ValueError, nothing taken
        self._next_id += 1
        self._slot[seq_id] = self._free_slots.pop()
        self._tokens[seq_id] = 0
        return seq_id

    def make_room(self, seq_ids: Sequence[int], end_tokens: Sequence[int]) -> None:
        """Grow each sequence's pages to hold `end_tokens` before a step writes them.

        Raises `SequencePreempted` for a sequence that lost its pages, `PoolExhausted` when
        the pool refuses growth (sequences grown earlier in the call keep their pages).
        """
        for seq_id, end in zip(seq_ids, end_tokens, strict=True):
            if seq_id in self._preempted:
                raise SequencePreempted(
                    f"sequence {seq_id} was preempted: its pages were reclaimed for another "
                    "tenant's guaranteed share; release it and submit it again"
                )
            if end > self.max_seq_tokens:
                raise CacheFull(
                    f"sequence {seq_id} would hold {end} tokens, over max_seq_tokens="
                    f"{self.max_seq_tokens}"
                )
            grant = self.allocator.ensure(seq_id, int(end))
            self._preempted.update(grant.preempted)
            self._tokens[seq_id] = int(end)

    def table(self, seq_ids: Sequence[int | None]) -> np.ndarray:
        lay = self.layout
        out = np.full((len(seq_ids), 2 + lay.max_pages), lay.num_pages, np.int32)
        for row, seq_id in enumerate(seq_ids):
            if seq_id is None:
                out[row, 0], out[row, 1] = lay.max_seqs, 0
                continue
            blocks = self.allocator.block_table(seq_id)
            out[row, 0], out[row, 1] = self._slot[seq_id], self._tokens[seq_id]
            out[row, 2 : 2 + len(blocks)] = blocks
        return out

    def free(self, seq_id: int) -> None:
        if seq_id not in self._slot:
            raise ValueError(f"sequence {seq_id} is not allocated")
        if seq_id in self._preempted:
            self._preempted.remove(seq_id)
        else:
            self.allocator.close(seq_id)
        self._free_slots.append(self._slot.pop(seq_id))
        del self._tokens[seq_id]

    def is_preempted(self, seq_id: int) -> bool:
        return seq_id in self._preempted

    # ---------------------------------------------------------------- bytes
    def kv_report(self) -> list[dict]:
        """Per layer: formats, pages, and true bytes of data, scales, residual and sinks, read
        from the real arrays (whole arrays: under tensor parallelism, all devices together)."""
        return [
            layer_bytes_row(storage, self.num_pages, **measured)
            for storage, measured in zip(self.layout.layers, layout_nbytes(self.state), strict=True)
        ]

    @property
    def nbytes(self) -> int:
        return sum(r["total_bytes"] for r in self.kv_report())
