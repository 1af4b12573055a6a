"""`Engine`: batched prefill, decode, greedy generation and scoring over one model + plan.

The engine holds the params exactly as a server would (quantized leaves stay `QArray`),
the NNX graph split from them, and a KV cache it reaches only through the `KVCache`
interface. Public methods take and return token ids and numpy arrays; batches are padded
on the right to power-of-two buckets (with per-sequence positions and a validity mask) so
few shapes are compiled, and batches larger than the cache's sequence limit are chunked.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tenantq.engine import sharding, steps
from tenantq.engine.allocator import DEFAULT_TENANT
from tenantq.engine.cache import KVCache
from tenantq.engine.memory import MemoryReport, memory_report, tensor_nbytes
from tenantq.engine.pool import PagedPool
from tenantq.model.config import ModelConfig
from tenantq.model.decoder import Decoder, check_supported
from tenantq.numerics import QArray
from tenantq.quant.apply import apply_plan, check_quantized
from tenantq.quant.plan import QuantPlan
from tenantq.storage.tp import tp_split_axis

_MIN_BUCKET = 16  # smallest padded sequence / KV window, in tokens
# Compute dtypes the engine runs: bfloat16 as a server does, float32 for parity with a
# reference implementation. (float64 would need JAX's x64 mode; integer dtypes are formats,
# chosen per tensor by the plan.)
COMPUTE_DTYPES = ("bfloat16", "float32")


def compute_dtype(dtype: Any) -> np.dtype:
    """`dtype` as a numpy dtype if it is one the engine computes in; else a ValueError."""
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in COMPUTE_DTYPES:
        hint = ""
        if resolved is not None and resolved.kind in "iub":
            hint = " (integer formats are chosen per tensor by the plan, e.g. int8 rules)"
        elif resolved is not None and resolved.name == "float64":
            hint = " (JAX computes float64 only in x64 mode; float32 is the parity dtype)"
        raise ValueError(
            f"dtype {dtype!r} is not a compute dtype the engine runs; valid: "
            f"{', '.join(COMPUTE_DTYPES)}{hint}"
        )
    return resolved


@dataclasses.dataclass
class Batch:
    """Live sequences in the cache: their ids and how many tokens each holds."""

    seq_ids: list[int]
    lengths: np.ndarray  # tokens each sequence holds
    capacity: np.ndarray  # tokens each sequence was allocated


class Engine:
    """Run a Llama-family model under a `QuantPlan`.

    `Engine(config, params, plan)` takes in-memory params: full precision (the engine applies
    the plan once, `apply_plan`) or already quantized under `plan` (`apply_plan`'s output, a
    calibrator's; checked, never quantized again); `from_checkpoint` loads and quantizes
    tensor by tensor. `dtype` is the compute dtype and the dtype of every unquantized tensor
    (bfloat16 for serving, float32 for parity). `tp=N` shards params and cache over N
    local devices (`tenantq.engine.sharding`), with whole-tensor (`scale_scope="global"`)
    or per-shard (`"shard"`) scales. Other keyword options go to the default cache, the
    paged pool (`page_tokens`, `num_pages` or `pool_bytes`, `max_seqs`, `max_seq_tokens`:
    see `PagedPool`); `cache=` passes another `KVCache` (e.g. `ContiguousCache`).
    """

    def __init__(
        self,
        config: ModelConfig,
        params: dict[str, Any],
        plan: QuantPlan | None = None,
        *,
        dtype: Any = "bfloat16",
        tokenizer: Any = None,
        cache: KVCache | None = None,
        tp: int | None = None,
        scale_scope: str = "global",
        **pool_options: Any,
    ):
        check_supported(config)
        self.config = config
        self.plan = plan or QuantPlan()
        self.dtype = compute_dtype(dtype)
        if scale_scope not in sharding.SCALE_SCOPES:
            raise ValueError(
                f"scale_scope={scale_scope!r}; valid: {', '.join(sharding.SCALE_SCOPES)}"
            )
        # tp=N: quantize (scale_scope "global" or per "shard") and place on a tp-device mesh.
        self.mesh = None if tp is None else sharding.make_mesh(tp, config)
        self.params = self._build_params(params, scale_scope)
        activations = {
            p: t.activations for p, t in self.plan.resolve(config).items() if t.activations
        }
        self.model = Decoder(config, self.params, dtype=self.dtype, activations=activations)
        self._graphdef, self._state = nnx.split(self.model)
        self._layout = steps.layout_id(self._graphdef, self._state)
        if cache is not None and pool_options:
            raise ValueError(
                f"pass either a cache or cache options, not both: {sorted(pool_options)}"
            )
        self.tp, self.scale_scope = 1 if tp is None else tp, scale_scope
        self.cache: KVCache = cache if cache is not None else self._build_pool(pool_options)
        self.cache.check_plan(self.plan, config)
        if self.mesh is not None:
            self.cache.state = sharding.shard_cache_state(self.cache.state, self.mesh)
        self.tokenizer = tokenizer
        self.stats = steps.StepStats()

    def _build_params(self, params: dict[str, Any], scale_scope: str) -> dict[str, Any]:
        """The params the decoder holds, the plan applied exactly once.

        Full-precision params are quantized here (`apply_plan`, per tp shard when
        scale_scope="shard"); params holding QArrays were quantized already (`apply_plan`,
        `load_quantized`, a calibrator) and are only checked against the plan
        (`check_quantized`) and, under scale_scope="shard", for scales that stay inside a
        shard (`sharding.check_shard_scales`): never quantized again. Unquantized tensors
        are cast to the compute dtype; under tp everything is then placed on the mesh."""
        if any(isinstance(v, QArray) for v in params.values()):
            check_quantized(params, self.plan, self.config)
            if self.mesh is not None and scale_scope == "shard":
                sharding.check_shard_scales(params, self.config, self.mesh.shape[sharding.AXIS])
        else:
            tp = 1 if self.mesh is None else self.mesh.shape[sharding.AXIS]
            axes = None
            if scale_scope == "shard" and tp > 1:
                axes = {p: tp_split_axis(p, self.config, tp) for p in params}
            params = apply_plan(params, self.plan, self.config, shard_axes=axes, tp=tp)
        params = {
            path: v if isinstance(v, QArray) else jnp.asarray(v, self.dtype)
            for path, v in params.items()
        }
        if self.mesh is not None:
            params = sharding.shard_params(params, self.config, self.mesh)
        return params

    def _build_pool(self, pool_options: dict[str, Any]) -> PagedPool:
        """The default cache: a paged pool sized beside the weights one chip holds."""
        weights = (
            max(sharding.device_bytes(self.params).values())
            if self.mesh is not None
            else sum(tensor_nbytes(v) for v in self.params.values())
        )
        return PagedPool(
            self.config, self.plan, dtype=self.dtype.name, weights_bytes=weights, tp=self.tp,
            **pool_options,
        )  # fmt: skip

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        plan: QuantPlan | None = None,
        *,
        dtype: Any = "bfloat16",
        tp: int | None = None,
        scale_scope: str = "global",
        **pool_options,
    ) -> Engine:
        """Load a Hugging Face folder (safetensors; tokenizer.json optional) under `plan`.

        A compressed-tensors folder (`tenantq export`) loads under its own plan and static
        KV scales when `plan` is None."""
        from tenantq.model.compressed import checkpoint_plan
        from tenantq.model.config import is_compressed_tensors
        from tenantq.model.tokenizer import load_tokenizer
        from tenantq.quant.apply import load_quantized

        config = ModelConfig.from_file(path)
        check_supported(config)
        if plan is None and is_compressed_tensors(path):  # its plan and KV scales are stored
            stored, kv_scales = checkpoint_plan(path, config)
            plan = QuantPlan.from_dict(stored)
            if kv_scales is not None:
                pool_options.setdefault("kv_scales", kv_scales)
        per_shard = tp is not None and scale_scope == "shard"  # quantized per shard in __init__
        params = load_quantized(
            path, config, None if per_shard else plan,
            dtype=jnp.float32 if per_shard else compute_dtype(dtype),
        )  # fmt: skip
        return cls(
            config, params, plan, dtype=dtype, tokenizer=load_tokenizer(path), tp=tp,
            scale_scope=scale_scope, **pool_options,
        )  # fmt: skip

    # ------------------------------------------------------------------ public calls
    def logits(self, token_ids) -> np.ndarray:
        """Float32 logits [batch, seq, vocab] of a full prefill; ragged rows are zero-padded."""
        rows = self._rows(token_ids, "token_ids")
        width = max(len(r) for r in rows)
        out = np.zeros((len(rows), width, self.config.vocab_size), np.float32)
        for start, chunk in self._chunks(rows):
            values = np.asarray(self._prefill_chunk(chunk, "all", reserve=0)[0])
            for i, r in enumerate(chunk):
                out[start + i, : len(r)] = values[i, : len(r)]
        return out

    def score(
        self, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]
    ) -> list[np.ndarray]:
        """Per-token log-probabilities (float32) of each continuation given its prompt."""
        prompts = self._rows(prompts, "prompts")
        conts = self._rows(continuations, "continuations", allow_empty=True)
        if len(prompts) != len(conts):
            raise ValueError(f"{len(prompts)} prompts but {len(conts)} continuations")
        rows = [p + c for p, c in zip(prompts, conts, strict=True)]
        out: list[np.ndarray] = []
        for start, chunk in self._chunks(rows):
            targets = [r[1:] for r in chunk]
            logp = np.asarray(self._prefill_chunk(chunk, "all", reserve=0, targets=targets)[1])
            for i in range(len(chunk)):
                p, c = len(prompts[start + i]), len(conts[start + i])
                out.append(np.asarray(logp[i, p - 1 : p - 1 + c], np.float32))
        return out

    def device_logits(
        self, token_ids, *, kv_tokens: int | None = None
    ) -> Iterator[tuple[int, jax.Array, jax.Array]]:
        """The full-prefill logits of `token_ids`, left on the device, one chunk at a time.

        Yields `(start, logits, next_logp)` per chunk of up to `max_seqs` rows: float32
        `logits` [b, s, V] and `next_logp` [b, s] = log p(row[t + 1] | row[:t + 1]) for rows
        `start, start + 1, ...`. `b` and `s` are the padded bucket (at least the chunk's rows
        and its longest row); entries past a row's end are padding, and the last position of
        a row has no next token (its `next_logp` is that of id 0). Nothing [b, s, V] is
        copied to the host: compare against it inside jit (KL, top-1) and fetch the result.
        `kv_tokens`: read at least this KV window (a static shape: a suite that runs every
        step at one window compiles one body executable for them all).
        """
        rows = self._rows(token_ids, "token_ids")
        for start, chunk in self._chunks(rows):
            targets = [r[1:] for r in chunk]
            logits, next_logp = self._prefill_chunk(
                chunk, "all", reserve=0, targets=targets, kv_tokens=kv_tokens
            )
            yield start, logits, next_logp

    def continuation_logits(
        self,
        prompts: Sequence[Sequence[int]],
        continuations: Sequence[Sequence[int]],
        *,
        chunk_tokens: int | None = None,
        kv_tokens: int | None = None,
    ) -> list[np.ndarray]:
        """Teacher-forced next-token logits: float32 [len(c), V] per (prompt p, continuation
        c), row k = the logits after p + c[:k], i.e. those that choose c[k].

        One prefill of p + c[:-1] through the cache (KV written, then read back, as decode
        does), in steps of `chunk_tokens` tokens (each step padded to exactly that width) at
        a KV window of at least `kv_tokens`: with both fixed, every step has one shape.
        Greedy decoding emits c iff each row's argmax is its c[k]; whether these logits are
        the ones decode computes is `teacher_forcing_exact`.
        """
        prompts = self._rows(prompts, "prompts")
        conts = self._rows(continuations, "continuations")
        if len(prompts) != len(conts):
            raise ValueError(f"{len(prompts)} prompts but {len(conts)} continuations")
        if chunk_tokens is not None and (
            isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1
        ):
            raise ValueError(f"chunk_tokens must be a whole number >= 1, got {chunk_tokens!r}")
        rows = [p + c[:-1] for p, c in zip(prompts, conts, strict=True)]
        out: list[np.ndarray] = []
        for start, chunk in self._chunks(rows):
            firsts = [len(p) - 1 for p in prompts[start : start + len(chunk)]]
            out.extend(self._teacher_forced_chunk(chunk, firsts, chunk_tokens, kv_tokens))
        return out

    def teacher_forcing_exact(
        self, prompt_tokens: int, continuation_tokens: int, step_tokens: int | None = None
    ) -> bool:
        """Whether `continuation_logits(..., chunk_tokens=step_tokens)` computes, for a prompt
        and continuation of these lengths, the same cache reads greedy decode does (equal up
        to float reassociation). `step_tokens`: the teacher-forced prefill's step (None: one
        prefill of the whole row).

        Per-token, static-scale and bf16 KV are written token by token either way. Keys or
        values scaled per channel wait in a bf16 residual page until their page fills, so a
        position reads its own page quantized iff that page is full when it is computed.
        Token-scaled nvfp4 (not nvfp4 per channel, which takes the residual path) fixes a
        page's tensor scale from the call that opens the page. Both
        are compared position by position between the two schedules: generate prefills the
        prompt in one call and then writes one token per call; teacher forcing writes
        prompt + continuation[:-1] in steps of `step_tokens` from position 0. A step that is
        not a multiple of the page makes a page fill (or open) mid-step, and such rows fall
        back to decoding."""
        if step_tokens is not None and (
            isinstance(step_tokens, bool) or not isinstance(step_tokens, int) or step_tokens < 1
        ):
            raise ValueError(f"step_tokens must be a whole number >= 1, got {step_tokens!r}")
        layers = self.cache.kv_layers()
        specs = [s for kv in layers for s in (kv.keys, kv.values) if s.quantized]
        channel = any(s.needs_residual for s in specs)
        # nvfp4 scaled per channel takes the residual path (PagedPool.write): whole pages are
        # quantized when full, so only the token-scaled kind fixes a scale at a page's opening
        nvfp4 = any(s.format == "nvfp4" and not s.static and not s.needs_residual for s in specs)
        if not (channel or nvfp4):
            return True
        page = self.cache.page_tokens
        written = prompt_tokens + continuation_tokens - 1  # tokens the forced prefill writes
        step = step_tokens or max(written, 1)
        t = np.arange(written)
        forced_end = np.minimum((t // step + 1) * step, written)  # written when t is computed
        decode_end = np.maximum(t + 1, prompt_tokens)
        page_end = (t // page + 1) * page
        if channel and np.any((page_end <= forced_end) != (page_end <= decode_end)):
            return False
        if nvfp4:  # the tokens the opening call writes into each page
            opens = t[t % page == 0]
            forced = np.minimum(page_end[opens], forced_end[opens])
            decoded = np.minimum(page_end[opens], decode_end[opens])
            if np.any(forced != decoded):
                return False
        return True

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        stop_tokens: Sequence[int] | None = None,
        *,
        tenant: str = DEFAULT_TENANT,
    ) -> list[list[int]]:
        """Greedy continuation of each prompt: up to `max_new_tokens` new ids per prompt,
        ending before the first stop token (default: the config's eos ids)."""
        _check_whole("max_new_tokens", max_new_tokens)
        if stop_tokens is None:
            stops = set(self.config.eos_token_ids)
        elif isinstance(stop_tokens, str) or not isinstance(stop_tokens, Sequence | set):
            raise ValueError(
                f"stop_tokens must be a list of token ids (or None for the model's eos ids), "
                f"got {stop_tokens!r}; for one stop token write [{stop_tokens!r}]"
            )
        else:
            stops = set(self._rows([list(stop_tokens)], "stop_tokens", allow_empty=True)[0])
        results: list[list[int]] = []
        for _, chunk in self._chunks(self._rows(prompts, "prompts")):
            results.extend(self._generate_chunk(chunk, max_new_tokens, stops, tenant))
        return results

    def prefill(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        reserve_tokens: int = 0,
        tenant: str = DEFAULT_TENANT,
    ) -> tuple[Batch, np.ndarray]:
        """Start sequences: cache the prompts, return the batch and last-token logits [B, V].

        `reserve_tokens` is how far each sequence may later grow by decoding (checked
        against the context now); the paged pool grants pages as tokens arrive, for `tenant`.
        """
        rows = self._rows(prompts, "prompts")
        _check_whole("reserve_tokens", reserve_tokens)
        batch = self._allocate(rows, reserve_tokens, tenant)
        try:
            logits = self._forward(
                batch, rows, "last", lengths_before=np.zeros(len(rows), np.int64)
            )
        except BaseException:
            self.release(batch)
            raise
        batch.lengths = np.array([len(r) for r in rows], np.int64)
        return batch, np.asarray(logits[0])[: len(rows)]

    def decode(self, batch: Batch, tokens: Sequence[int]) -> np.ndarray:
        """Append one token to each sequence of `batch`; float32 next-token logits [B, V]."""
        return np.asarray(self._decode(batch, tokens)[0])[: len(batch.seq_ids)]

    def release(self, batch: Batch) -> None:
        for seq_id in batch.seq_ids:
            self.cache.free(seq_id)
        batch.seq_ids = []

    def memory_report(self) -> MemoryReport:
        """Bytes per weight tensor (true storage: QArray.nbytes) and the cache's bytes."""
        return memory_report(self.params, self.cache.nbytes, self.cache.kv_report())

    def host_memory(self) -> dict[str, Any]:
        """What this process's devices hold (params and KV cache), device by device: on a
        multi-host slice, one host's share (a slice worker sums the hosts); on one host,
        everything. Read from the arrays' shards, like `sharding.device_bytes`."""
        held = sharding.device_bytes((self.params, self.cache.state))
        return {
            "process_index": jax.process_index(),
            "device_bytes": {str(d): b for d, b in sorted(held.items())},
            "bytes": sum(held.values()),
        }

    def settings(self) -> dict[str, Any]:
        """Everything about this engine that changes its results or its memory, as one flat
        dict of plain values: log it with a run, key caches of its outputs by it."""
        cache = self.cache.settings(self.dtype.name)
        # static KV scales change results: their fingerprint, only where a plan uses them
        scales = {"kv_scales": cache.pop("kv_scales")} if "kv_scales" in cache else {}
        return {
            **scales,
            "dtype": self.dtype.name,
            "tp": self.tp,
            "scale_scope": self.scale_scope if self.mesh is not None else "global",
            **cache,
            "plan_fingerprint": self.plan.fingerprint(),
        }

    def kv_clip_rate(self) -> float | None:
        """Share of the KV elements written under static (tensor/head) scales that fell
        outside the format's range and were clipped, over every such tensor since the engine
        was built; None when the plan has no static KV scales. Per tensor:
        `engine.cache.kv_clip_report()`."""
        rows = self.cache.kv_clip_report()
        elements = sum(r["elements"] for r in rows)
        if not rows:
            return None
        return sum(r["clipped"] for r in rows) / elements if elements else 0.0

    def add_tenant(self, name: str, guaranteed_pages: int = 0) -> None:
        """Give `name` a guaranteed share of the pool's pages; it may borrow free pages above
        it and loses borrowed ones (its newest sequence preempted) to another's guarantee."""
        self.cache.add_tenant(name, guaranteed_pages)

    def encode(self, text: str) -> list[int]:
        return self._require_tokenizer().encode(text)

    def decode_text(self, ids: Sequence[int]) -> str:
        return self._require_tokenizer().decode(list(ids))

    # ------------------------------------------------------------------ internals
    def _rows(self, token_ids, what: str, *, allow_empty: bool = False) -> list[list[int]]:
        return token_rows(token_ids, self.config.vocab_size, what, allow_empty=allow_empty)

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(
                "this checkpoint has no tokenizer.json; pass token ids instead of text"
            )
        return self.tokenizer

    def _chunks(self, rows: list[list[int]]):
        step = self.cache.max_seqs
        for start in range(0, len(rows), step):
            yield start, rows[start : start + step]

    def _allocate(self, rows: list[list[int]], reserve: int, tenant: str = DEFAULT_TENANT) -> Batch:
        context = self.config.max_position_embeddings
        too_long = [len(r) + reserve for r in rows if len(r) + reserve > context]
        if too_long:
            raise ValueError(
                f"a sequence of {max(too_long)} tokens (prompt + reserved/new tokens) exceeds "
                f"the model's context of {context} tokens"
            )
        if len(rows) > self.cache.max_seqs:
            raise ValueError(
                f"{len(rows)} sequences exceed the cache's max_seqs={self.cache.max_seqs}"
            )
        ids: list[int] = []
        try:
            for r in rows:
                ids.append(self.cache.allocate(len(r) + reserve, tenant))
        except BaseException:
            for seq_id in ids:
                self.cache.free(seq_id)
            raise
        lengths = np.zeros(len(rows), np.int64)
        return Batch(ids, lengths, np.array([len(r) + reserve for r in rows], np.int64))

    def _prefill_chunk(self, rows, output, *, reserve, targets=None, kv_tokens=None):
        batch = self._allocate(rows, reserve)
        try:
            zeros = np.zeros(len(rows), np.int64)
            return self._forward(
                batch, rows, output, lengths_before=zeros, targets=targets, kv_tokens=kv_tokens
            )
        finally:
            self.release(batch)

    def _teacher_forced_chunk(self, rows, firsts, chunk_tokens, kv_tokens) -> list[np.ndarray]:
        """Prefill `rows` in steps of `chunk_tokens`; the logits at positions firsts[i]..end."""
        lengths = np.array([len(r) for r in rows], np.int64)
        width = int(lengths.max())
        step = chunk_tokens or width
        picked: list[list[jax.Array]] = [[] for _ in rows]
        batch = self._allocate(rows, 0)
        try:
            for offset in range(0, width, step):
                pieces = [r[offset : offset + step] for r in rows]
                wanted = [
                    (i, max(firsts[i], offset) - offset, len(rows[i]) - offset)
                    for i in range(len(rows))
                    if firsts[i] < offset + step and len(rows[i]) > offset
                ]
                output = "all" if wanted else "last"
                out = self._forward(
                    batch, pieces, output, lengths_before=np.minimum(lengths, offset),
                    kv_tokens=kv_tokens, width_tokens=chunk_tokens,
                )  # fmt: skip
                for i, lo, hi in wanted:
                    picked[i].append(out[0][i, lo:hi])
        finally:
            self.release(batch)
        return [np.asarray(jnp.concatenate(p), np.float32) for p in picked]

    def _forward(
        self, batch: Batch, rows, output, *, lengths_before, targets=None, phase="prefill",
        kv_tokens=None, width_tokens=None,
    ):  # fmt: skip
        """Write `rows` (new tokens per sequence) after `lengths_before` tokens and run, at
        a KV window of at least `kv_tokens` and (if given) exactly `width_tokens` wide."""
        n = len(rows)
        width = max(len(r) for r in rows)
        b = min(steps.pow2_at_least(n), self.cache.max_seqs)
        s = width if width == 1 else min(steps.pow2_at_least(width, _MIN_BUCKET), self._cap(width))
        if width_tokens is not None:
            s = max(width, width_tokens)
        tokens = np.zeros((b, s), np.int32)
        valid = np.zeros((b, s), bool)
        tgt = np.zeros((b, s), np.int32)  # one shape for logits and scoring: one executable
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
            valid[i, : len(r)] = True
            if targets is not None:
                tgt[i, : len(targets[i])] = targets[i]
        start = np.zeros(b, np.int64)
        start[:n] = lengths_before
        positions = (start[:, None] + np.arange(s)[None, :]).astype(np.int32)
        end = int((start[:n] + np.array([len(r) for r in rows])).max())
        kv_tokens = self._cap(max(steps.pow2_at_least(end, _MIN_BUCKET), kv_tokens or 0))
        self.cache.make_room(batch.seq_ids, [int(e) for e in start[:n] + [len(r) for r in rows]])
        table = self.cache.table(batch.seq_ids + [None] * (b - n))
        compile_before = self.stats.compile_s
        began = time.perf_counter()
        out = steps.run_step(
            layout=self._layout, graphdef=self._graphdef, state=self._state, cache=self.cache,
            output=output, kv_tokens=kv_tokens, table=table,
            tokens=tokens, positions=positions,
            valid=valid, targets=tgt, stats=self.stats,
        )  # fmt: skip
        out = jax.block_until_ready(sharding.to_every_host(out, self.mesh))
        # Run time only: a first call's compile is counted in stats.compile_s instead.
        elapsed = time.perf_counter() - began - (self.stats.compile_s - compile_before)
        if phase == "decode":
            self.stats.decode_s += elapsed
            self.stats.decode_tokens += n
        else:
            self.stats.prefill_s += elapsed
            self.stats.prefill_tokens += sum(len(r) for r in rows)
        return out

    def _cap(self, tokens: int) -> int:
        return max(min(tokens, self.cache.max_seq_tokens), 1)

    def _decode(self, batch: Batch, tokens: Sequence[int]):
        tokens = self._rows([tokens], "tokens", allow_empty=True)[0]
        if len(tokens) != len(batch.seq_ids):
            raise ValueError(
                f"tokens: {len(tokens)} ids for {len(batch.seq_ids)} sequences; give one per "
                "sequence of the batch"
            )
        if (batch.lengths >= batch.capacity).any():
            raise ValueError(
                f"sequences have used the {batch.capacity.min()} tokens allocated to them; "
                "prefill with a larger reserve_tokens"
            )
        rows = [[int(t)] for t in tokens]
        out = self._forward(batch, rows, "last", lengths_before=batch.lengths, phase="decode")
        batch.lengths = batch.lengths + 1
        return out

    def _generate_chunk(
        self, rows, max_new_tokens: int, stops: set[int], tenant: str = DEFAULT_TENANT
    ) -> list[list[int]]:
        if max_new_tokens <= 0:
            return [[] for _ in rows]
        batch = self._allocate(rows, max_new_tokens, tenant)
        try:
            zeros = np.zeros(len(rows), np.int64)
            nxt = np.asarray(self._forward(batch, rows, "last", lengths_before=zeros)[1])[
                : len(rows)
            ]
            batch.lengths = np.array([len(r) for r in rows], np.int64)
            out: list[list[int]] = [[] for _ in rows]
            done = np.zeros(len(rows), bool)
            for step in range(max_new_tokens):
                for i, t in enumerate(nxt.tolist()):
                    if not done[i]:
                        if t in stops:
                            done[i] = True
                        else:
                            out[i].append(t)
                if done.all() or step == max_new_tokens - 1:
                    break
                nxt = np.asarray(self._decode(batch, nxt)[1])[: len(rows)]
            return out
        finally:
            self.release(batch)


def token_rows(
    token_ids, vocab_size: int, what: str = "token_ids", *, allow_empty: bool = False
) -> list[list[int]]:
    """Rows of token ids checked on the host: integers in [0, vocab_size), one row per
    sequence (a flat list or 1-d array is one row). A bad id is a ValueError naming the
    row, the position, the id and the vocabulary size: an id the model clamps or wraps
    would silently corrupt every figure measured with it."""
    if isinstance(token_ids, np.ndarray | jax.Array):
        array = np.asarray(token_ids)
        if array.ndim == 1:
            array = array[None]
        if array.ndim != 2:
            raise ValueError(f"{what} must be [batch, seq] token ids, got shape {array.shape}")
        rows = list(array)
    elif isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence):
        raise ValueError(
            f"{what} must be a list of token-id lists (or one flat list of ids), got "
            f"{type(token_ids).__name__}"
        )
    elif token_ids and not any(isinstance(t, Sequence | np.ndarray) for t in token_ids):
        rows = [token_ids]  # one flat list of ids: one sequence
    else:
        rows = list(token_ids)
    if not rows:
        raise ValueError(f"{what}: need at least one sequence")
    out = []
    for r, row in enumerate(rows):
        if isinstance(row, str | bytes) or not isinstance(row, Sequence | np.ndarray):
            raise ValueError(f"{what}: row {r} is {row!r}, not a list of token ids")
        if not len(row) and not allow_empty:
            raise ValueError(f"{what}: row {r} is empty; every sequence needs a token")
        allowed = f"ids are integers in 0..{vocab_size - 1} (vocab_size={vocab_size})"
        if isinstance(row, np.ndarray):
            if row.dtype.kind not in "iu":
                raise ValueError(f"{what}: row {r} holds {row.dtype} values; {allowed}")
            bad = np.flatnonzero((row < 0) | (row >= vocab_size))
            first = int(bad[0]) if bad.size else None
        else:
            for i, t in enumerate(row):
                if isinstance(t, bool) or not isinstance(t, int | np.integer):
                    raise ValueError(
                        f"{what}: row {r}, position {i}: {t!r} is not a token id; {allowed}"
                    )
            first = next((i for i, t in enumerate(row) if not 0 <= t < vocab_size), None)
        if first is not None:
            raise ValueError(
                f"{what}: row {r}, position {first}: id {int(row[first])} is outside the "
                f"vocabulary; {allowed}"
            )
        out.append([int(t) for t in row])
    return out


def _check_whole(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
