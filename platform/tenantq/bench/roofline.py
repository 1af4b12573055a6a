"""`python -m tenantq.bench roofline`: the step-time model against the engine's measured steps.

A CPU profile by micro-benchmark: stream bandwidth (a copy of a large array, read plus
write bytes), matmul rate per compute format at the widest batch (bf16 x bf16, int8 x int8
-> int32, fp8 x fp8 -> float32, as the engine's matmul runs them), the rate of the pass in
which XLA:CPU converts each stored weight format before its dot (to a bf16 copy for a batch,
to float32 for one row; timed alone, over weights of the model's own shape) and the fixed
cost of one decode step (the engine on a tiny model). Then, for four plans (bf16; int8
weights; int4 weights + int8 KV; W4A8) and batches 1-64 on a random model of 214 MB, an
engine of exactly that many rows is timed per decode step beside
`capacity.roofline.decode_step` on the profile (measured once, or before each plan with
`--profile each`), and the relative error is given.
By default it runs on one core and times by the process's CPU clock, so that other users'
load on a shared machine does not enter the figures (`--clock wall` for all cores and wall
time). `TENANTQ_BENCH_SMOKE=1` shrinks everything to seconds.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import numpy as np

SMOKE_ENV = "TENANTQ_BENCH_SMOKE"
# The validation model: Llama-shaped, ~107M parameters (214 MB in bf16), far beyond L3.
MODEL = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_layers=8,
             num_heads=8, num_kv_heads=2, head_dim=128, max_position_embeddings=256)  # fmt: skip
SMOKE_MODEL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16,
                   max_position_embeddings=64)  # fmt: skip
PLANS = ("bf16", "int8-weights", "int4-weights+int8-kv", "w4a8")
TARGET_ERROR = 0.30  # the target, where the measured step is >= 1 ms
_clock = time.perf_counter  # time.process_time under --clock cpu (set in main)


# (best, worst, repeats) of each `_best_s` since the profile began: its noise, stated.
_TIMINGS: list[tuple[float, float, int]] = []


def _best_s(fn, repeats: int) -> float:
    """Best of `repeats` timed calls after one untimed (compile and warm); the spread of the
    repeats is kept in `_TIMINGS` for `_timing_spread`."""
    fn()  # compile and warm
    times = []
    for _ in range(repeats):
        t = _clock()
        fn()
        times.append(_clock() - t)
    _TIMINGS.append((min(times), max(times), len(times)))
    return min(times)


def _timing_spread() -> float | None:
    """The largest (worst - best) / best of the timings since `_TIMINGS` was cleared; None
    where none had two repeats (the noise was not measured)."""
    spreads = [(hi - lo) / lo for lo, hi, k in _TIMINGS if k > 1 and lo > 0]
    return max(spreads) if spreads else None


def _net_rate(amount: float, net_s: float, whole_s: float, what: str, floored: list) -> float:
    """`amount` / `net_s`, a time left after subtracting other terms from a `whole_s`
    timing; at most 10% of the whole it is noise, floored there and `what` is noted."""
    if net_s < 0.1 * whole_s:
        floored.append(what)
        net_s = 0.1 * whole_s
    return amount / net_s


def measure_bandwidth(nbytes: int, repeats: int) -> float:
    """STREAM copy: (read + write) bytes/s of copying `nbytes` of float32."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return 2 * src.nbytes / _best_s(lambda: np.copyto(dst, src), repeats)


