"""The tenantq lm-eval model against lm-eval's own HF backend on the same local tasks.

The reference model is exported in the HF layout (transformers loads it; a tokenizer_config
names its special tokens), and one local task per request type runs through
`lm_eval.simple_evaluate` (what `lm_eval --model ...` runs) with `--model hf` and
`--model tenantq`, both float32 and unquantized. Bounds: per request, log-likelihoods agree
within 1e-4 nats, or one float32 spacing of the total where that is
coarser (the HF backend sums in float32: a 5,286-nat document is resolved to 4.9e-4; measured
1.4e-4 there), greedy flags and generated text are equal.
Rolling documents are longer than the 1,024-token context, so their later windows are
scored with one token of context exactly as the HF backend scores them.
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


def _tasks(root, tokenizer):
    docs = data.load_documents(data.REFERENCE_TEST)
    by_len = sorted(docs, key=len)
    sized = {len(tokenizer.encode(d)): d for d in by_len[:: max(1, len(by_len) // 60)]}
    long_docs = [sized[n] for n in sorted(sized) if n > CONTEXT_TOKENS][:1]
    short = [sized[n] for n in sorted(sized) if 50 < n < 400][:1]
    assert long_docs, sorted(sized)
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
    from tenantq.model.tokenizer import load_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    hf = _hf_layout(tmp_path)
    tasks = _tasks(tmp_path, load_tokenizer(hf))
    ref = _run("hf", f"pretrained={hf},dtype=float32,device=cpu", tasks, tmp_path)
    got = _run("tenantq", f"pretrained={hf},dtype=float32,max_seqs=4", tasks, tmp_path)
    worst = 0.0
    for task in tasks:
        assert len(got[task]) == len(ref[task])
        for a, b in zip(got[task], ref[task], strict=True):
            for ra, rb in zip(a["resps"], b["resps"], strict=True):
                if task == "tq_generate":
                    assert ra == rb, (task, a["doc_id"])
                    continue
                mine, theirs = (ra[0], rb[0]) if task == "tq_rolling" else (ra[0][0], rb[0][0])
                # HF sums in float32: a total of thousands of nats is only resolved to its
                # float32 spacing (4.9e-4 at 5,286), so the bound is 1e-4 or 1 spacing
                bound = max(TOLERANCE, abs(float(np.spacing(np.float32(theirs)))))
                assert abs(mine - theirs) <= bound, (task, a["doc_id"], mine, theirs)
                worst = max(worst, abs(mine - theirs) / bound)
                if task == "tq_choice":
                    assert ra[0][1] == rb[0][1]  # greedy flags
    print(f"largest difference: {worst:.2f} of its bound")
