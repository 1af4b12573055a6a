"""The decode step-time model, tenants at a service level, and `capacity --slo`.

The hand check writes every figure out from the vendor's numbers and the published
Llama-3.1-8B config (not recomputed by the code under test); the other tests pin that the
model reads its bytes from the budget's own counts and that the SLO search finds the edge.
"""

from __future__ import annotations

import json
import re

import pytest

from tenantq.capacity import Deployment, budget, get_model_config
from tenantq.capacity.hardware import HARDWARE
from tenantq.capacity.roofline import (
    MAX_TENANTS,
    decode_step,
    kv_step_bytes,
    parse_slo,
    prefill_s,
    request_shape,
    step_flops,
    tenants_at_slo,
    tokens_per_s,
    weight_step_bytes,
)
from tenantq.quant.plan import KVPlan, QuantPlan, Rule

LLAMA8 = get_model_config("llama-3.1-8b")


def test_llama_8b_bf16_step_on_h100_by_hand():
    # Llama-3.1-8B: vocab 128,256, hidden 4,096, MLP 14,336, 32 layers, 32 query / 8 KV heads
    # of 128. Parameters: embed = lm_head = 128,256 x 4,096 = 525,336,576; per layer q, o
    # 16,777,216 each, k, v 4,194,304 each, MLP 3 x 58,720,256 = 176,160,768, two norms
    # 8,192: 218,112,000; x 32 = 6,979,584,000; final norm 4,096.
    # A batch-1 step reads everything but the embedding, plus one embedding row (8,192 B):
    weights = 2 * (525_336_576 + 6_979_584_000 + 4_096) + 8_192
    assert weights == 15_009_857_536
    # bf16 KV: 32 layers x (K + V) x 8 heads x 128 x 2 B = 131,072 B a token; 8,192 tokens:
    kv = 131_072 * 8_192
    assert kv == 1_073_741_824
    # H100 SXM datasheet: 3.35 TB/s; BF16 1,979 TFLOPS with sparsity -> 989.4 dense.
    # bytes / bandwidth: 16,083,599,360 B / 3.35e12 B/s = 4.801074 ms
    # FLOPs: 2 x (matmul params: all but embed and norms) + attention 4 x 32 x 128 x 8,192
    # x 32 layers.
    matmul_params = 2 * 525_336_576 + 6_979_584_000 + 4_096 - 525_336_576 - 32 * 8_192 - 4_096
    flops = 2 * matmul_params + 4 * 32 * 128 * 8_192 * 32
    assert flops == 19_304_284_160
    compute_s = flops / 989.4e12  # 0.0195 ms: decode at batch 1 is bytes-bound, 246x over

    st = decode_step(LLAMA8, QuantPlan(), Deployment.of("h100-sxm"), 1, 8192, overhead_s=0.5e-3)
    assert (st.weight_bytes, st.kv_bytes) == (weights, kv)
    assert st.flops == {"bf16": flops, "int8": 0, "fp8": 0}
    assert st.bound == "memory"
    assert st.memory_s == pytest.approx(4.801074e-3, rel=1e-6)
    assert st.compute_s == pytest.approx(compute_s, rel=1e-12)
    assert st.step_s == pytest.approx(5.301074e-3, rel=1e-6)  # + 0.5 ms overhead


def _cpu(convert: dict, convert_b1: dict, pack: float | None = None):
    from tenantq.capacity.hardware import HardwareProfile

    # A CPU profile of run 1's order (docs/results/roofline.md): 20 GB/s, bf16 100 G/s.
    hw = HardwareProfile("cpu", 64 * 2**30, 20 * 10**9, "CPU", 100 * 10**9, 200 * 10**9,
                         None, tuple(convert.items()), tuple(convert_b1.items()),
                         dot_pack_elements_per_s=pack)  # fmt: skip
    return Deployment.of(hw)