def measure_convert(
    rows: int, cols: int, copies: int, bandwidth: float, wide: int, repeats: int,
    floored: list | None = None,
) -> tuple[dict, dict, float, float, float]:  # fmt: skip
    """Weight elements/s of the passes the engine's matmul runs before its dot on XLA:CPU,
    for `copies` distinct [rows, cols] weights (one shape class of the model), timed where
    the engine pays them: inside the engine's own `matmul`, whose converted copy is a
    temporary that XLA:CPU faults in afresh at every call (a copy returned as an output is
    not: the runtime may reuse its pages). Returns (to bf16 per format, to float32 per
    format, W4A8 unpack, W4A8 unpack at one row, W4A8 grouped product FLOP/s). Batched
    conversion: the matmul at 2 rows less a bf16 weight's at 2 rows (no conversion; the dot
    and its packing); one row: the matmul at 1 row less the time to read its float32 copy at
    `bandwidth`. W4A8 (int4/g128 weights, int8 activations): its grouped product's rate from
    its times at 2 and `wide` rows (2 (wide - 2) n FLOPs more), then the unpack as the
    matmul less the read of its 8-bit codes at `bandwidth` and its products at that rate."""
    import jax
    import jax.numpy as jnp

    from tenantq.model.layers import matmul
    from tenantq.numerics import quantize

    keys = jax.random.split(jax.random.key(0), copies)
    ws = [jax.random.normal(k, (rows, cols), jnp.float32) for k in keys]
    stored = {
        "bf16": [w.astype(jnp.bfloat16) for w in ws],
        "int8": [quantize(w, "int8", axis=0) for w in ws],
        "int4": [quantize(w, "int4", axis=0, group_size=128) for w in ws],
    }
    f = jax.jit(lambda x, qs: [matmul(x, q, dtype=jnp.bfloat16) for q in qs])
    w4a8 = jax.jit(lambda x, qs: [matmul(x, q, dtype=jnp.bfloat16, activations="int8") for q in qs])
    n = rows * cols * copies
    t = {}
    for m in (1, 2):
        x = jnp.ones((m, rows), jnp.bfloat16)
        for fmt, qs in stored.items():
            t[fmt, m] = _best_s(lambda x=x, qs=qs: jax.block_until_ready(f(x, qs)), repeats)
    for m in (1, 2, wide):
        x = jnp.ones((m, rows), jnp.bfloat16)
        qs = stored["int4"]
        t["w4a8", m] = _best_s(lambda x=x, qs=qs: jax.block_until_ready(w4a8(x, qs)), repeats)
    fl = [] if floored is None else floored  # names of the rates floored (`_net_rate`)
    out = {
        fmt: _net_rate(n, t[fmt, 2] - t["bf16", 2], t[fmt, 2], f"to bf16 {fmt}", fl)
        for fmt in ("int8", "int4")
    }
    read_s = 4 * n / bandwidth
    out_b1 = {fmt: _net_rate(n, t[fmt, 1] - read_s, t[fmt, 1], f"to f32 {fmt}", fl)
              for fmt in stored}  # fmt: skip
    tw = t["w4a8", wide]
    grouped = _net_rate(2 * (wide - 2) * n, tw - t["w4a8", 2], tw, "grouped", fl)
    unpack = {
        m: _net_rate(
            n,
            t["w4a8", m] - n / bandwidth - 2 * m * n / grouped,
            t["w4a8", m],
            "unpack" if m == 2 else "unpack 1 row",
            fl,
        )  # fmt: skip
        for m in (1, 2)
    }
    return out, out_b1, unpack[2], unpack[1], grouped


def measure_matmul(batch: int, size: int, repeats: int) -> dict[str, float]:
    """FLOP/s of [batch, size] x [size, size] in each compute format, as the engine runs it."""
    import jax
    import jax.numpy as jnp

    dims = (((1,), (0,)), ((), ()))
    out = {}
    for fmt, dtype, acc in (
        ("bf16", jnp.bfloat16, jnp.float32),
        ("int8", jnp.int8, jnp.int32),
        ("fp8", jnp.float8_e4m3fn, jnp.float32),
    ):
        x = jnp.ones((batch, size), dtype)
        w = jnp.ones((size, size), dtype)
        f = jax.jit(functools.partial(jax.lax.dot_general, dimension_numbers=dims,
                                      preferred_element_type=acc))  # fmt: skip
        run = functools.partial(lambda f, x, w: f(x, w).block_until_ready(), f, x, w)
        out[fmt] = 2 * batch * size * size / _best_s(run, repeats)
    return out


