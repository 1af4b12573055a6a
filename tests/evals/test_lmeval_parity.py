"""The tenantq lm-eval model against lm-eval's own HF backend on the same local tasks.

The reference model is exported in the HF layout (transformers loads it; a tokenizer_config
names its special tokens), and one local task per request type runs through
`lm_eval.simple_evaluate` (what `lm_eval --model ...` runs) with `--model hf` and
`--model tenantq`, both float32 and unquantized. Bounds: per scored window (every rolling
window of a document, every choice), log-likelihoods agree within 1e-4 nats plus 4 float32
spacings of HF's window total (the HF backend sums a window's log-probs in float32, so a
window of ~1,000 nats is resolved only to ~6e-5); greedy flags and generated text are equal.
Document totals are Python sums of these windows in both backends. Two rolling documents
have exactly 2L and 2L + 1 tokens (L = the 1,024-token context): their later windows are
scored with one token of context exactly as the HF backend scores them, the last of the
second predicting a single token.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval", reason="needs the lmeval extra")
pytest.importorskip("transformers", reason="needs the parity extra")
pytest.importorskip("torch", reason="needs the parity extra")

import tenantq.evals.lmeval  # noqa: E402,F401  (registers "tenantq")
from tenantq.evals import data  # noqa: E402
from tenantq.reference import reference_model_path  # noqa: E402

pytestmark = [pytest.mark.parity]
TOLERANCE = 1e-4
WINDOW_SPACINGS = 4  # float32 spacings of HF's window total added to TOLERANCE (module doc)
CONTEXT_TOKENS = 1024  # the reference model's max_position_embeddings


def _hf_layout(root):
    """The shipped checkpoint plus the tokenizer_config transformers' AutoTokenizer reads."""
    out = root / "hf"
    shutil.copytree(reference_model_path(), out)
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|bos|>",
                "eos_token": "<|eos|>",
                "pad_token": "<|pad|>",
                "model_max_length": CONTEXT_TOKENS,
            }
        )  # fmt: skip
    )
    return out


def _task(root, name, kind, rows, body):
    path = root / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\n"
        f"test_split: test\noutput_type: {kind}\n{body}"
    )


def _text_of_tokens(tokenizer, stream, n):
    """A text that encodes to exactly n tokens: a decoded prefix of `stream` near n tokens."""
    for cut in sorted(range(n - 8, n + 9), key=lambda c: abs(c - n)):
        text = tokenizer.decode(stream[:cut], skip_special_tokens=False)
        if len(tokenizer.encode(text, add_special_tokens=False)) == n:
            return text
    raise AssertionError(f"no prefix of the corpus encodes to {n} tokens")


def _recorded(monkeypatch, cls):
    """Every (context ids, continuation ids) -> (log p, greedy) that `cls` scores: a rolling
    document's windows one by one, as the backends compute them before summing."""
    seen, real = {}, cls._loglikelihood_tokens

    def recording(self, requests, *args, **kwargs):
        out = real(self, requests, *args, **kwargs)
        for (_, ctx, cont), res in zip(requests, out, strict=True):
            seen[tuple(ctx), tuple(cont)] = (float(res[0]), bool(res[1]))
        return out

    monkeypatch.setattr(cls, "_loglikelihood_tokens", recording)
    return seen