def test_cpu_conversion_pass_adds_and_the_dot_reads_the_converted_copy():
    # Llama-3.1-8B (the hand check above): 7,504,658,432 matmul weight elements besides the
    # embedding (lm_head 525,336,576 + 32 x 218,103,808), norms 2 x 4,096 x 32 + 4,096 =
    # 266,240 elements (532,480 B in bf16), one embedding row of 4,096 (8,192 B) per token.
    matmul_elements, norm_bytes = 525_336_576 + 32 * 218_103_808, 532_480
    d = _cpu({"int8": 1e9}, {"bf16": 2e9, "int8": 1e9})
    int8 = QuantPlan((Rule(".*", "int8"),))
    # Batch 4, int8 weights (per output channel: + 4 B of scale per column): the pass
    # converts every matmul element at 1e9/s; the dot reads a bf16 copy (2 B each); the 4
    # embedding rows are gathered as stored (4 x (4,096 + 4) B), the norms read as stored.
    st = decode_step(LLAMA8, int8, d, 4, 512, overhead_s=1e-3)
    embed_elements = 4 * 4_096  # the rows gathered are converted too
    assert st.convert_s == pytest.approx((matmul_elements + embed_elements) / 1e9, rel=1e-12)
    read = 2 * matmul_elements + 4 * (4_096 + 4) + norm_bytes
    kv = kv_step_bytes(LLAMA8, int8, d, 4, 512)
    assert st.memory_s == pytest.approx((read + kv) / 20e9, rel=1e-12)
    assert st.step_s == pytest.approx(st.convert_s + max(st.memory_s, st.compute_s) + 1e-3)
    assert st.bound == "convert"
    # Batch 4 in bf16: no pass on the batched path, the dot reads the stored bf16 weights.
    bf16 = decode_step(LLAMA8, QuantPlan(), d, 4, 512, overhead_s=0.0)
    assert bf16.convert_s == 0.0
    assert bf16.step_s == pytest.approx(max(bf16.memory_s, bf16.compute_s), rel=1e-12)
    assert bf16.memory_s == pytest.approx((bf16.weight_bytes + bf16.kv_bytes) / 20e9)
    # Batch 1 in bf16: the one-row path converts to float32 (at 2e9/s) and reads 4 B each.
    one = decode_step(LLAMA8, QuantPlan(), d, 1, 512, overhead_s=0.0)
    assert one.convert_s == pytest.approx((matmul_elements + 4_096) / 2e9, rel=1e-12)
    kv1 = kv_step_bytes(LLAMA8, QuantPlan(), d, 1, 512)
    read1 = 4 * matmul_elements + 8_192 + norm_bytes
    assert one.memory_s == pytest.approx((read1 + kv1) / 20e9, rel=1e-12)
    # With the batched dot's packing pass (2e9 elements/s): every matmul weight once more,
    # bf16 included, for a batch (not the gathered embedding rows); none for one row.
    packed = _cpu({"int8": 1e9}, {"bf16": 2e9, "int8": 1e9}, pack=2e9)
    p8 = decode_step(LLAMA8, int8, packed, 4, 512, overhead_s=1e-3)
    assert p8.convert_s == pytest.approx(st.convert_s + matmul_elements / 2e9, rel=1e-12)
    p16 = decode_step(LLAMA8, QuantPlan(), packed, 4, 512, overhead_s=0.0)
    assert p16.convert_s == pytest.approx(matmul_elements / 2e9, rel=1e-12)
    assert decode_step(LLAMA8, QuantPlan(), packed, 1, 512).convert_s == one.convert_s


# Llama-3.1-8B's weights by shape one chip stores ([in, out]), elements per layer: q and o
# 2 x 4,096 x 4,096; k and v 2 x 4,096 x 1,024; gate and up 2 x 4,096 x 14,336; down
# 14,336 x 4,096 (32 layers); lm_head 4,096 x 128,256 (the published config).
QO, KV_, GATE_UP, DOWN = 33_554_432, 8_388_608, 117_440_512, 58_720_256
LM_HEAD, NORM_BYTES = 525_336_576, 532_480


