"""Decode step time by roofline, and how many tenants a deployment serves at a service level.

One decode step of B tenants at context c takes max(bytes / bandwidth, FLOPs / peak) plus a
fixed overhead. Bytes are the weights in their stored formats plus every tenant's KV pages,
scales included, counted by the budget's own byte functions (`tensor_bytes`, the KV storage
rows), never a second count; FLOPs are split by the format each matmul runs in (bf16 for
weight-only formats, int8/fp8 for W8A8 and W4A8). On a CPU profile (XLA:CPU converts weights
in a pass of its own, `HardwareProfile.convert_elements_per_s`, and a batched dot packs its
weight) those passes come first and add, and the dot reads the converted copy instead of the
stored bytes. The SLO is a decode
(TPOT) rate, 1 / step; new prompt tokens per request (`prompt_tokens`, 0 by default) add a
batched prefill amortised over the request's output.
Imports no JAX, Ray or MLflow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tenantq.capacity.hardware import COMPUTE_FORMATS, Deployment, HardwareProfile
from tenantq.capacity.kv import pool_bytes_from_layers, tenant_pages
from tenantq.capacity.weights import tensor_bytes
from tenantq.model.checks import check_positive_int
from tenantq.model.config import ModelConfig
from tenantq.quant.plan import QuantPlan
from tenantq.storage.kv import kv_storage

# A serving engine's fixed cost per decode step on an accelerator (kernel launches, the
# scheduler, sampling), independent of bytes and FLOPs: an assumption, stated, overridable.
DEFAULT_STEP_OVERHEAD_S = 0.5e-3
# With new prompt tokens per request: this many generated tokens over which their prefill is
# amortised (the request's context holds both).
DEFAULT_OUTPUT_TOKENS = 256
# Beyond this many tenants the SLO search stops (no deployment holds 2^24 sequences); a
# ServiceLevel that reaches it says so (`slo_capped`) and prints ">= 2^24".
MAX_TENANTS = 2**24
_ACTIVATION_COMPUTE = {"int8": "int8", "fp8_e4m3": "fp8"}
_SLO = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(?:(?:tok|tokens)\s*/\s*s\s*)?$")


def parse_slo(text: str | float | int) -> float:
    """Tokens per second per tenant from `"20tok/s"`, `"20 tokens/s"`, or a bare number
    (`20`, `"20"`: tokens/s too); the CLI's `--slo` and a spec read it the same way."""
    if isinstance(text, bool):
        raise ValueError(f"slo: {text!r} is not a rate; write e.g. 20tok/s")
    if isinstance(text, int | float):
        value = float(text)
    else:
        match = _SLO.match(str(text))
        if match is None:
            raise ValueError(f"slo: cannot read {text!r} as a rate; write e.g. 20tok/s")
        value = float(match.group(1))
    if not value > 0 or value == float("inf"):
        raise ValueError(f"slo: {text!r} must be a positive, finite rate, e.g. 20tok/s")
    return value


@dataclass(frozen=True)
class StepTime:
    """One decode step of `batch` tenants at `context_tokens` each, on one chip."""

    batch: int
    context_tokens: int
    weight_bytes: int  # weights read this step (embedding: only the rows gathered)
    kv_bytes: int  # every tenant's KV pages and slot buffers, plus static scales once
    flops: dict[str, int]  # per compute format (bf16, int8, fp8), per chip
    bandwidth_bytes_per_s: float
    peaks: dict[str, float]  # the rate each format ran at (bf16's where the chip has none)
    overhead_s: float
    memory_s: float
    compute_s: float
    step_s: float
    bound: str  # "memory" | "compute" | "convert" (CPU profiles: the largest of the three)
    convert_s: float = 0.0  # weight conversion as a pass of its own (CPU profiles only)

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def to_dict(self) -> dict:
        return {
            "batch": self.batch,
            "context_tokens": self.context_tokens,
            "weight_bytes": self.weight_bytes,
            "kv_bytes": self.kv_bytes,
            "bytes": self.bytes,
            "flops": dict(self.flops),
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "peaks": dict(self.peaks),
            "memory_s": self.memory_s,
            "compute_s": self.compute_s,
            "overhead_s": self.overhead_s,
            "convert_s": self.convert_s,
            "step_s": self.step_s,
            "bound": self.bound,
        }