def _tasks(root, tokenizer):
    docs = data.load_documents(data.REFERENCE_TEST)
    by_len = sorted(docs, key=len)
    sized = {len(tokenizer.encode(d)): d for d in by_len[:: max(1, len(by_len) // 60)]}
    short = [sized[n] for n in sorted(sized) if 50 < n < 400][:1]
    # documents of exactly 2L and 2L + 1 tokens (L = the context): two full windows, and two
    # full windows plus one of a single token (its context one token)
    stream = tokenizer.encode("\n\n".join(by_len[-8:]), add_special_tokens=False)
    long_docs = [
        _text_of_tokens(tokenizer, stream, n) for n in (2 * CONTEXT_TOKENS, 2 * CONTEXT_TOKENS + 1)
    ]
    _task(
        root,
        "tq_rolling",
        "loglikelihood_rolling",
        [{"text": t} for t in short + long_docs],
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n',
    )
    snippets = [d[:400] for d in by_len[-6:]]
    # contexts ending in whitespace: the harness moves it into the continuation
    mc = [
        {"prompt": s[:200] + " ", "choices": [s[200:230], s[200:215] + "xyz"], "answer": 0}
        for s in snippets[:2]
    ]
    mc.append(
        {"prompt": snippets[3][:150] + "\n", "choices": [snippets[3][150:170], "pass"], "answer": 0}
    )
    _task(
        root,
        "tq_choice",
        "multiple_choice",
        mc,
        'doc_to_text: "{{prompt}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
        "metric_list:\n  - metric: acc\n",
    )
    gen = [{"prompt": s[:300], "answer": s[300:340]} for s in snippets[:2]]
    # no empty stop string here: the HF backend's stopping criterion finds "" in any text
    # and stops after one token, which the tenantq model does not copy (it ignores "")
    _task(
        root,
        "tq_generate",
        "generate_until",
        gen,
        'doc_to_text: "{{prompt}}"\ndoc_to_target: answer\ngeneration_kwargs:\n'
        '  until: ["\\n\\n"]\n  max_gen_toks: 24\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n",
    )
    return ["tq_rolling", "tq_choice", "tq_generate"]


def _run(model, model_args, tasks, root):
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=tasks, batch_size=1, log_samples=True,
        task_manager=TaskManager(include_path=str(root)),
    )  # fmt: skip
    return {t: sorted(out["samples"][t], key=lambda s: s["doc_id"]) for t in tasks}


@pytest.mark.slow
def test_tenantq_model_scores_as_lm_eval_hf_backend(tmp_path, monkeypatch):
    from lm_eval.models.huggingface import HFLM

    from tenantq.evals.lmeval import TenantqLM
    from tenantq.model.tokenizer import load_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    hf = _hf_layout(tmp_path)
    tasks = _tasks(tmp_path, load_tokenizer(hf))
    theirs_by_window = _recorded(monkeypatch, HFLM)
    mine_by_window = _recorded(monkeypatch, TenantqLM)
    ref = _run("hf", f"pretrained={hf},dtype=float32,device=cpu", tasks, tmp_path)
    got = _run("tenantq", f"pretrained={hf},dtype=float32,max_seqs=4", tasks, tmp_path)
    for task in tasks:
        assert len(got[task]) == len(ref[task])
        for a, b in zip(got[task], ref[task], strict=True):
            if task == "tq_generate":
                assert a["resps"] == b["resps"], (task, a["doc_id"])
    # Per scored window (each rolling window, each choice): HF sums a window's <= L float32
    # log-probs in float32, resolving the sum only to its float32 spacing; the bound is
    # TOLERANCE (model arithmetic) + WINDOW_SPACINGS spacings of HF's window total.
    assert mine_by_window.keys() == theirs_by_window.keys()
    # 2L + 1's last window: one token predicted from the L before it
    assert any(len(c) == 1 and len(x) == CONTEXT_TOKENS for x, c in theirs_by_window)
    worst = 0.0
    for key, (theirs, their_greedy) in theirs_by_window.items():
        mine, my_greedy = mine_by_window[key]
        bound = TOLERANCE + WINDOW_SPACINGS * abs(float(np.spacing(np.float32(theirs))))
        assert abs(mine - theirs) <= bound, (len(key[0]), len(key[1]), mine, theirs)
        assert my_greedy == their_greedy, (len(key[0]), len(key[1]))
        worst = max(worst, abs(mine - theirs) / bound)
    print(f"largest difference: {worst:.2f} of its bound")
