"""lm-evaluation-harness adapter: any harness task on the quantized engine (extra `lmeval`).

`TenantqLM` is registered as model "tenantq": `loglikelihood`, `loglikelihood_rolling` and
`generate_until` run through `Engine` (the plan's weight and KV formats, the paged pool).
Log-likelihoods and greedy flags are computed on device from the engine's prefill
(`Engine.device_logits`), so no [B, S, V] array reaches the host. The `lm_eval` console
script only knows its built-in models, so run the harness through this module, which
registers "tenantq" and then hands its arguments to lm_eval's own command line:
`python -m tenantq.evals.lmeval --model tenantq --model_args pretrained=DIR,plan=PLAN.json
--tasks TASK [--include_path DIR]`.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window


@jax.jit
def _greedy_hits(logits, targets):
    return jnp.argmax(logits, axis=-1) == targets


@register_model("tenantq")
class TenantqLM(LM):
    """A tenantq `Engine` as an lm-evaluation-harness model (greedy decoding only)."""

    def __init__(
        self,
        pretrained: str | None = None,
        plan: str | None = None,
        max_gen_toks: int = 64,
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
        self.max_length = self.engine.config.max_position_embeddings
        self.max_gen_toks = int(max_gen_toks)
        bos = self.engine.config.bos_token_id
        self.prefix_token = int(bos if bos is not None else self.engine.config.eos_token_ids[0])

    # ------------------------------------------------------------------ helpers
    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def _score_pairs(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Sum of log p(continuation | context) and whether greedy decoding reproduces it."""
        rows, spans = [], []
        for ctx, cont in pairs:
            full = (ctx + cont)[-self.max_length :]
            rows.append(full)
            spans.append((len(full) - len(cont) - 1, len(full) - 1))  # positions predicting cont
        out: list[tuple[float, bool]] = []
        for start, logits, target_logp in self.engine.device_logits(rows):
            chunk = rows[start : start + logits.shape[0]]
            targets = np.zeros(logits.shape[:2], np.int32)
            for i, r in enumerate(chunk):
                targets[i, : len(r) - 1] = r[1:]
            hits = np.asarray(_greedy_hits(logits, jnp.asarray(targets)))
            logp = np.asarray(target_logp)
            for i in range(len(chunk)):
                a, b = spans[start + i]
                out.append((float(logp[i, a:b].sum()), bool(hits[i, a:b].all())))
        return out

    # ------------------------------------------------------------------ the LM interface
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        pairs = []
        for req in requests:
            context, continuation = req.args
            whole = self._encode(context + continuation)
            ctx = self._encode(context)
            cont = whole[len(ctx) :] if whole[: len(ctx)] == ctx else self._encode(continuation)
            pairs.append(([self.prefix_token, *ctx], cont))
        return self._score_pairs(pairs)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        out = []
        for req in requests:
            (text,) = req.args
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    self._encode(text), self.prefix_token, self.max_length, 1
                )
            ]
            out.append(sum(logp for logp, _ in self._score_pairs(windows)))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        out = []
        for req in requests:
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            prompt = [self.prefix_token, *self._encode(context)]
            prompt = prompt[-(self.max_length - max_new) :]
            (ids,) = self.engine.generate([prompt], max_new)
            text = self.tokenizer.decode(ids)
            for stop in until:
                text = text.split(stop, 1)[0]
            out.append(text)
        return out


def main(argv: list[str] | None = None) -> None:
    """lm_eval's command line with the "tenantq" model registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":
    main()
