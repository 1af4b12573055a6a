"""The lm-evaluation-harness adapter on the reference model, with a task written here.

Bounds: the adapter's log-likelihoods must equal the engine's own `score` (same prefill, same
targets) to float32 rounding (1e-4 nats on sums of ~10 tokens); the harness must run a local
YAML + JSONL task of each request type end to end (no hub).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval", reason="needs the lmeval extra")

from lm_eval.api.instance import Instance  # noqa: E402

from tenantq.evals.lmeval import TenantqLM  # noqa: E402

TASK_YAML = """
task: tenantq_local_{kind}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {kind}
doc_to_text: "{{{{prompt}}}}"
doc_to_target: {target}
{extra}
metric_list:
{metrics}
"""


def _write_task(root, kind, rows, target, extra, metrics):
    data = root / f"{kind}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    body = TASK_YAML.format(kind=kind, data=data, target=target, extra=extra, metrics=metrics)
    (root / f"{kind}.yaml").write_text(body)


@pytest.fixture(scope="module")
def lm() -> TenantqLM:
    return TenantqLM(max_seqs=4, dtype="float32")  # float32: sums comparable to 1e-4


def _req(kind, args, i=0):
    return Instance(request_type=kind, doc={}, arguments=args, idx=i, metadata=("t", i, 1))


@pytest.mark.slow
def test_loglikelihood_equals_engine_score(lm) -> None:
    ctx, cont = "def main(args):\n    return", " args\n"
    ((got, greedy),) = lm.loglikelihood([_req("loglikelihood", (ctx, cont))])
    c = lm.tokenizer.encode(ctx)  # no BOS: the reference tokenizer adds none, as in HF
    whole = lm.tokenizer.encode(ctx + cont)
    want = float(lm.engine.score([c], [whole[len(c) :]])[0].sum())
    assert got == pytest.approx(want, abs=1e-4)
    assert isinstance(greedy, bool)
    text = "import os\nimport sys\n\n\ndef main():\n    print(os.getcwd())\n"
    (rolling,) = lm.loglikelihood_rolling([_req("loglikelihood_rolling", (text,))])
    ids = lm.tokenizer.encode(text)
    want = float(lm.engine.score([[lm.prefix_token_id]], [ids])[0].sum())
    assert rolling == pytest.approx(want, abs=1e-4)


def _recording(lm, monkeypatch):
    seen = []

    def record(requests, **kwargs):
        seen.extend(requests)
        return [(0.0, True)] * len(requests)

    monkeypatch.setattr(lm, "_loglikelihood_tokens", record)
    return seen


def test_rolling_scores_every_token_of_a_document_longer_than_the_context(lm, monkeypatch):
    # 2,500 tokens on a 1,024-token context: three windows, each token predicted once, each
    # window one row of at most 1,024 tokens after the HF backend's cut [-(L + 1):][:-1]
    seen = _recording(lm, monkeypatch)
    ids = (lm.tokenizer.encode("x = 1\n") * 1000)[:2500]
    text = lm.tokenizer.decode(ids)
    ids = lm.tok_encode(text)
    lm.loglikelihood_rolling([_req("loglikelihood_rolling", (text,))])
    predicted = [t for _, _, cont in seen for t in cont]
    assert predicted == ids
    assert [len(cont) for _, _, cont in seen] == [1024, 1024, len(ids) - 2048]
    for _, ctx, cont in seen:
        assert len((ctx + cont)[-(lm.max_length + 1) :][:-1]) <= lm.max_length


def test_trailing_context_whitespace_moves_to_the_continuation(lm, monkeypatch):
    seen = _recording(lm, monkeypatch)
    lm.loglikelihood(
        [_req("loglikelihood", ("value =  ", "42")), _req("loglikelihood", ("value =", "  42"))]
    )
    (_, ctx_a, cont_a), (_, ctx_b, cont_b) = seen
    assert (
        (ctx_a, cont_a)
        == (ctx_b, cont_b)
        == (lm.tokenizer.encode("value ="), lm.tokenizer.encode("value =  42")[len(ctx_a) :])
    )


def test_generation_ignores_an_empty_stop_string_and_refuses_sampling(lm) -> None:
    prompt = "def add(a, b):\n    return"
    plain = lm.generate_until(
        [_req("generate_until", (prompt, {"until": ["\n"], "max_gen_toks": 6}))]
    )
    empty = lm.generate_until(
        [_req("generate_until", (prompt, {"until": ["", "\n"], "max_gen_toks": 6}))]
    )
    assert empty == plain and "\n" not in plain[0]
    with pytest.raises(ValueError, match="decodes greedily.*do_sample"):
        lm.generate_until(
            [_req("generate_until", (prompt, {"do_sample": True, "temperature": 0.7}))]
        )
    with pytest.raises(ValueError, match="decodes greedily"):
        lm.generate_until([_req("generate_until", (prompt, {"temperature": 0.5}))])


@pytest.mark.slow
def test_harness_runs_local_tasks(tmp_path) -> None:
    from lm_eval.tasks import TaskManager

    _write_task(
        tmp_path, "multiple_choice",
        [{"prompt": "x = [1, 2", "choices": ["]", ")"], "answer": 0},
         {"prompt": "print('a'", "choices": [")", "]"], "answer": 0}],
        "answer", 'doc_to_choice: "{{choices}}"', "  - metric: acc",
    )  # fmt: skip
    _write_task(
        tmp_path, "generate_until",
        [{"prompt": "PASSKEY_ABCD = 12345\n# recall\nPASSKEY_ABCD =", "answer": " 12345"}],
        "answer", "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8",
        "  - metric: exact_match",
    )  # fmt: skip
    _write_task(
        tmp_path, "loglikelihood_rolling", [{"prompt": "", "text": "import os\nimport sys\n"}],
        "text", "", "  - metric: word_perplexity",
    )  # fmt: skip
    results = lm_eval.simple_evaluate(
        model="tenantq",
        model_args="max_seqs=4",
        tasks=[
            f"tenantq_local_{k}"
            for k in ("multiple_choice", "generate_until", "loglikelihood_rolling")
        ],  # fmt: skip
        task_manager=TaskManager(include_path=str(tmp_path)),
    )["results"]
    acc = results["tenantq_local_multiple_choice"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    assert results["tenantq_local_generate_until"]["exact_match,none"] in (0.0, 1.0)
    ppl = results["tenantq_local_loglikelihood_rolling"]["word_perplexity,none"]
    assert math.isfinite(ppl) and ppl > 1.0
    assert np.isfinite(acc)


@pytest.mark.slow
def test_supported_command_line_runs_a_local_task(tmp_path, capsys) -> None:
    """`python -m tenantq.evals.lmeval` is the documented command: lm-eval 0.4.13 finds
    third-party models only when their module is imported in its process (README)."""
    from tenantq.evals import lmeval

    _write_task(
        tmp_path, "multiple_choice",
        [{"prompt": "x = [1, 2", "choices": ["]", ")"], "answer": 0}],
        "answer", 'doc_to_choice: "{{choices}}"', "  - metric: acc",
    )  # fmt: skip
    lmeval.main([
        "--model", "tenantq", "--model_args", "max_seqs=4", "--tasks",
        "tenantq_local_multiple_choice", "--include_path", str(tmp_path),
    ])  # fmt: skip
    printed = capsys.readouterr().out
    # the harness's results table: | task | version | filter | n-shot | metric | dir | value |
    # ... with one document, acc is 0 or 1
    row = next(line for line in printed.splitlines() if "tenantq_local_multiple_choice" in line)
    cells = [c.strip() for c in row.split("|")]
    metric = cells.index("acc")
    assert float(cells[metric + 2]) in (0.0, 1.0)