def _shaped(*rates, convert=(), convert_b1=(), pack=None):
    from tenantq.capacity.hardware import HardwareProfile

    hw = HardwareProfile("cpu", 64 * 2**30, 20 * 10**9, "CPU", 100 * 10**9, 200 * 10**9,
                         None, tuple(convert), tuple(convert_b1), dot_pack_elements_per_s=pack,
                         shape_rates=tuple(rates))  # fmt: skip
    return Deployment.of(hw)


def test_each_weight_shape_takes_its_own_pass_rate():
    # Packing: [14336, 4096] (down) at 0.5e9/s, every other shape at the any-shape 1e9/s (the
    # table's 7e9 unused: a shape_rates entry wins); conversion of int8 to bf16: [4096, 1024]
    # (k, v) at 4e9/s, every other shape (and the 4 gathered embedding rows) at the per-format
    # table's 2e9/s. Batch 4, int8 weights.
    d = _shaped(("pack", "bf16", (), 1e9), ("pack", "bf16", (14_336, 4_096), 0.5e9),
                ("convert", "int8", (4_096, 1_024), 4e9), convert=[("int8", 2e9)],
                pack=7e9)  # fmt: skip
    int8 = QuantPlan((Rule(".*", "int8"),))
    st = decode_step(LLAMA8, int8, d, 4, 512, overhead_s=0.0)
    pack_s = (32 * (QO + KV_ + GATE_UP) + LM_HEAD) / 1e9 + 32 * DOWN / 0.5e9
    convert_s = (32 * (QO + GATE_UP + DOWN) + LM_HEAD + 4 * 4_096) / 2e9 + 32 * KV_ / 4e9
    assert st.convert_s == pytest.approx(pack_s + convert_s, rel=1e-12)
    # bf16 weights: no conversion, the packing alone, shape by shape.
    bf16 = decode_step(LLAMA8, QuantPlan(), d, 4, 512, overhead_s=0.0)
    assert bf16.convert_s == pytest.approx(pack_s, rel=1e-12)
    # One row: no packing; a per-shape float32 conversion for [4096, 14336] only.
    d1 = _shaped(("convert_b1", "bf16", (4_096, 14_336), 0.25e9), convert_b1=[("bf16", 1e9)])
    one = decode_step(LLAMA8, QuantPlan(), d1, 1, 512, overhead_s=0.0)
    rest = 32 * (QO + KV_ + DOWN) + LM_HEAD + 4_096
    assert one.convert_s == pytest.approx(rest / 1e9 + 32 * GATE_UP / 0.25e9, rel=1e-12)


