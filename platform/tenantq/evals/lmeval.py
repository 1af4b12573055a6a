"""lm-evaluation-harness adapter: any harness task on the quantized engine (extra `lmeval`).

`TenantqLM` is registered as model "tenantq" and follows lm-eval's HF backend request by
request, so `--model hf` and `--model tenantq` score the same tokens: it is a `TemplateLM`
(the harness's own context/continuation split, trailing context whitespace moved to the
continuation), each scored row is `(context + continuation)[-(max_length + 1):][:-1]`,
rolling log-likelihoods use the harness's windows with one token of context, and
`generate_until` normalises its kwargs and stop strings with the harness's helpers. Decoding
is greedy only: a request asking for sampling is refused, never silently run greedy.
Log-likelihoods and greedy flags are computed on device from the engine's prefill
(`Engine.device_logits`). The `lm_eval` console script only knows its built-in models, so
run `python -m tenantq.evals.lmeval --model tenantq --model_args pretrained=DIR,plan=PLAN.json
--tasks TASK [--include_path DIR]` (docs/guide/lm-eval.md).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's HF backend default


@jax.jit
def _target_logp_and_hits(logits, targets):
    """log p(targets) and whether each target is the argmax, per position."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(logits, axis=-1) == targets


@register_model("tenantq")
class TenantqLM(TemplateLM):
    """A tenantq `Engine` as an lm-evaluation-harness model (greedy decoding only)."""

    def __init__(
        self,
        pretrained: str | None = None,
        plan: str | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        batch_size: int | str | None = None,
        device: str | None = None,
        **engine_options,
    ):
        super().__init__()
        from tenantq.engine import Engine
        from tenantq.quant.plan import QuantPlan
        from tenantq.reference import reference_model_path

        path = pretrained or str(reference_model_path())
        quant_plan = QuantPlan.load(plan) if plan else QuantPlan()
        self.engine = Engine.from_checkpoint(path, quant_plan, **engine_options)
        if self.engine.tokenizer is None:
            raise ValueError(f"{path} has no tokenizer.json; lm-evaluation-harness tasks are text")
        self.tokenizer = self.engine.tokenizer
        self._max_length = self.engine.config.max_position_embeddings
        self.max_gen_toks = int(max_gen_toks)

    # ------------------------------------------------------------------ tokens
    @property
    def eot_token_id(self) -> int:
        return int(self.engine.config.eos_token_ids[0])

    @property
    def prefix_token_id(self) -> int:
        bos = self.engine.config.bos_token_id
        return int(bos if bos is not None else self.eot_token_id)

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None, **kw
    ) -> list[int]:
        """As the HF backend: the tokenizer's own special tokens unless told otherwise, none
        when the text already starts with the BOS string."""
        if add_special_tokens is None:
            bos = self.tokenizer.decode([self.prefix_token_id], skip_special_tokens=False)
            add_special_tokens = not has_bos_prefix(string, bos)
        ids = self.tokenizer.encode(string, add_special_tokens=add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ scoring
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """(sum of log p(continuation | context), greedy reproduces it) per request
        `(strings, context_ids, continuation_ids)`; rows cut as the HF backend cuts them."""
        rows, targets = [], []
        for _, ctx, cont in requests:
            if not ctx or not cont or len(cont) > self.max_length:
                raise ValueError(
                    f"a request has {len(ctx)} context and {len(cont)} continuation tokens; "
                    f"both must be non-empty and the continuation at most {self.max_length}"
                )
            whole = (ctx + cont)[-(self.max_length + 1) :]
            rows.append(whole[:-1])
            targets.append(whole[1:])
        out: list[tuple[float, bool]] = []
        for start, logits, _ in self.engine.device_logits(rows):
            chunk = targets[start : start + logits.shape[0]]
            padded = np.zeros(logits.shape[:2], np.int32)
            for i, t in enumerate(chunk):
                padded[i, : len(t)] = t
            logp, hits = _target_logp_and_hits(logits, jnp.asarray(padded))
            logp, hits = np.asarray(logp, np.float64), np.asarray(hits)
            for i, t in enumerate(chunk):
                n = len(requests[start + i][2])
                span = slice(len(t) - n, len(t))
                out.append((float(logp[i, span].sum()), bool(hits[i, span].all())))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document scored whole: lm-eval's rolling windows (one token of context after
        the first window), every token predicted once."""
        windows, owner = [], []
        for n, req in enumerate(requests):
            (text,) = req.args
            for ctx, cont in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, ctx, cont))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logp, _) in zip(owner, self._loglikelihood_tokens(windows), strict=True):
            totals[n] += logp
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        for req in requests:
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ValueError(
                    f"generation_kwargs ask for sampling (do_sample=True, temperature="
                    f"{kwargs.get('temperature')}); the tenantq model decodes greedily: set "
                    "do_sample: false (or temperature: 0) in the task's generation_kwargs"
                )
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = int(kwargs.pop("max_gen_toks"))
            if max_new >= self.max_length:
                raise ValueError(
                    f"max_gen_toks={max_new} leaves no room for a prompt in the model's "
                    f"context of {self.max_length} tokens"
                )
            prompt = self.tok_encode(context, left_truncate_len=self.max_length - max_new)
            (ids,) = self.engine.generate([prompt], max_new)
            out.append(postprocess_generated_text(self.tok_decode(ids), until, None))
        return out


def main(argv: list[str] | None = None) -> None:
    """lm_eval's command line with the "tenantq" model registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":
    main()