def bf16_dot_rates(t2: float, tb: float, n: int, batch: int, bandwidth: float):
    """(pack elements/s, FLOP/s) from a batched bf16 dot's times over n weight elements at 2
    and `batch` rows, inverting the step model's own charge for it (`capacity.roofline`):
    t(M) = n / pack + max(2 n / bandwidth, 2 M n / peak). Two rows are taken as bound by the
    weight read (2 n bytes; the dot reads its packed copy once more), `batch` rows by the
    products; where the rates found say otherwise at 2 rows, both times are taken as
    products (t(b) - t(2) = 2 (b - 2) n / peak)."""
    read_s = 2 * n / bandwidth
    pack_s = t2 - read_s
    if pack_s > 0 and tb - pack_s > read_s:
        peak = 2 * batch * n / (tb - pack_s)
        if 4 * n / peak <= read_s:
            return n / pack_s, peak
    # Too small or too noisy to tell apart (t(batch) <= t(2)): all of t(batch) as products.
    wide = tb > t2
    peak = 2 * (batch - 2) * n / (tb - t2) if wide else 2 * batch * n / tb
    pack_s = max(t2 - max(read_s, 4 * n / peak), 0.1 * t2)
    return n / pack_s, peak


def measure_bf16_dot(rows: int, cols: int, copies: int, batch: int, bandwidth: float, repeats: int):
    """(pack elements/s, FLOP/s) of XLA:CPU's batched bf16 dot over `copies` distinct
    [rows, cols] weights, timed at 2 rows (the weight passes dominate) and at `batch` rows:
    two equations for the two rates (`bf16_dot_rates`)."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(1), copies)
    ws = [jax.random.normal(k, (rows, cols), jnp.bfloat16) for k in keys]
    n = rows * cols * copies
    dims = (((1,), (0,)), ((), ()))
    f = jax.jit(lambda x, ws: [jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
                               for w in ws])  # fmt: skip
    t = {}
    for m in (2, batch):
        x = jnp.ones((m, rows), jnp.bfloat16)
        t[m] = _best_s(lambda x=x: jax.block_until_ready(f(x, ws)), repeats)
    return bf16_dot_rates(t[2], t[batch], n, batch, bandwidth)


def _plan(name: str):
    from tenantq.quant.plan import KVPlan, QuantPlan, Rule

    if name == "bf16":
        return QuantPlan()
    if name == "int8-weights":
        return QuantPlan((Rule(".*", "int8"),))
    if name == "w4a8":  # int4/g128 projections and head on int8 activations; bf16 embedding
        return QuantPlan((Rule(".*_proj|lm_head", "int4", group_size=128, activations="int8"),))
    return QuantPlan((Rule(".*", "int4"),), KVPlan(key_format="int8", value_format="int8"))


def measure_step(engine, batch: int, prompt: int, steps: int, repeats: int) -> float:
    """Best mean seconds per decode step of `batch` sequences after a `prompt`-token prefill."""
    rng = np.random.default_rng(batch)
    best = float("inf")
    for attempt in range(repeats + 1):  # the first compiles
        prompts = rng.integers(3, engine.config.vocab_size, (batch, prompt)).tolist()
        run, logits = engine.prefill(prompts, reserve_tokens=steps)
        try:
            tokens = np.argmax(logits, axis=-1)
            t = _clock()
            for _ in range(steps):
                tokens = np.argmax(engine.decode(run, tokens), axis=-1)
            elapsed = (_clock() - t) / steps
        finally:
            engine.release(run)
        if attempt:
            best = min(best, elapsed)
    return best


def step_overhead_s(steps: int, repeats: int) -> float:
    """The engine's decode step on `tiny_config` at batch 1: bytes and FLOPs ~0, cost fixed."""
    from tenantq.engine import Engine
    from tenantq.testing import tiny_config, tiny_params

    cfg = tiny_config()
    engine = Engine(cfg, tiny_params(cfg), max_seqs=1, max_seq_tokens=64)
    return measure_step(engine, 1, 8, steps, repeats)


def weight_shapes(config) -> list[tuple[int, int]]:
    """The model's matmul weight shapes as one chip stores them ([in, out]; the head's), each
    once, largest share of the elements first: the shape classes a CPU profile measures."""
    from tenantq.capacity.weights import tensor_bytes
    from tenantq.quant.plan import QuantPlan

    elements: dict[tuple[int, int], int] = {}
    for t in tensor_bytes(config, QuantPlan(), 1):
        if t.line in ("norms", "embed") and not (t.line == "embed" and config.tie_word_embeddings):
            continue
        shape = tuple(t.shard_shape)
        elements[shape] = elements.get(shape, 0) + shape[0] * shape[1]
    return sorted(elements, key=lambda s: -elements[s])