def test_w4a8_weights_are_unpacked_then_read_as_8bit_codes_on_a_cpu_profile():
    # W4A8 on every projection and the head: each is unpacked at its shape's rate (gate/up at
    # 0.5e9/s, the rest at 1e9/s; one row: 2e9/s, every shape) and its int8 dot reads 1 B per
    # element; no bf16 packing (the pack rate is there for bf16 dots only); the untied
    # embedding's 4 rows and the norms are read as stored (bf16).
    d = _shaped(("unpack", "int4", (), 1e9), ("unpack", "int4", (4_096, 14_336), 0.5e9),
                ("unpack_b1", "int4", (), 2e9), pack=1e9)  # fmt: skip
    w4a8 = QuantPlan((Rule(".*_proj|lm_head", "int4", group_size=128, activations="int8"),))
    st = decode_step(LLAMA8, w4a8, d, 4, 512, overhead_s=0.0)
    matmul = 32 * (QO + KV_ + GATE_UP + DOWN) + LM_HEAD
    assert st.convert_s == pytest.approx((matmul - 32 * GATE_UP) / 1e9 + 32 * GATE_UP / 0.5e9)
    kv = kv_step_bytes(LLAMA8, w4a8, d, 4, 512)
    assert st.memory_s == pytest.approx((matmul + 4 * 8_192 + NORM_BYTES + kv) / 20e9)
    one = decode_step(LLAMA8, w4a8, d, 1, 512, overhead_s=0.0)
    assert one.convert_s == pytest.approx(matmul / 2e9, rel=1e-12)
    # With the grouped product's rate (5e9 FLOP/s, every shape): each W4A8 weight's 2 x 4 x n
    # FLOPs at that rate, after its unpack, and no longer at the int8 peak (counted once).
    g = _shaped(("unpack", "int4", (), 1e9), ("grouped", "int4", (), 5e9))
    gst = decode_step(LLAMA8, w4a8, g, 4, 512, overhead_s=0.0)
    assert gst.convert_s == pytest.approx(matmul / 1e9 + 2 * 4 * matmul / 5e9, rel=1e-12)
    assert gst.flops["int8"] == 2 * 4 * matmul  # the step's FLOPs are still all reported
    assert gst.compute_s == pytest.approx(gst.flops["bf16"] / 100e9, rel=1e-12)
    assert st.compute_s == pytest.approx(gst.compute_s + 2 * 4 * matmul / 200e9, rel=1e-12)
    # Without an unpack rate (an accelerator's kernel) the stored int4 bytes are read.
    plain = decode_step(LLAMA8, w4a8, _shaped(pack=1e9), 4, 512, overhead_s=0.0)
    assert plain.convert_s == 0.0
    stored = weight_step_bytes(LLAMA8, w4a8, 1, 4)
    assert plain.memory_s == pytest.approx((stored + kv) / 20e9, rel=1e-12)


def test_shape_rates_name_a_known_pass_and_a_shape():
    from tenantq.capacity.hardware import HardwareProfile

    with pytest.raises(ValueError, match=r"shape_rates pass 'packing' is unknown; valid: convert"):
        HardwareProfile("cpu", 2**30, 1, "CPU", shape_rates=(("packing", "bf16", (), 1e9),))
    with pytest.raises(ValueError, match=r"shape_rates shape \[4096\] must be a tuple"):
        HardwareProfile("cpu", 2**30, 1, "CPU", shape_rates=(("pack", "bf16", [4096], 1e9),))


@pytest.mark.parametrize(
    "plan",
    [
        QuantPlan.uniform("bf16", "bf16"),
        QuantPlan.uniform("int4", "int4"),  # bf16 page scales per channel/token, int4 packing
        QuantPlan(
            (Rule(".*", "fp8_e4m3"),),
            KVPlan(key_format="int8", value_format="fp8_e4m3", sink_tokens=4),
        ),  # fmt: skip
    ],
    ids=["bf16", "int4-int4", "fp8-int8kv-sinks"],
)
def test_step_bytes_are_the_budgets_own_counts(plan):
    d = Deployment.of("tpu-v6e", 2)
    b = budget(LLAMA8, plan, d, 4096)
    # KV: B tenants' bytes exactly as the budget counts one tenant, static scales once.
    assert kv_step_bytes(LLAMA8, plan, d, 7, 4096) == (
        7 * b.tenant_bytes_per_chip + b.kv_static_bytes_per_chip
    )
    # Weights: with a row per vocabulary entry gathered, every byte the budget holds.
    assert weight_step_bytes(LLAMA8, plan, 2, LLAMA8.vocab_size) == b.weights_bytes_per_chip
    assert weight_step_bytes(LLAMA8, plan, 2, 1) < b.weights_bytes_per_chip


def test_w8a8_and_w4a8_flops_run_in_their_activation_format():
    w4a8 = QuantPlan((Rule(".*_proj", "int4", activations="int8"),))
    f = step_flops(LLAMA8, w4a8, 1, 4, 100)
    per_layer = 2 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert f["int8"] == 4 * 32 * per_layer  # 4 tokens, every projection
    assert f["fp8"] == 0
    assert f["bf16"] == 4 * (2 * 4096 * 128256) + 4 * 32 * 128 * 100 * 32 * 4  # head + attention
    # TPU7x has no int8 figure: its int8 matmuls are costed at bf16's rate, and said so.
    s = tenants_at_slo(LLAMA8, w4a8, Deployment.of("tpu-v7"), 4096, "20tok/s")
    assert s.step.peaks["int8"] == HARDWARE["tpu-v7"].peak_bf16_flops_per_s
    assert any("no vendor peak for int8" in n for n in s.notes)
    assert not any("fp8" in n for n in s.notes)  # no fp8 matmul in this plan


