"""The memory budget of one deployment, line by line, and the tenants it holds.

Per chip: HBM - weights (per tensor, in the plan's formats) - runtime reserve = KV pool.
Static KV scales (tensor/head axes) take a few bytes per layer off the pool once; a tenant of
C tokens holds ceil(kv_tokens_l(C) / page_tokens) pages in every layer plus its slot's
residual and sink buffers; tenants = floor((pool - static scales) / tenant bytes). All figures are
integers computed from the same formulas the engine allocates with (`storage_nbytes`,
`LayerKVStorage`), so the planner can be checked against the engine to the byte. Under
tensor parallelism every chip holds an equal share, so the per-chip pool is what binds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from fractions import Fraction

from tenantq.capacity.hardware import Deployment
from tenantq.capacity.kv import pool_bytes_from_layers, tenant_pages
from tenantq.capacity.units import exact_bytes, human_bytes
from tenantq.capacity.weights import WEIGHT_LINE_ORDER, TensorBytes, sharding_label, tensor_bytes
from tenantq.model.checks import check_positive_int
from tenantq.model.config import ModelConfig
from tenantq.quant.plan import QuantPlan
from tenantq.storage.kv import LayerKVStorage, kv_storage
from tenantq.storage.pool import kv_sums, pool_bytes_left
from tenantq.storage.tp import vocab_replicated


@dataclass(frozen=True)
class WeightLine:
    """One group of weights (embed, lm_head, attention, mlp, norms) as each chip holds it."""

    name: str
    tensors: int
    params: int  # logical elements of the whole tensors
    formats: str  # e.g. "fp8_e4m3" or "int4/g128 x3, bf16 x1"
    sharding: str
    bytes_per_chip: int
    bytes_total: int  # all chips (replicated tensors counted on each)


@dataclass(frozen=True)
class KVLine:
    """Layers that store KV alike, with their per-chip bytes."""

    layers: tuple[int, ...]
    kind: str  # "full" | "sliding"
    window_tokens: int | None
    key: str  # "fp8_e4m3/channel"
    value: str  # "fp8_e4m3/token"
    page_bytes: int  # one page of one of these layers, per chip
    slot_bytes: int  # residual + sink per sequence slot, per layer, per chip
    pages_per_tenant: int  # per layer, at the budget's context
    parts: tuple[str, ...] = ()  # what one layer stores besides K/V elements, array by array

    @property
    def layer_ranges(self) -> str:
        return _ranges(self.layers)


@dataclass(frozen=True)
class Budget:
    """Every line of the memory budget; byte figures are exact integers.

    Names without `_per_chip` are for the whole deployment (all chips); the pool, tokens
    and tenants are limited by the per-chip figures.
    """

    model: str
    hardware: str
    chips: int
    context_tokens: int
    page_tokens: int
    weights_summary: str
    kv_summary: str
    plan_fingerprint: str
    # HBM per chip
    hbm_bytes_per_chip: int
    # weights
    weight_lines: tuple[WeightLine, ...]
    weights_bytes_per_chip: int
    weights_bytes: int
    # runtime reserve
    reserve: str
    reserve_bytes_per_chip: int
    # KV pool
    pool_bytes_per_chip: int
    pool_bytes: int
    # KV per token, per layer group, per page
    kv_lines: tuple[KVLine, ...]
    page_bytes_per_chip: int  # one page in every layer
    kv_bytes_per_token_per_chip: float  # page bytes / page_tokens, summed over layers
    kv_bytes_per_token: float  # the same for all chips together (the whole model's KV)
    # pages and pool tokens
    pool_pages: int  # whole pages (every layer) the per-chip pool holds
    pool_tokens: int
    # tenants
    tenant_pages: int  # layer-pages one tenant holds at `context_tokens`
    tenant_page_bytes_per_chip: int
    tenant_slot_bytes_per_chip: int
    tenant_bytes_per_chip: int  # pages x page bytes + slot overhead, exact
    tenants: int
    target_tenants: int
    max_context_tokens: int  # longest context each of `target_tenants` tenants can hold
    max_context_limit: str  # "memory" | "model" (capped at max_position_embeddings)
    reason: str  # why no tenant fits ("" when some do)
    notes: tuple[str, ...] = ()
    kv_static_bytes_per_chip: int = 0  # static (tensor/head) KV scales, once per layer
    tensors: tuple[TensorBytes, ...] = field(default=(), repr=False, compare=False)

    @property
    def fits(self) -> bool:
        return self.tenants > 0

    def to_dict(self, *, per_tensor: bool = False) -> dict:
        # field by field: `asdict(self)` would deep-convert every per-tensor record first,
        # only to drop them (most of a search trial's bookkeeping time)
        d = {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name != "tensors"}
        for key in ("kv_bytes_per_token", "kv_bytes_per_token_per_chip"):
            d[key] = _number(d[key])
        d["notes"] = list(self.notes)
        for line, kv in zip(d["kv_lines"], self.kv_lines, strict=True):
            line["layers"] = kv.layer_ranges
            line["num_layers"] = len(kv.layers)
        if per_tensor:
            d["tensors"] = [
                {
                    "path": t.path,
                    "line": t.line,
                    "shape": list(t.shape),
                    "shard_shape": list(t.shard_shape),
                    "format": t.format,
                    "group_size": t.group_size,
                    "bytes_per_chip": t.bytes_per_chip,
                }
                for t in self.tensors
            ]
        return d


def _plain(value):
    """`asdict`'s conversion of one field value: dataclasses to dicts, containers copied."""
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def budget(
    model_config: ModelConfig,
    plan: QuantPlan,
    deployment: Deployment,
    context_tokens: int,
    *,
    target_tenants: int = 1,
    model_name: str | None = None,
) -> Budget:
    """The line-by-line budget of `deployment` serving `model_config` under `plan`, and how
    many tenants of `context_tokens` each fit; 0 tenants with the reason when none do."""
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int):
        raise ValueError(f"context must be a whole number of tokens, got {context_tokens!r}")
    if context_tokens < 1:
        raise ValueError(f"context must be a positive number of tokens, got {context_tokens}")
    check_positive_int("target tenants", target_tenants)
    config, tp, page = model_config, deployment.chips, deployment.page_tokens
    tensors = tensor_bytes(config, plan, tp)
    layers = kv_storage(config, plan, page, tp)
    sums = kv_sums(layers)

    hbm = deployment.hardware.hbm_bytes
    weights = sum(t.bytes_per_chip for t in tensors)
    reserve = deployment.reserve_bytes_per_chip
    pool = pool_bytes_left(hbm, weights, reserve)
    static = sums.static_bytes
    paged_pool = max(0, pool - static)

    page_bytes = sums.page_bytes
    per_token_chip = Fraction(page_bytes, page)
    pages = tenant_pages(config, context_tokens, page)
    tenant = pool_bytes_from_layers(layers, pages, 1)
    tenant_bytes = tenant["total_bytes"] - tenant["static_bytes"]
    tenants = paged_pool // tenant_bytes

    reason = ""
    if weights > hbm:
        reason = (
            f"the weights alone need {_b(weights)} per chip, more than the chip's "
            f"{_b(hbm)} of memory"
        )
    elif weights + reserve >= hbm:
        reason = (
            f"weights ({_b(weights)}) and the runtime reserve ({_b(reserve)}) leave no KV pool "
            f"in the chip's {_b(hbm)}"
        )
    elif tenants == 0:
        reason = (
            f"one tenant at {context_tokens:,} tokens needs {_b(tenant_bytes)} of KV per chip; "
            f"the pool has {_b(pool)}"
        )
    max_context, limit = _max_context(config, layers, page, paged_pool, target_tenants)

    return Budget(
        model=model_name or config.name or config.model_type,
        hardware=deployment.hardware.name,
        chips=tp,
        context_tokens=context_tokens,
        page_tokens=page,
        weights_summary=_weights_summary(tensors),
        kv_summary=_kv_summary(plan, config),
        plan_fingerprint=plan.fingerprint(),
        hbm_bytes_per_chip=hbm,
        weight_lines=_weight_lines(tensors, tp, vocab_replicated(config, tp)),
        weights_bytes_per_chip=weights,
        weights_bytes=weights * tp,
        reserve=deployment.reserve.describe(),
        reserve_bytes_per_chip=reserve,
        pool_bytes_per_chip=pool,
        pool_bytes=pool * tp,
        kv_lines=_kv_lines(config, layers, pages),
        page_bytes_per_chip=page_bytes,
        kv_bytes_per_token_per_chip=_as_float(per_token_chip),
        kv_bytes_per_token=_as_float(per_token_chip * tp),
        pool_pages=paged_pool // page_bytes,
        pool_tokens=(paged_pool // page_bytes) * page,
        tenant_pages=sum(pages),
        tenant_page_bytes_per_chip=tenant["pages_bytes"],
        tenant_slot_bytes_per_chip=tenant["residual_bytes"] + tenant["sink_bytes"],
        tenant_bytes_per_chip=tenant_bytes,
        tenants=tenants,
        target_tenants=target_tenants,
        max_context_tokens=max_context,
        max_context_limit=limit,
        reason=reason,
        notes=_notes(config, plan, tp, context_tokens),
        kv_static_bytes_per_chip=static,
        tensors=tensors,
    )


def max_context_for(
    model_config: ModelConfig, plan: QuantPlan, deployment: Deployment, tenants: int
) -> int:
    """The longest context each of `tenants` tenants can hold at once (0 if not one token),
    capped at the model's `max_position_embeddings`."""
    check_positive_int("tenants", tenants)
    return budget(model_config, plan, deployment, 1, target_tenants=tenants).max_context_tokens


# ------------------------------------------------------------------------ helpers
def _max_context(
    config: ModelConfig, layers: tuple[LayerKVStorage, ...], page: int, pool: int, n: int
) -> tuple[int, str]:
    """Largest C <= max_position_embeddings with n * tenant_bytes(C) <= pool (monotone in C)."""

    def fits(c: int) -> bool:
        one = pool_bytes_from_layers(layers, tenant_pages(config, c, page), 1)
        return n * (one["total_bytes"] - one["static_bytes"]) <= pool

    cap = config.max_position_embeddings
    if fits(cap):
        return cap, "model"
    if not fits(1):
        return 0, "memory"
    lo, hi = 1, cap  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, "memory"


def _weight_lines(
    tensors: tuple[TensorBytes, ...], tp: int, vocab_whole: bool
) -> tuple[WeightLine, ...]:
    out = []
    for name in WEIGHT_LINE_ORDER:
        group = [t for t in tensors if t.line == name]
        if not group:
            continue
        per_chip = sum(t.bytes_per_chip for t in group)
        params = 0
        for t in group:
            n = 1
            for d in t.shape:
                n *= d
            params += n
        out.append(
            WeightLine(
                name=name,
                tensors=len(group),
                params=params,
                formats=_format_mix(group),
                sharding=sharding_label(name, tp, vocab_whole),
                bytes_per_chip=per_chip,
                bytes_total=per_chip * tp,
            )
        )
    return tuple(out)


def _format_mix(group: list[TensorBytes]) -> str:
    counts = Counter(t.label for t in group)
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{label} x{n}" for label, n in counts.most_common())


def _weights_summary(tensors: tuple[TensorBytes, ...]) -> str:
    quantizable = [t for t in tensors if t.line != "norms"]
    return _format_mix(quantizable)


def _kv_summary(plan: QuantPlan, config: ModelConfig) -> str:
    kv = plan.kv
    if kv.key_format == kv.value_format == "bf16" and not kv.layer_formats:
        text = "bf16"
    else:
        text = f"K {kv.key_format}/{kv.key_axis}, V {kv.value_format}/{kv.value_axis}"
    extras = []
    if kv.scale_dtype != "float32":
        extras.append(f"{kv.scale_dtype} scales")
    if kv.sink_tokens:
        extras.append(f"{kv.sink_tokens} sink tokens")
    if kv.bf16_layers:
        extras.append(f"bf16 layers {list(kv.bf16_layers)}")
    if kv.layer_formats:
        extras.append(f"{len(kv.layer_formats)} per-layer overrides")
    return text + (f" ({', '.join(extras)})" if extras else "")


def _kv_lines(
    config: ModelConfig, layers: tuple[LayerKVStorage, ...], pages: tuple[int, ...]
) -> tuple[KVLine, ...]:
    groups: dict[tuple, list[int]] = {}
    for lay, n in zip(layers, pages, strict=True):
        kind = config.layer_types[lay.layer]
        kv = lay.kv
        key = (
            kind,
            config.sliding_window if kind == "sliding" else None,
            f"{kv.key_format}/{kv.key_axis}" if kv.key_format != "bf16" else "bf16",
            f"{kv.value_format}/{kv.value_axis}" if kv.value_format != "bf16" else "bf16",
            lay.page_bytes,
            lay.slot_bytes,
            n,
            lay.byte_lines(),
        )
        groups.setdefault(key, []).append(lay.layer)
    return tuple(KVLine(tuple(idx), *key) for key, idx in groups.items())


def _notes(config: ModelConfig, plan: QuantPlan, tp: int, context: int) -> tuple[str, ...]:
    notes = []
    static = [i for i, kv in enumerate(plan.kv_layers(config)) if not kv.is_bf16]
    if plan.needs_kv_scales and static:
        notes.append(
            "static KV scales (tensor/head axes) are calibrated per model "
            "(tenantq.quant.kv_calibration); values beyond them clip, and the engine reports the "
            "clip rate (Engine.kv_clip_rate)"
        )
    if context > config.max_position_embeddings:
        notes.append(
            f"context {context:,} exceeds the model's max_position_embeddings "
            f"({config.max_position_embeddings:,})"
        )
    sliding = config.layer_types.count("sliding")
    if sliding:
        notes.append(
            f"{sliding} of {config.num_layers} layers are sliding-window: their KV stops "
            f"growing at {config.sliding_window:,} tokens (pool tokens count a page in every "
            "layer, so tenants x context can exceed them)"
        )
    if vocab_replicated(config, tp):
        notes.append(
            f"vocab {config.vocab_size:,} is not divisible by {tp} chips: embed and lm_head are "
            "replicated whole on every chip (not padded, not sharded)"
        )
    unused = plan.unused_rules(config)
    if unused:
        notes.append("plan rules that match no tensor: " + ", ".join(r.pattern for r in unused))
    return tuple(notes)


def _ranges(idx: tuple[int, ...]) -> str:
    parts, start = [], None
    for i, x in enumerate(idx):
        if start is None:
            start = x
        if i + 1 == len(idx) or idx[i + 1] != x + 1:
            parts.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(parts)


def _as_float(x: Fraction) -> float:
    return float(x)


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _b(n: int) -> str:
    return f"{exact_bytes(n)} B ({human_bytes(n)})"