def _rates(hw: HardwareProfile) -> tuple[float, dict[str, float]]:
    if hw.hbm_bandwidth_bytes_per_s is None or hw.peak_bf16_flops_per_s is None:
        raise ValueError(
            f"hardware {hw.name} has no bandwidth and bf16 peak figures; a step time needs "
            "both (measure a CPU with `python -m tenantq.bench roofline`)"
        )
    bf16 = float(hw.peak_bf16_flops_per_s)
    return float(hw.hbm_bandwidth_bytes_per_s), {
        f: float(hw.peak_for(f) or bf16) for f in COMPUTE_FORMATS
    }


def compute_format(activations: str | None) -> str:
    """The format a matmul runs in: its activations' (W8A8/W4A8), else bf16."""
    return _ACTIVATION_COMPUTE.get(activations or "", "bf16")


def weight_step_bytes(config: ModelConfig, plan: QuantPlan, tp: int, batch: int) -> int:
    """Bytes of weights one decode step of `batch` tokens reads on one chip: every tensor's
    stored bytes (`tensor_bytes`, the budget's count), except an untied embedding, of which
    a gather reads only the rows of the batch's tokens (a row's share of its bytes)."""
    total = 0
    for t in tensor_bytes(config, plan, tp):
        if t.path == "embed" and not config.tie_word_embeddings:
            rows = min(batch, t.shape[0])
            total += -(-t.bytes_per_chip * rows // t.shape[0])
        else:
            total += t.bytes_per_chip
    return total


def kv_step_bytes(
    config: ModelConfig, plan: QuantPlan, deployment: Deployment, batch: int, context_tokens: int
) -> int:
    """KV bytes one decode step reads on one chip: each of `batch` tenants' pages and slot
    buffers at `context_tokens` (the budget's per-tenant rows), plus static scales once."""
    layers = kv_storage(config, plan, deployment.page_tokens, deployment.chips)
    pages = tenant_pages(config, context_tokens, deployment.page_tokens)
    one = pool_bytes_from_layers(layers, pages, 1)
    return batch * (one["total_bytes"] - one["static_bytes"]) + one["static_bytes"]


def step_flops(
    config: ModelConfig, plan: QuantPlan, tp: int, tokens: int, kv_tokens: int, *, causal=False
) -> dict[str, int]:
    """FLOPs on one chip for `tokens` new tokens, by compute format: 2 x in x out per linear
    weight (lm_head; a tied embedding as the head) and 4 x heads x head_dim per (query, key)
    pair of attention (QK^T and PV, in bf16). Each new token attends `kv_tokens` keys per
    layer (capped at a sliding window); `causal` (prefill) counts the triangle instead."""
    resolved = plan.resolve(config)
    flops = dict.fromkeys(COMPUTE_FORMATS, 0)
    for path, info in config.tensors().items():
        head = path == "embed" and config.tie_word_embeddings
        if info.kind != "linear" and not head:
            continue
        tq = resolved.get(path)
        fmt = compute_format(tq.activations if tq else None)
        flops[fmt] += 2 * info.shape[0] * info.shape[1] * tokens
    pairs = 0
    for layer in range(config.num_layers):
        if causal:  # token i attends min(i + 1, window) keys
            window = config.layer_kv_tokens(layer, tokens)
            pairs += window * (window + 1) // 2 + (tokens - window) * window
        else:
            pairs += tokens * config.layer_kv_tokens(layer, kv_tokens)
    flops["bf16"] += 4 * config.num_heads * config.head_dim * pairs
    return {f: -(-n // tp) for f, n in flops.items()}


def cpu_weight_pass(
    config: ModelConfig, plan: QuantPlan, hw: HardwareProfile, tp: int, batch: int
) -> tuple[float, int]:
    """(seconds, bytes the dots read) of the weights in one step of `batch` rows, where the
    hardware converts weights in a pass of its own (see `HardwareProfile`): each weight with a
    conversion rate for its stored format costs its elements at that rate, and its dot then
    reads the converted copy (bf16, 2 B per element, for a batch; float32, 4 B, for one row);
    a weight without one is read as stored. A batch's bf16 dot also packs each weight it
    multiplies. A W4A8 weight (int4 with activations) is unpacked to 8-bit codes, which its
    int8 dot reads (1 B per element). Every rate is the one for the weight's shape on one
    chip (`HardwareProfile.pass_rate`). An untied embedding: the batch's rows only.
    Accelerator profiles (no rates): (0, the stored bytes, `weight_step_bytes`)."""
    if not (
        hw.convert_elements_per_s
        or hw.convert_b1_elements_per_s
        or hw.dot_pack_elements_per_s is not None
        or hw.shape_rates
    ):
        return 0.0, weight_step_bytes(config, plan, tp, batch)
    one_row = batch == 1
    convert, unpack = ("convert_b1", "unpack_b1") if one_row else ("convert", "unpack")
    copy_bytes = 4 if one_row else 2
    resolved = plan.resolve(config)
    seconds, read = 0.0, 0
    for t in tensor_bytes(config, plan, tp):
        shape = tuple(t.shard_shape)
        n = 1
        for d in shape:
            n *= d
        stored = t.bytes_per_chip
        gather = t.path == "embed" and not config.tie_word_embeddings
        if gather:
            rows = min(batch, t.shape[0])
            n, stored = n * rows // t.shape[0], -(-stored * rows // t.shape[0])
        tq = resolved.get(t.path)
        if t.line == "norms":  # no matmul
            read += stored
            continue
        if tq is not None and tq.activations:
            # W8A8 dots multiply the stored codes; W4A8's unpack them to 8-bit codes first.
            rate = hw.pass_rate(unpack, t.format, shape) if t.format == "int4" else None
            if rate is None or gather:
                read += stored
                continue
            seconds += n / rate
            read += n
            products = hw.pass_rate("grouped", t.format, shape)
            # FLOP/s of the grouped product; `decode_step` takes these FLOPs off the int8 peak
            if products is not None and tq.activations == "int8":
                seconds += 2 * batch * n / products
            continue
        pack = None if one_row or gather else hw.pass_rate("pack", "bf16", shape)
        if pack is not None:
            seconds += n / pack
        rate = hw.pass_rate(convert, t.format, shape)
        if rate is None:
            read += stored
            continue
        seconds += n / rate
        read += stored if gather else copy_bytes * n
    return seconds, read


def _grouped_flops(
    config: ModelConfig, plan: QuantPlan, hw: HardwareProfile, tp: int, batch: int
) -> int:
    """The int8 FLOPs of W4A8 weights that `cpu_weight_pass` charges at the profile's
    grouped-product rate (the same weights: an unpack rate and a "grouped" rate), taken out
    of the int8 peak's share so they are counted once."""
    if not hw.shape_rates:
        return 0
    unpack = "unpack_b1" if batch == 1 else "unpack"
    resolved = plan.resolve(config)
    total = 0
    for t in tensor_bytes(config, plan, tp):
        tq = resolved.get(t.path)
        if t.format != "int4" or tq is None or tq.activations != "int8":
            continue
        if t.path == "embed" and not config.tie_word_embeddings:
            continue
        shape = tuple(t.shard_shape)
        if hw.pass_rate(unpack, "int4", shape) and hw.pass_rate("grouped", "int4", shape):
            total += 2 * batch * shape[0] * shape[1]
    return total


def decode_step(
    config: ModelConfig,
    plan: QuantPlan,
    deployment: Deployment,
    batch: int,
    context_tokens: int,
    *,
    overhead_s: float = DEFAULT_STEP_OVERHEAD_S,
) -> StepTime:
    """The roofline time of one decode step: `batch` tenants, each holding `context_tokens`."""
    for name, value in (("batch", batch), ("context", context_tokens)):
        check_positive_int(name, value)
    if not overhead_s >= 0:
        raise ValueError(f"step overhead must not be negative, got {overhead_s!r}")
    bandwidth, peaks = _rates(deployment.hardware)
    weights = weight_step_bytes(config, plan, deployment.chips, batch)
    kv = kv_step_bytes(config, plan, deployment, batch, context_tokens)
    flops = step_flops(config, plan, deployment.chips, batch, context_tokens)
    conv, read = cpu_weight_pass(config, plan, deployment.hardware, deployment.chips, batch)
    memory_s = (read + kv) / bandwidth
    charged = dict(flops)
    charged["int8"] -= _grouped_flops(config, plan, deployment.hardware, deployment.chips, batch)
    compute_s = sum(n / peaks[f] for f, n in charged.items())
    return StepTime(
        batch=batch,
        context_tokens=context_tokens,
        weight_bytes=weights,
        kv_bytes=kv,
        flops=flops,
        bandwidth_bytes_per_s=bandwidth,
        peaks=peaks,
        overhead_s=overhead_s,
        memory_s=memory_s,
        compute_s=compute_s,
        # XLA:CPU's conversion is a loop fusion of its own that writes the copy the dot then
        # reads: the two run one after the other, so they add (docs/results/roofline.md).
        step_s=conv + max(memory_s, compute_s) + overhead_s,
        bound=(
            "convert"
            if conv > max(memory_s, compute_s)
            else ("memory" if memory_s >= compute_s else "compute")
        ),
        convert_s=conv,
    )


def prefill_s(
    config: ModelConfig,
    plan: QuantPlan,
    deployment: Deployment,
    prompt_tokens: int,
    batch: int = 1,
) -> float:
    """Time to prefill `batch` prompts of `prompt_tokens` new tokens each in one pass:
    max(batch x compute(one prompt), (weights once + batch x KV written) / bandwidth).

    FLOPs grow with every prompt (each prompt's causal FLOPs at each format's peak), but a
    batched forward pass streams each weight matrix once for all batch x prompt tokens, so
    weights are read once, not once per prompt; what grows with the batch on the bytes side
    is each prompt's KV pages written (the budget's per-tenant rows at `prompt_tokens`)."""
    for name, value in (("prompt tokens", prompt_tokens), ("batch", batch)):
        check_positive_int(name, value)
    bandwidth, peaks = _rates(deployment.hardware)
    flops = step_flops(config, plan, deployment.chips, prompt_tokens, prompt_tokens, causal=True)
    compute = batch * sum(n / peaks[f] for f, n in flops.items())
    weights = weight_step_bytes(config, plan, deployment.chips, batch * prompt_tokens)
    kv = kv_step_bytes(config, plan, deployment, batch, prompt_tokens)
    return max(compute, (weights + kv) / bandwidth)


@dataclass(frozen=True)
class ServiceLevel:
    """Tenants a deployment holds by memory and serves at `slo_tokens_per_s` each.

    The SLO is judged on `tokens_per_s_per_tenant`: the decode rate 1 / step (TPOT) when
    `prompt_tokens` is 0, else the rate with each request's prefill amortised over its
    `output_tokens`."""

    slo_tokens_per_s: float
    context_tokens: int
    prompt_tokens: int  # new (uncached) prompt tokens per request; 0: decode only
    output_tokens: int  # tokens a request generates (used only with prompt_tokens)
    tenants_by_memory: int
    tenants_by_slo: int  # MAX_TENANTS where `slo_capped`: at least that many
    slo_capped: bool  # the search reached MAX_TENANTS and the SLO still held
    tenants: int  # min of the two: tenants at the service level
    binding: str  # "memory" | "slo" | "both"
    step: StepTime  # at `tenants` (at 1 when none)
    decode_tokens_per_s_per_tenant: float  # 1 / step, at `tenants`
    prefill_s: float  # the batch's prompts in one pass, at `tenants` (0 without prompt tokens)
    prefill_share: float  # of the chip's time, at `tenants`
    tokens_per_s_per_tenant: float  # the rate the SLO is judged on, at `tenants`
    overhead_s: float
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        return {
            "slo_tokens_per_s": self.slo_tokens_per_s,
            "context_tokens": self.context_tokens,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "tenants_by_memory": self.tenants_by_memory,
            "tenants_by_slo": self.tenants_by_slo,
            "slo_capped": self.slo_capped,
            "tenants_at_slo": self.tenants,
            "binding": self.binding,
            "step": self.step.to_dict(),
            "decode_tokens_per_s_per_tenant": self.decode_tokens_per_s_per_tenant,
            "prefill_s": self.prefill_s,
            "prefill_share": self.prefill_share,
            "tokens_per_s_per_tenant": self.tokens_per_s_per_tenant,
            "overhead_s": self.overhead_s,
            "notes": list(self.notes),
        }


def request_shape(context_tokens: int, prompt_tokens: int, output_tokens: int) -> tuple[int, int]:
    """(prompt, output) tokens of a request, checked against its context: prompt >= 0,
    output >= 1 and, with a prompt, prompt + output <= context (the context holds both, plus
    any cached prefix). Never cut to fit: a request that does not fit is a one-line error."""
    for name, value, low in (
        ("context tokens", context_tokens, 1),
        ("prompt tokens", prompt_tokens, 0),
        ("output tokens", output_tokens, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if prompt_tokens and prompt_tokens + output_tokens > context_tokens:
        raise ValueError(
            f"prompt tokens {prompt_tokens:,} + output tokens {output_tokens:,} exceed the "
            f"context of {context_tokens:,}: a request's context holds both; give fewer "
            "prompt or output tokens, or a longer context"
        )
    return prompt_tokens, output_tokens


def tokens_per_s(step_s: float, prefill_batch_s: float = 0.0, output_tokens: int = 1) -> float:
    """Each tenant's rate: per `output_tokens` decode steps the chip also prefills the batch's
    next prompts in one pass (`prefill_batch_s`): O / (prefill + O x step); 1 / step without."""
    return output_tokens / (prefill_batch_s + output_tokens * step_s)


def tenants_at_slo(
    config: ModelConfig,
    plan: QuantPlan,
    deployment: Deployment,
    context_tokens: int,
    slo: str | float,
    *,
    tenants_by_memory: int | None = None,
    prompt_tokens: int = 0,
    output_tokens: int = DEFAULT_OUTPUT_TOKENS,
    overhead_s: float = DEFAULT_STEP_OVERHEAD_S,
) -> ServiceLevel:
    """How many tenants of `context_tokens` each get at least `slo` tokens/s, and the limit
    that binds: memory (the budget's tenants) or the step time. By default the SLO is a
    decode rate (TPOT): the largest batch B with 1 / step(B) >= SLO, decode reading each
    tenant's full context. With `prompt_tokens` > 0 each request also prefills that many new
    tokens, batched, amortised over its `output_tokens`."""
    rate = parse_slo(slo)
    prompt, out = request_shape(context_tokens, prompt_tokens, output_tokens)
    if tenants_by_memory is None:
        from tenantq.capacity.budget import budget

        tenants_by_memory = budget(config, plan, deployment, context_tokens).tenants

    def rate_at(b: int) -> tuple[float, StepTime, float]:
        st = decode_step(config, plan, deployment, b, context_tokens, overhead_s=overhead_s)
        pf = prefill_s(config, plan, deployment, prompt, b) if prompt else 0.0
        return tokens_per_s(st.step_s, pf, out), st, pf

    by_slo, capped = 0, False
    if rate_at(1)[0] >= rate:
        lo, hi = 1, 2  # rate_at(lo) meets the SLO; find hi that does not (rate falls with B)
        while hi < MAX_TENANTS and rate_at(hi)[0] >= rate:
            lo, hi = hi, hi * 2
        if hi >= MAX_TENANTS and rate_at(hi)[0] >= rate:
            lo, capped = hi, True
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if rate_at(mid)[0] >= rate else (lo, mid)
        by_slo = lo
    tenants = min(tenants_by_memory, by_slo)
    binding = (
        "both"
        if tenants_by_memory == by_slo
        else ("memory" if tenants_by_memory < by_slo else "slo")
    )
    per_tenant, st, pf = rate_at(max(tenants, 1))
    share = pf / (pf + out * st.step_s) if prompt else 0.0
    notes = []
    # Only formats the plan's matmuls run in (prefill runs the same matmuls as the step).
    used = {f for f, n in st.flops.items() if n > 0}
    missing = [f for f in ("int8", "fp8") if f in used and deployment.hardware.peak_for(f) is None]
    if missing:
        notes.append(
            f"{deployment.hardware.name} has no vendor peak for {', '.join(missing)}: "
            "matmuls in it are costed at the bf16 rate"
        )
    if deployment.chips > 1:
        notes.append("tensor-parallel communication (all-reduces) is not modelled")
    return ServiceLevel(
        slo_tokens_per_s=rate,
        context_tokens=context_tokens,
        prompt_tokens=prompt,
        output_tokens=out,
        tenants_by_memory=tenants_by_memory,
        tenants_by_slo=by_slo,
        slo_capped=capped,
        tenants=tenants,
        binding=binding,
        step=st,
        decode_tokens_per_s_per_tenant=1.0 / st.step_s,
        prefill_s=pf,
        prefill_share=share,
        tokens_per_s_per_tenant=per_tenant,
        overhead_s=overhead_s,
        notes=tuple(notes),
    )