@pytest.mark.parametrize(
    ("plan", "hardware", "named"),
    [
        (QuantPlan.uniform("int4", "fp8_e4m3"), "tpu-v5e", None),  # weight-only: bf16 matmuls
        (QuantPlan((Rule(".*_proj", "fp8_e4m3", activations="fp8_e4m3"),)), "tpu-v5e", "fp8"),
        (QuantPlan((Rule(".*_proj", "int8", activations="int8"),)), "tpu-v7", "int8"),
        (QuantPlan.uniform("bf16", "bf16"), "tpu-v7", None),
    ],
)
def test_missing_peak_note_names_only_formats_the_plan_computes_in(plan, hardware, named):
    # tpu-v5e has no fp8 figure, tpu-v7 no int8 one; a plan that never runs a matmul in that
    # format must not be told it was costed at the bf16 rate.
    s = tenants_at_slo(LLAMA8, plan, Deployment.of(hardware), 1024, "20tok/s")
    peak_notes = [n for n in s.notes if "no vendor peak" in n]
    if named is None:
        assert peak_notes == []
    else:
        assert peak_notes == [
            f"{hardware} has no vendor peak for {named}: matmuls in it are costed at the bf16 rate"
        ]


def test_vendor_peaks_are_dense_figures():
    # NVIDIA prints "with sparsity" (2x dense); Google's TPU pages print dense.
    expect = {
        "tpu-v5e": (197e12, 393e12, None, 819e9),
        # v5p int8: Google Cloud's v5p launch post (Dec 2023), 918 TOPS.
        "tpu-v5p": (459e12, 918e12, 459e12, 2765e9),
        "tpu-v6e": (918e12, 1836e12, 918e12, 1638e9),
        # TPU7x page table (docs.cloud.google.com/tpu/docs/tpu7x): 7380 GBps per chip.
        "tpu-v7": (2307e12, None, 4614e12, 7380e9),
        "h100-sxm": (989.4e12, 1978.9e12, 1978.9e12, 3350e9),
        "h200": (989.4e12, 1978.9e12, 1978.9e12, 4800e9),
        "b200": (2250e12, 4500e12, 4500e12, 7700e9),
    }
    for name, (bf16, int8, fp8, bw) in expect.items():
        hw = HARDWARE[name]
        got = (hw.peak_for("bf16"), hw.peak_for("int8"), hw.peak_for("fp8"))
        assert got == (bf16, int8, fp8), name
        assert hw.hbm_bandwidth_bytes_per_s == bw, name


def test_tenants_by_slo_is_the_last_batch_whose_decode_rate_meets_it():
    # The default SLO is a decode rate (TPOT): tenants by SLO is the largest B with
    # 1 / step(B) >= SLO, prefill not charged.
    plan, d = QuantPlan.uniform("int4", "fp8_e4m3"), Deployment.of("h100-sxm")

    def rate(b):
        return 1 / decode_step(LLAMA8, plan, d, b, 8192).step_s

    s = tenants_at_slo(LLAMA8, plan, d, 8192, "50tok/s")
    assert rate(s.tenants_by_slo) >= 50 > rate(s.tenants_by_slo + 1)
    assert s.tokens_per_s_per_tenant == s.decode_tokens_per_s_per_tenant
    assert (s.prompt_tokens, s.prefill_s, s.prefill_share) == (0, 0.0, 0.0)
    assert s.tenants_by_memory == budget(LLAMA8, plan, d, 8192).tenants
    assert s.tenants == min(s.tenants_by_memory, s.tenants_by_slo)
    assert s.binding == "slo" and s.tenants_by_slo < s.tenants_by_memory
    # 20 tok/s of decode: memory (135 tenants at 8K) binds first.
    loose = tenants_at_slo(LLAMA8, plan, d, 8192, 20)
    assert loose.binding == "memory" and loose.tenants == s.tenants_by_memory
    assert rate(loose.tenants_by_slo) >= 20 > rate(loose.tenants_by_slo + 1)
    assert tenants_at_slo(LLAMA8, plan, d, 8192, "100000tok/s").tenants == 0