def shape_rates(shape: tuple[int, int], r: dict, *, largest: bool) -> list[tuple]:
    """`HardwareProfile.shape_rates` entries of one measured shape class (`r`: its figures
    in `cpu_profile`'s `by_shape`); the `largest` class's rates are also every pass's
    any-shape rate (shape ()), taken by a weight of a shape the profile did not measure."""
    out = []
    for key in (shape, ()) if largest else (shape,):
        out += [("convert", f, key, v) for f, v in r["convert"].items()]
        out += [("convert_b1", f, key, v) for f, v in r["convert_b1"].items()]
        out += [("pack", "bf16", key, r["pack"]), ("unpack", "int4", key, r["unpack"]),
                ("unpack_b1", "int4", key, r["unpack_b1"]),
                ("grouped", "int4", key, r["grouped"])]  # fmt: skip
    return out


def cpu_profile(args) -> tuple[object, dict]:
    """The CPU profile: stream bandwidth, matmul peaks, then every pass rate per shape class
    of the validation model (`weight_shapes`), each over ~`convert_copies` MLP weights'
    worth of elements; the largest class's rates are also the any-shape defaults."""
    from tenantq.capacity.hardware import HardwareProfile
    from tenantq.model.config import ModelConfig

    shape = SMOKE_MODEL if args.smoke else MODEL
    config = ModelConfig(model_type="llama", **shape)
    bw = measure_bandwidth(args.stream_bytes, args.repeats + 2)
    peaks = measure_matmul(max(args.batches), args.matmul_size, args.repeats)
    budget = args.convert_copies * shape["hidden_size"] * shape["intermediate_size"]
    per_shape, rates = {}, []
    _TIMINGS.clear()
    for i, (rows, cols) in enumerate(weight_shapes(config)):
        copies = max(1, round(budget / (rows * cols)))
        floored: list[str] = []
        convert, convert_b1, unpack, unpack_b1, grouped = measure_convert(
            rows, cols, copies, bw, max(max(args.batches), 4), args.repeats, floored
        )
        pack, bf16_peak = measure_bf16_dot(
            rows, cols, copies, max(max(args.batches), 4), bw, args.repeats
        )
        per_shape[f"{rows}x{cols}"] = {
            "copies": copies, "convert": convert, "convert_b1": convert_b1,
            "pack": pack, "unpack": unpack, "unpack_b1": unpack_b1, "grouped": grouped,
            "bf16_peak": bf16_peak, "floored": floored,
        }  # fmt: skip
        rates += shape_rates((rows, cols), per_shape[f"{rows}x{cols}"], largest=i == 0)
        if i == 0:  # the products alone, on the largest class: the packing is `pack`
            peaks["bf16"] = bf16_peak
        print(f"profile {rows}x{cols}: {json.dumps(per_shape[f'{rows}x{cols}'])}",
              file=sys.stderr, flush=True)  # fmt: skip
    overhead = step_overhead_s(args.steps, args.repeats)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    profile = HardwareProfile(
        "cpu-measured", memory, int(bw), "this CPU, measured by python -m tenantq.bench roofline",
        peak_bf16_flops_per_s=int(peaks["bf16"]), peak_int8_ops_per_s=int(peaks["int8"]),
        peak_fp8_flops_per_s=int(peaks["fp8"]), shape_rates=tuple(rates),
    )  # fmt: skip
    figures = {"bandwidth_bytes_per_s": bw, "peak_per_s": peaks, "step_overhead_s": overhead,
               "by_shape": per_shape, "repeats": args.repeats,
               "timing_spread": _timing_spread()}  # fmt: skip
    return profile, figures


