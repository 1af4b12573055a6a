"""Fast checks of the suite's parts: suites as data, datasets, fidelity math, scoring."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tenantq.evals import data, fidelity, structured, windows
from tenantq.evals.generation import Generated, _top2_margin
from tenantq.evals.suite import load_suite


def test_builtin_suites_load_and_confirm_split_differs() -> None:
    for name in ("quick", "standard", "long"):
        suite = load_suite(name)
        assert suite.name == name and suite.gates
    quick = load_suite("quick")
    assert quick.with_split("confirm").split == "confirm" and quick.split == "search"


def test_suite_errors_are_one_line(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[fidelity]\nrowz = 3\n")
    with pytest.raises(
        ValueError, match=r"fidelity: unknown key 'rowz'; valid keys here: source, text_field, rows"
    ) as err:
        load_suite(bad)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="quick, standard"):
        load_suite("no-such-suite")


def test_document_halves_are_disjoint_and_cover_everything() -> None:
    docs = [f"doc {i}\n" for i in range(7)]
    search, confirm = data.split_documents(docs, "search"), data.split_documents(docs, "confirm")
    assert not set(search) & set(confirm) and sorted(search + confirm) == sorted(docs)
    one = ["a\nb\nc\nd\n"]
    assert (
        data.split_documents(one, "search")[0] + data.split_documents(one, "confirm")[0] == one[0]
    )


def test_unreadable_datasets_are_one_line_errors(tmp_path) -> None:
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(ValueError, match="unreadable .*JSONDecodeError"):
        data.load_documents(str(bad))
    wrong_field = tmp_path / "y.jsonl"
    wrong_field.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match="'text' text field"):
        data.load_documents(str(wrong_field))
    with pytest.raises(ValueError, match="does not exist"):
        data.load_documents(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="unknown suffix"):
        (tmp_path / "z.csv").write_text("a,b\n")
        data.load_documents(str(tmp_path / "z.csv"))
    ok = tmp_path / "ok.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["one doc", "two doc"]}), ok)
    assert data.load_documents(str(ok)) == ["one doc", "two doc"]


def test_token_windows_are_disjoint_and_refuse_too_many() -> None:
    stream = np.arange(100, dtype=np.int32)
    w = windows.token_windows(stream, 3, 20, np.random.default_rng(0))
    assert w.shape == (3, 20) and len(set(w.ravel().tolist())) == 60
    with pytest.raises(ValueError, match="5 windows of 20"):
        windows.token_windows(stream, 6, 20, np.random.default_rng(0))


def _numpy_kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    def logsm(x):
        x = x.astype(np.float64)
        return (
            x
            - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - x.max(-1, keepdims=True)
        )

    lp, lq = logsm(p_logits), logsm(q_logits)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def test_exact_kl_matches_numpy_and_topk_tail_forms() -> None:
    rng = np.random.default_rng(0)
    base_logits = rng.normal(scale=3.0, size=(2, 5, 300)).astype(np.float32)
    cand_logits = base_logits + rng.normal(scale=0.3, size=base_logits.shape).astype(np.float32)
    logp, top1, _ = fidelity._summarize(jnp.asarray(base_logits))
    kl, agree = fidelity._compare_exact(logp, top1, jnp.asarray(cand_logits))
    want = _numpy_kl(base_logits, cand_logits)
    # float32 log-softmax over 300 logits: relative error well under 1e-4
    np.testing.assert_allclose(np.asarray(kl), want, rtol=1e-4, atol=1e-6)
    assert np.array_equal(np.asarray(agree), base_logits.argmax(-1) == cand_logits.argmax(-1))
    for k in (8, 64):
        draws = []
        for seed in range(20):
            parts = fidelity._top_k_tail(logp, k, 64, jax.random.PRNGKey(seed))
            args = (*parts, top1, jnp.asarray(cand_logits))
            draws.append(float(np.asarray(fidelity._compare_topk(*args)[0]).mean()))
        lumped = np.asarray(fidelity._compare_topk(*args, lumped=True)[0])
        # merging outcomes never raises KL (log-sum inequality): a lower bound, up to rounding
        assert (lumped <= want + 1e-5).all()
        # the sampled tail is unbiased: over 20 independent draws of the samples, the mean
        # estimate is within 4 standard errors of the exact KL (fails at p < 1e-4 if unbiased)
        se = np.std(draws, ddof=1) / np.sqrt(len(draws))
        assert abs(np.mean(draws) - want.mean()) < 4 * se + 1e-6
        assert abs(np.mean(draws) - want.mean()) < abs(lumped.mean() - want.mean())
    # identical candidate: KL exactly 0 in both forms
    kl0, _ = fidelity._compare_exact(logp, top1, jnp.asarray(base_logits))
    assert float(np.abs(np.asarray(kl0)).max()) < 1e-6


def test_margin_is_top1_minus_top2_logprob() -> None:
    logits = np.array([[0.0, 2.0, 1.5, -1.0]], np.float32)
    nxt, gap = _top2_margin(logits)
    assert nxt[0] == 1 and gap[0] == pytest.approx(0.5)  # log-softmax shifts both equally


class _Tok:
    """The two calls `structured.score` makes, on plain characters."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def _gen(text: str, stop: str | None = "\n") -> Generated:
    return Generated([ord(c) for c in text], [1.0] * len(text), ord(stop) if stop else None)