def test_prompt_tokens_amortise_a_batched_prefill_over_the_output():
    plan, d = QuantPlan.uniform("int4", "fp8_e4m3"), Deployment.of("h100-sxm")
    s = tenants_at_slo(LLAMA8, plan, d, 8192, 30, prompt_tokens=1024, output_tokens=256)

    def rate(b):
        step = decode_step(LLAMA8, plan, d, b, 8192).step_s
        return tokens_per_s(step, prefill_s(LLAMA8, plan, d, 1024, b), 256)

    assert rate(s.tenants_by_slo) >= 30 > rate(s.tenants_by_slo + 1)
    decode_only = tenants_at_slo(LLAMA8, plan, d, 8192, 30)
    assert s.tenants_by_slo < decode_only.tenants_by_slo  # prefill costs chip time
    assert s.tokens_per_s_per_tenant < s.decode_tokens_per_s_per_tenant
    assert 0 < s.prefill_share < 1


def test_batched_prefill_reads_the_weights_once():
    # Llama-3.1-8B bf16 on H100: 16-token prompts are bytes-bound; the weights (15 GB) are
    # read once per batched pass, so 8 prompts cost far less than 8 single passes; KV written
    # per prompt is 16 x 131,072 B = 2 MiB, a rounding error beside them.
    plan, d = QuantPlan(), Deployment.of("h100-sxm")
    one, eight = prefill_s(LLAMA8, plan, d, 16, 1), prefill_s(LLAMA8, plan, d, 16, 8)
    assert one == pytest.approx(15_009_857_536 / 3.35e12, rel=2e-3)
    assert one < eight < 1.01 * one
    # 4,096-token prompts are compute-bound: the batch's time is 4 x one prompt's FLOPs.
    long1, long4 = prefill_s(LLAMA8, plan, d, 4096, 1), prefill_s(LLAMA8, plan, d, 4096, 4)
    assert long4 == pytest.approx(4 * long1, rel=1e-12)