def _loadavg() -> list[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def run(args) -> dict:
    from tenantq.capacity.hardware import Deployment
    from tenantq.capacity.roofline import decode_step
    from tenantq.capacity.weights import tensor_bytes
    from tenantq.engine import Engine
    from tenantq.model.config import ModelConfig
    from tenantq.model.decoder import init_params

    load_before = _loadavg()
    shape = SMOKE_MODEL if args.smoke else MODEL
    config = ModelConfig(model_type="llama", **shape)
    params = init_params(config, seed=0)
    rows, profiles = [], []
    started, started_cpu = time.monotonic(), time.process_time()
    for i, name in enumerate(args.plans):
        # `--profile each`: measured again before each plan's steps (on a shared machine the
        # ratio of a step to the micro-benchmarks beside it is what stays meaningful);
        # `once` (default): one profile for every plan, a bounded run on a quiet machine.
        if i == 0 or args.profile == "each":
            profile, figures = cpu_profile(args)
            profiles.append({"plan": name if args.profile == "each" else "all", **figures})
            print(json.dumps(profiles[-1]), file=sys.stderr, flush=True)  # progress, to poll
        plan = _plan(name)
        counted = sum(t.bytes_per_chip for t in tensor_bytes(config, plan, 1))
        for b in args.batches:
            # The engine pads every decode step to its `max_seqs` rows (one executable for
            # all batches): an engine of exactly `b` rows runs a step of `b` tenants.
            engine = Engine(config, params, plan, max_seqs=b,
                            max_seq_tokens=args.prompt + args.steps)  # fmt: skip
            stored = sum(engine.memory_report().weight_bytes.values())
            deployment = Deployment(profile, 1, engine.cache.page_tokens)
            measured = measure_step(engine, b, args.prompt, args.steps, args.repeats)
            # A decode step reads the cache's whole window (steps.DECODE_MIN_KV_TOKENS).
            context = engine.cache.max_seq_tokens
            st = decode_step(config, plan, deployment, b, context,
                             overhead_s=figures["step_overhead_s"])  # fmt: skip
            rows.append({
                "plan": name, "batch": b, "context_tokens": context,
                "measured_ms": measured * 1e3, "predicted_ms": st.step_s * 1e3,
                "memory_ms": st.memory_s * 1e3, "compute_ms": st.compute_s * 1e3,
                "convert_ms": st.convert_s * 1e3,
                "bound": st.bound, "error": st.step_s / measured - 1,
                "weights_stored_bytes": stored, "weights_counted_bytes": counted,
            })  # fmt: skip
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            del engine
    load_after = _loadavg()
    wall_s, cpu_s = time.monotonic() - started, time.process_time() - started_cpu
    judged = [r for r in rows if r["measured_ms"] >= 1.0]
    return {
        "profile": profiles[0],
        "profiles": profiles,
        "model": shape,
        "rows": rows,
        "max_abs_error_at_1ms": max((abs(r["error"]) for r in judged), default=None),
        "within_target": sum(abs(r["error"]) <= TARGET_ERROR for r in judged),
        "judged": len(judged),
        "clock": "process CPU time, one core" if _clock is time.process_time else "wall",
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "wall_s": wall_s,  # the run's length on this machine, its load included
        "cpu_s": cpu_s,  # its CPU time: about its wall time on a quiet machine (one core)
    }


def _profile_line(p: dict) -> str:
    peaks = ", ".join(f"{k} {v / 1e9:.1f} G/s" for k, v in p["peak_per_s"].items())
    lines = [
        f"{p.get('plan', '')}: stream {p['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; matmul "
        f"{peaks}; step overhead {p['step_overhead_s'] * 1e3:.2f} ms; timings: "
        + (
            "one repeat each: noise not measured"
            if p.get("timing_spread") is None
            else f"best of {p['repeats']} repeats, spread up to {p['timing_spread']:.0%}"
        )
        + "; passes, G elements/s:"
    ]
    for shape, r in p["by_shape"].items():
        conv = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in r["convert"].items())
        conv1 = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in r["convert_b1"].items())
        lines.append(
            f"  {shape:>10} x{r['copies']:<3} to bf16 {conv}; to f32 (1 row) {conv1}; "
            f"bf16 packing {r['pack'] / 1e9:.2f}; W4A8 unpack {r['unpack'] / 1e9:.2f}, "
            f"1 row {r['unpack_b1'] / 1e9:.2f}; W4A8 grouped product "
            f"{r.get('grouped', float('nan')) / 1e9:.1f} GFLOP/s"
            + (f"; at the 10% floor: {', '.join(r['floored'])}" if r.get("floored") else "")
        )
    return "\n".join(lines)