def test_structured_scoring_checks_structure_not_spelling() -> None:
    item = structured.StructuredItem("close_line", "x", [1], "    f(a, g(b", "")
    tok = _Tok()
    assert structured.score(item, _gen("))"), tok)
    assert structured.score(item, _gen("), c)"), tok)  # another valid completion
    assert not structured.score(item, _gen(")"), tok)
    ident = structured.StructuredItem(
        "repeat_identifier", "y", [1], "    x = _iter", "8:_iterencode"
    )
    assert structured.score(ident, _gen("encode(o)"), tok)
    assert not structured.score(ident, _gen("encoder(o)"), tok)
    assert not structured.score(ident, _gen("ate"), tok)


def test_close_line_cut_leaves_only_the_closers() -> None:
    assert structured._close_line_cut("    result = compute(value, other[1])") == (
        "    result = compute(value, other[1"
    )
    assert structured._close_line_cut("    x = 1") is None  # nothing to close
    assert structured._close_line_cut("    f(a, ") is None  # does not parse whole


def test_indent_block_passes_only_a_deeper_first_line() -> None:
    # Python requires the line after a block opener to be indented deeper (else
    # IndentationError); blank lines in between are allowed, anything on the opener's own
    # line after the colon is ignored.
    item = structured.StructuredItem("indent_block", "z", [1], "    if x:", "4")
    tok = _Tok()
    assert structured.score(item, _gen("\n        return 1", None), tok)
    assert structured.score(item, _gen("  # why\n\n     y = 2", None), tok)  # 5 > 4
    assert not structured.score(item, _gen("\n    if y:", None), tok)  # same depth
    assert not structured.score(item, _gen("\nreturn", None), tok)  # shallower
    assert not structured.score(item, _gen("\n        ", None), tok)  # no statement yet
    assert not structured.score(item, _gen(" pass", None), tok)  # no next line at all


def test_indent_block_candidates_are_openers_the_file_indents() -> None:
    lines = [
        "def f(x):",  # next non-blank line deeper: usable, indent 0
        "",
        "    if x:  # check",  # a comment after the colon: not an opener line
        "        return x",
        "    for i in y:",  # deeper next line: usable, indent 4
        "        pass",
        "    x = {1:",  # not an opener keyword
        "    2}",
        "class A: pass",  # body on the same line: not a block opener
        "while True:",  # last line of the file: nothing after it
    ]
    found = list(structured._candidates("indent_block", lines))
    assert found == [(0, "def f(x):", "0"), (4, "    for i in y:", "4")]