@pytest.mark.parametrize(
    ("context", "prompt", "output", "message"),
    [
        (1, 1, 1, "prompt tokens 1 + output tokens 1 exceed the context of 1"),
        (256, 1, 512, "prompt tokens 1 + output tokens 512 exceed the context of 256"),
        (256, -1, 1, "prompt tokens must be an integer >= 0"),
        (256, 0, 0, "output tokens must be an integer >= 1"),
    ],
)
def test_request_that_does_not_fit_its_context_is_one_line(context, prompt, output, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        request_shape(context, prompt, output)


def test_decode_only_slo_takes_a_one_token_context():
    assert request_shape(1, 0, 256) == (0, 256)  # no prompt: nothing to fit, nothing cut
    s = tenants_at_slo(LLAMA8, QuantPlan(), Deployment.of("h100-sxm"), 1, 20)
    assert s.step.context_tokens == 1 and s.tenants > 0


def test_slo_search_that_reaches_its_cap_says_so(cli):
    plan, d = QuantPlan.uniform("int4", "fp8_e4m3"), Deployment.of("h100-sxm")
    s = tenants_at_slo(LLAMA8, plan, d, 8192, 1e-9)
    assert s.slo_capped and s.tenants_by_slo == MAX_TENANTS
    assert not tenants_at_slo(LLAMA8, plan, d, 8192, 20).slo_capped
    rc, out, _ = cli(["--model", "llama-3.1-8b", "--hardware", "h100", "--context", "8192",
                      "--weights", "int4", "--kv", "fp8_e4m3", "--slo", "1e-9"])  # fmt: skip
    assert rc == 0
    line = next(x for x in out.splitlines() if x.startswith("tenants by SLO"))
    assert line.endswith(f">= {MAX_TENANTS:,}   the search's cap (2^24)")


def test_cli_slo_when_memory_holds_no_tenant_says_memory_binds(cli):
    # bf16 Llama-3.1-8B (16.06 GB of weights) does not fit a 16 GiB v5e less its reserve.
    rc, out, _ = cli(["--model", "llama-3.1-8b", "--hardware", "tpu-v5e", "--context", "8192",
                      "--slo", "20tok/s"])  # fmt: skip
    assert rc == 0
    section = out[out.index("service level:") :]
    assert "bound by memory: no tenant of 8,192 tokens fits" in section
    assert "decode step at" not in section and "tenants by SLO" not in section


@pytest.mark.parametrize("text", ["0tok/s", "-1tok/s", "fast", "20tok/min", "inf tok/s", ""])
def test_bad_slo_is_one_line(text):
    with pytest.raises(ValueError, match=r"^slo: .*20tok/s$"):
        parse_slo(text)


def test_slo_spellings():
    # One rule for bare numbers, here and in the CLI: `20` and "20" are tokens/s.
    assert parse_slo("20tok/s") == parse_slo("20 tokens/s") == parse_slo(20) == 20.0
    assert parse_slo("20") == parse_slo(" 20 ") == 20.0
    assert parse_slo("12.5 tok / s") == 12.5


def test_cli_takes_a_bare_slo_number_as_tok_per_s(cli):
    argv = ["--model", "llama-3.1-8b", "--hardware", "h100", "--context", "8192", "--slo"]
    rc, bare, _ = cli([*argv, "20"])
    rc2, unit, _ = cli([*argv, "20tok/s"])
    assert rc == rc2 == 0 and bare == unit and "tenants at 20 tok/s" in bare


def test_cli_slo_reads_a_spaced_label_as_the_unspaced_one(cli):
    # `--slo "1500 tok/s"` (one shell word with a space) and `--slo 1500tok/s` are one SLO.
    argv = ["--model", "llama-3.1-8b", "--hardware", "h100", "--context", "8192", "--slo"]
    rc, spaced, _ = cli([*argv, "1500 tok/s"])
    rc2, packed, _ = cli([*argv, "1500tok/s"])
    assert rc == rc2 == 0 and spaced == packed and "tenants at 1500 tok/s" in spaced


@pytest.mark.parametrize("label", ["1500 tok/min", "1,500 tok/s", "tok/s", "1500 tps"])
def test_cli_bad_slo_label_is_one_line_naming_the_flag(cli, capsys, label):
    argv = ["--model", "llama-3.1-8b", "--hardware", "h100", "--context", "8192", "--slo"]
    with pytest.raises(SystemExit) as exit_:
        cli([*argv, label])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    want = rf"tenantq capacity: error: argument --slo: cannot read '{label}' .*20tok/s"
    assert re.fullmatch(want, last)


def test_cli_slo_prints_the_three_lines_and_json(cli):
    args = ["--model", "llama-3.1-8b", "--hardware", "h100", "--context", "8192",
            "--weights", "int4", "--kv", "fp8_e4m3", "--slo", "50tok/s"]  # fmt: skip
    rc, out, _ = cli(args)
    assert rc == 0
    s = tenants_at_slo(LLAMA8, QuantPlan.uniform("int4", "fp8_e4m3"), Deployment.of("h100"),
                       8192, 50)  # fmt: skip
    lines = {line.split("  ")[0]: line for line in out.splitlines()}
    assert lines["tenants by memory"].split()[-1] == f"{s.tenants_by_memory:,}"
    assert lines["tenants by SLO (50 tok/s)"].split()[-1] == f"{s.tenants_by_slo:,}"
    assert lines["tenants at 50 tok/s"].endswith("bound by the SLO")
    assert lines["decode tokens/s per tenant (1 / step)"].split()[-1] == (
        f"{s.decode_tokens_per_s_per_tenant:.1f}"
    )
    assert "= step time (memory-bound)" in out and "prefill of" not in out
    rc, out, _ = cli([*args, "--json"])
    d = json.loads(out)["service_level"]
    assert (d["tenants_at_slo"], d["binding"]) == (s.tenants, "slo")
    assert d["step"]["kv_bytes"] == s.step.kv_bytes
    # With prompt tokens both rates print, the SLO judged on the amortised one.
    rc, out, _ = cli([*args, "--prompt-tokens", "1024", "--output-tokens", "128"])
    p = tenants_at_slo(LLAMA8, QuantPlan.uniform("int4", "fp8_e4m3"), Deployment.of("h100"),
                       8192, 50, prompt_tokens=1024, output_tokens=128)  # fmt: skip
    lines = {line.split("  ")[0]: line for line in out.splitlines()}
    assert "1,024 new prompt + 128 output tokens" in out
    assert lines["tokens/s per tenant, prefill amortised"].split()[-1] == (
        f"{p.tokens_per_s_per_tenant:.1f}"
    )
    assert lines["tenants by SLO (50 tok/s)"].split()[-1] == f"{p.tenants_by_slo:,}"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--slo", "fast"], "argument --slo: cannot read 'fast' as a rate"),
        (["--slo", "0tok/s"], "argument --slo: '0tok/s' must be a positive"),
        (["--output-tokens", "64"], "--output-tokens applies only with --slo"),
        (["--slo", "20", "--output-tokens", "64"], "--output-tokens applies only with --prompt"),
        (
            ["--slo", "20", "--prompt-tokens", "8000"],
            "--prompt-tokens 8,000 + --output-tokens 256 exceed --context 8,192",
        ),
        (["--slo", "20tok/s", "--compare"], "--slo applies to one plan"),
        (["--slo", "20tok/s", "--step-overhead-ms", "-1"], "--step-overhead-ms: '-1'"),
    ],
)
def test_cli_bad_slo_input_is_one_line(capsys, extra, message):
    from tenantq.cli import main

    argv = ["capacity", "--model", "llama-3.1-8b", "--hardware", "h100", "--context", "8192"]
    try:
        rc = main([*argv, *extra])
    except SystemExit as exit_:  # argparse's own errors (a flag's type) exit 2 as well
        rc = exit_.code
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err


