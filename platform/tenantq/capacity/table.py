"""Plain-text renderings of a `Budget` (one deployment, line by line) and of a comparison.

Every byte figure is printed exactly, with a binary-unit reading beside it, so a reader can
add the column up by hand: HBM - weights - reserve = pool.
"""

from __future__ import annotations

from collections.abc import Sequence

from tenantq.capacity.budget import Budget
from tenantq.capacity.units import exact_bytes, human_bytes
from tenantq.model.terminal import text_table

_LABEL = 46


def _cell(n: int | float | None) -> str:
    if n is None:
        return " " * 30
    return f"{exact_bytes(n):>18} B {human_bytes(n):>10}"


def _row(label: str, per_chip: int | float | None, total: int | float | None, chips: int) -> str:
    line = f"{label:<{_LABEL}}{_cell(per_chip)}"
    if chips > 1 and total is not None:
        line += f"   {_cell(total)}"
    return line.rstrip()


def render_budget(b: Budget, *, per_tensor: bool = False, description: str = "") -> str:
    chips = b.chips
    where = f"{chips} x {b.hardware}" if chips > 1 else b.hardware
    tp = f", tensor parallel {chips}" if chips > 1 else ""
    out = [
        f"{b.model} on {where}{tp}" + (f"  [{description}]" if description else ""),
        f"weights: {b.weights_summary} | KV: {b.kv_summary} | context {b.context_tokens:,} tokens"
        f" | pages of {b.page_tokens} tokens",
        "",
    ]
    head = f"{'':<{_LABEL}}{'per chip':>30}"
    if chips > 1:
        head += f"   {f'all {chips} chips':>30}"
    out.append(head)
    memory = "memory" if b.hardware == "cpu" else "HBM"
    out.append(_row(memory, b.hbm_bytes_per_chip, b.hbm_bytes_per_chip * chips, chips))
    out.append(_row("- weights", b.weights_bytes_per_chip, b.weights_bytes, chips))
    for w in b.weight_lines:
        count = f"{w.tensors} tensor" + ("s" if w.tensors > 1 else "")
        label = f"    {w.name:<10}{w.formats:<16}{count:>12}"
        out.append(_row(label, w.bytes_per_chip, w.bytes_total, chips) + f"   {w.sharding}")
        if per_tensor:
            for t in (t for t in b.tensors if t.line == w.name):
                shape = "x".join(map(str, t.shard_shape))
                out.append(_row(f"      {t.path}  {shape}  {t.label}", t.bytes_per_chip, None, 1))
    out.append(_row(f"- runtime reserve ({b.reserve})", b.reserve_bytes_per_chip, None, 1))
    out.append(_row("= KV pool", b.pool_bytes_per_chip, b.pool_bytes, chips))
    if b.kv_static_bytes_per_chip:
        out.append(
            _row("  of which static KV scales, counters", b.kv_static_bytes_per_chip, None, 1)
            + "   once per layer, not per token"
        )
    out.append("")
    out.append(
        _row(
            "KV per token (scales amortised over a page)",
            b.kv_bytes_per_token_per_chip,
            b.kv_bytes_per_token,
            chips,
        )
    )
    for kv in b.kv_lines:
        window = f", window {kv.window_tokens:,}" if kv.window_tokens else ""
        n = len(kv.layers)
        which = (
            f"layers {kv.layer_ranges} ({n} {kv.kind}{window})"
            if len(kv.layer_ranges) <= 12
            else f"{n} {kv.kind} layers{window}"
        )
        out.append(
            f"    {which}: K {kv.key}, V {kv.value};"
            f" page {exact_bytes(kv.page_bytes)} B, slot {exact_bytes(kv.slot_bytes)} B per layer"
            f" per chip; {kv.pages_per_tenant:,} pages per tenant"
        )
        out.extend(f"        {part}" for part in kv.parts)
    out.append(
        _row(f"one page in every layer ({b.page_tokens} tokens)", b.page_bytes_per_chip, None, 1)
    )
    pool_label = "pool pages -> pool tokens"
    out.append(f"{pool_label:<{_LABEL}}{b.pool_pages:>20,} pages -> {b.pool_tokens:,} tokens")
    out.append(
        _row(f"per tenant at {b.context_tokens:,} tokens", b.tenant_bytes_per_chip, None, 1)
        + f"   = {b.tenant_pages:,} layer-pages {exact_bytes(b.tenant_page_bytes_per_chip)} B"
        f" + slot {exact_bytes(b.tenant_slot_bytes_per_chip)} B"
    )
    out.append("")
    out.append(f"{f'tenants at {b.context_tokens:,} tokens':<{_LABEL}}{b.tenants:>20,}")
    if b.reason:
        out.append(f"    0 tenants: {b.reason}")
    who = f"{b.target_tenants} tenant" + ("s each" if b.target_tenants > 1 else "")
    limit = " (the model's max_position_embeddings)" if b.max_context_limit == "model" else ""
    out.append(f"{f'longest context for {who}':<{_LABEL}}{b.max_context_tokens:>20,} tokens{limit}")
    for note in b.notes:
        out.append(f"note: {note}")
    return "\n".join(out)