def render(result: dict) -> str:
    out = [
        "CPU profile, measured "
        + ("before each plan's steps:" if len(result.get("profiles", [])) > 1 else "once:"),
        *(_profile_line(p) for p in result.get("profiles", [result["profile"]])),
        f"model: {result['model']}; clock: {result.get('clock', 'wall')}",
        "",
        f"{'plan':<22}{'batch':>6}{'measured ms':>13}{'predicted ms':>14}{'memory ms':>11}"
        f"{'compute ms':>12}{'convert ms':>12}  {'bound':<8}{'error':>8}",
    ]
    for r in result["rows"]:
        out.append(
            f"{r['plan']:<22}{r['batch']:>6}{r['measured_ms']:>13.2f}{r['predicted_ms']:>14.2f}"
            f"{r['memory_ms']:>11.2f}{r['compute_ms']:>12.2f}{r['convert_ms']:>12.2f}"
            f"  {r['bound']:<8}"
            f"{r['error']:>+8.0%}"
        )
    worst = result["max_abs_error_at_1ms"]
    out.append("")
    out.append(
        f"steps >= 1 ms: {result['within_target']} of {result['judged']} within "
        f"{TARGET_ERROR:.0%}; largest |error| "
        + ("n/a" if worst is None else f"{worst:.0%}")
        + f"; load {' '.join(result['loadavg_before'])} -> {' '.join(result['loadavg_after'])}"
        + (
            f"; wall time {result['wall_s']:.0f} s, CPU time {result['cpu_s']:.0f} s"
            if "wall_s" in result
            else ""
        )
    )
    for name in dict.fromkeys(r["plan"] for r in result["rows"]):
        r = next(x for x in result["rows"] if x["plan"] == name)
        out.append(
            f"{name}: engine holds {r['weights_stored_bytes']:,} B of weights; the budget "
            f"counts {r['weights_counted_bytes']:,} B"
        )
    return "\n".join(out)


def _positive(text: str) -> int:
    """An integer >= 1 (argparse names the flag when this raises)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give one >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _batches(text: str) -> list[int]:
    """Comma-separated batch sizes, each >= 1, e.g. 1,4,16,64."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("no batch sizes; give e.g. 1,4,16,64")
    return [_positive(p) for p in parts]


def _plans(text: str) -> list[str]:
    """Comma-separated plan names of `PLANS`, at least one."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in PLANS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"{'unknown ' + ', '.join(bad) if bad else 'no plans'}; valid: {', '.join(PLANS)}"
        )
    return names


def main(argv: list[str]) -> int:
    smoke = os.environ.get(SMOKE_ENV, "") not in ("", "0")
    parser = argparse.ArgumentParser(prog="python -m tenantq.bench roofline", description=__doc__)
    parser.add_argument("--batches", type=_batches, default="1,2,4" if smoke else "1,4,16,64")
    parser.add_argument(
        "--plans", type=_plans, default=",".join(PLANS), help=f"of {', '.join(PLANS)}"
    )
    parser.add_argument("--prompt", type=_positive, default=8 if smoke else 32)
    parser.add_argument("--steps", type=_positive, default=2 if smoke else 6, help="timed steps")
    parser.add_argument("--repeats", type=_positive, default=1 if smoke else 2)
    parser.add_argument("--stream-bytes", type=_positive, default=2**20 if smoke else 2**29)
    parser.add_argument("--matmul-size", type=_positive, default=128 if smoke else 2048)
    parser.add_argument(
        "--convert-copies", type=_positive, default=2 if smoke else 8,
        help="elements each shape class's pass benchmarks cover, in weights of the model's MLP "
        "shape (a [1024, 256] class takes ~11 weights per MLP weight)",
    )  # fmt: skip
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: one core, process CPU time (default; a shared machine's load stays out); "
        "wall: all cores, wall time",
    )
    parser.add_argument(
        "--profile", choices=("once", "each"), default="once",
        help="measure the CPU profile once for all plans (default) or again before each plan",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    global _clock
    if args.clock == "cpu":  # before JAX starts its thread pool
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        _clock = time.process_time
    args.smoke = smoke
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0