def test_cli_slo_on_plain_cpu_names_the_missing_figures(cli):
    rc, _, err = cli(["--model", "llama-3.1-8b", "--hardware", "cpu", "--memory", "64GiB",
                      "--context", "8192", "--slo", "20tok/s"])  # fmt: skip
    assert rc == 2 and "--slo: hardware cpu has no bandwidth and peak figures" in err


@pytest.mark.parametrize(
    "field",
    [
        {"convert_elements_per_s": (("int8", 0.0),)},
        {"convert_b1_elements_per_s": (("bf16", -1e9),)},
        {"convert_elements_per_s": (("int8", float("nan")),)},
        {"dot_pack_elements_per_s": 0.0},
        {"dot_pack_elements_per_s": float("inf")},
        {"shape_rates": (("pack", "bf16", (4096, 1024), 0.0),)},
    ],
)
def test_cpu_pass_rates_must_be_positive_and_finite(field):
    # A zero rate divides by zero in the step model; a negative one makes a step faster
    # than its bytes; an infinite one is a pass that costs nothing (leave the format out).
    from tenantq.capacity.hardware import HardwareProfile

    with pytest.raises(ValueError, match=r"hardware cpu: .* must be a positive, finite rate"):
        HardwareProfile("cpu", 2**30, 20 * 10**9, "CPU", 100 * 10**9, **field)