def render_compare(rows: Sequence[tuple[str, str, Budget]], base: Budget) -> str:
    """Weight x KV format pairs side by side; `ratio` = pool tokens over `base`'s (bf16/bf16)."""
    first = rows[0][2]
    where = f"{first.chips} x {first.hardware}" if first.chips > 1 else first.hardware
    out = [
        f"{first.model} on {where} | context {first.context_tokens:,} tokens | pages of "
        f"{first.page_tokens} tokens | reserve {first.reserve}",
        "per chip; ratio = pool tokens / pool tokens at bf16 weights + bf16 KV",
        "",
    ]
    head = ["weights", "KV", "weights", "KV pool", "KV B/token", "pool tokens", "ratio",
            "KV/tenant", "tenants", "max ctx @1"]  # fmt: skip
    body = [
        [
            weights,
            kv,
            human_bytes(b.weights_bytes_per_chip),
            human_bytes(b.pool_bytes_per_chip),
            _per_token(b),
            f"{b.pool_tokens:,}",
            f"{b.pool_tokens / base.pool_tokens:.2f}x" if base.pool_tokens else "n/a",
            human_bytes(b.tenant_bytes_per_chip),
            f"{b.tenants:,}",
            f"{b.max_context_tokens:,}",
        ]  # fmt: skip
        for weights, kv, b in rows
    ]
    widths = [10, 10, 10, 10, 11, 12, 6, 10, 8, 11]
    out += text_table(head, body, widths=widths, right=range(2, 10), sep=" ", rule=True)
    for weights, kv, b in rows:
        if b.reason:
            out.append(f"{weights}/{kv}: 0 tenants: {b.reason}")
    return "\n".join(out)


def _per_token(b: Budget) -> str:
    x = b.kv_bytes_per_token_per_chip
    return f"{int(x):,}" if float(x).is_integer() else f"{x:,.1f}"


def render_service_level(b: Budget, s) -> str:
    """The service-level section under a budget: the decode step at the tenants served,
    line by line (bytes / bandwidth, FLOPs / peak, overhead), the decode rate per tenant
    (and, with prompt tokens, the batched prefill and the amortised rate), then the tenants
    by memory, by SLO and the limit that binds. `s` is a `roofline.ServiceLevel`."""
    from tenantq.capacity.roofline import MAX_TENANTS

    st = s.step
    ms = 1e3
    slo = f"{s.slo_tokens_per_s:g} tok/s"
    request = (
        f"each request {s.prompt_tokens:,} new prompt + {s.output_tokens:,} output tokens, "
        "prefill amortised"
        if s.prompt_tokens
        else "decode rate (TPOT), no prefill"
    )
    out = ["", f"service level: {slo} per tenant, {request} (context {s.context_tokens:,})"]
    at_slo = f"tenants at {slo}"
    if s.tenants_by_memory == 0:  # nothing fits: no batch to model
        out.append(f"{'tenants by memory':<{_LABEL}}{0:>20,}")
        out.append(
            f"{at_slo:<{_LABEL}}{0:>20,}   bound by memory: no tenant of "
            f"{s.context_tokens:,} tokens fits, so no decode step is modelled"
        )
        return "\n".join(out)
    out += [
        f"decode step at {st.batch:,} tenant" + ("s" if st.batch > 1 else "") + " (per chip)",
        _row("    weights read", st.weight_bytes, None, 1) + "   embedding: the batch's rows",
        _row(f"    KV read ({st.batch:,} x {b.context_tokens:,} tokens)", st.kv_bytes, None, 1),
        _row("    = bytes per step", st.bytes, None, 1),
        f"{'    / bandwidth':<{_LABEL}}{st.bandwidth_bytes_per_s / 1e9:>18,.0f} GB/s"
        f"   = {st.memory_s * ms:.3f} ms",
    ]
    for fmt, n in st.flops.items():
        if n:
            out.append(
                f"{f'    {fmt} FLOPs / peak':<{_LABEL}}{n:>20,} / {st.peaks[fmt] / 1e12:,.1f} T"
                f"   = {n / st.peaks[fmt] * ms:.3f} ms"
            )
    out.append(f"{'    compute time':<{_LABEL}}{st.compute_s * ms:>17.3f} ms")
    out.append(f"{'    + step overhead':<{_LABEL}}{st.overhead_s * ms:>17.3f} ms")
    out.append(f"{f'    = step time ({st.bound}-bound)':<{_LABEL}}{st.step_s * ms:>17.3f} ms")
    out.append(
        f"{'decode tokens/s per tenant (1 / step)':<{_LABEL}}"
        f"{s.decode_tokens_per_s_per_tenant:>20.1f}"
    )
    if s.prompt_tokens:
        prompts = f"{st.batch:,} prompt" + ("s" if st.batch > 1 else "")
        out.append(
            f"{f'prefill of {prompts}, one batch':<{_LABEL}}{s.prefill_s * ms:>17.3f} ms"
            f"   {s.prefill_share:.1%} of the chip's time"
        )
        out.append(
            f"{'tokens/s per tenant, prefill amortised':<{_LABEL}}"
            f"{s.tokens_per_s_per_tenant:>20.1f}"
        )
    out.append("")
    out.append(f"{'tenants by memory':<{_LABEL}}{s.tenants_by_memory:>20,}")
    by_slo = f">= {s.tenants_by_slo:,}" if s.slo_capped else f"{s.tenants_by_slo:,}"
    capped = f"   the search's cap (2^{MAX_TENANTS.bit_length() - 1})" if s.slo_capped else ""
    out.append(f"{f'tenants by SLO ({slo})':<{_LABEL}}{by_slo:>20}{capped}")
    binding = {"memory": "memory", "slo": "the SLO", "both": "memory and the SLO alike"}
    out.append(f"{at_slo:<{_LABEL}}{s.tenants:>20,}   bound by {binding[s.binding]}")
    for note in s.notes:
        out.append(f"note: {note}")
    return "\n".join(out)
