"""The fidelity baseline and comparison over an engine's batches, without a model.

A stand-in engine yields fixed logits through `device_logits` the way `Engine` does: batches
of `max_seqs` rows (the last one padded with rows past the end), one position more than a
row predicts. References are direct numpy: log-softmax, KL(p || q) summed over the
vocabulary, top-k by sorting.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tenantq.evals import fidelity

N, LENGTH, VOCAB = 3, 6, 40  # 3 rows of 6 tokens: 5 predicted positions each


def _logsm(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


class _Engine:
    """`device_logits` over fixed [N, LENGTH, VOCAB] logits in batches of two rows."""

    def __init__(self, logits: np.ndarray, batch: int = 2):
        self.logits, self.batch, self.calls = logits.astype(np.float32), batch, []

    def device_logits(self, rows, kv_tokens=None):
        self.calls.append((len(rows), kv_tokens))
        for start in range(0, len(rows), self.batch):
            part = self.logits[start : start + self.batch]
            pad = self.batch - len(part)  # padded rows hold garbage, as a real batch's may
            part = np.concatenate([part, np.full((pad, *part.shape[1:]), 9.0, np.float32)])
            tlogp = -np.arange(part.shape[0] * part.shape[1], dtype=np.float32).reshape(
                part.shape[:2]
            ) - start  # fmt: skip
            yield start, jax.numpy.asarray(part), jax.numpy.asarray(tlogp)


def _rows() -> np.ndarray:
    return np.arange(N * LENGTH, dtype=np.int32).reshape(N, LENGTH) % VOCAB


def _logits(seed: int = 0, scale: float = 3.0) -> np.ndarray:
    return np.random.default_rng(seed).normal(scale=scale, size=(N, LENGTH, VOCAB))


def _tlogp_expected() -> np.ndarray:
    """What the stand-in's `tlogp` holds for each row's first LENGTH - 1 positions."""
    out = np.zeros((N, LENGTH - 1), np.float32)
    for r in range(N):
        start, i = r - r % 2, r % 2
        out[r] = -(np.arange(LENGTH - 1) + i * LENGTH) - start
    return out


def test_an_exact_baseline_keeps_each_rows_log_distribution_and_summary() -> None:
    logits = _logits()
    engine = _Engine(logits)
    base = fidelity.compute_baseline(engine, _rows(), exact=True, top_k=4, kv_tokens=64)
    assert engine.calls == [(N, 64)]
    assert base.exact and base.topk_ids is None
    want = _logsm(logits[:, : LENGTH - 1])
    np.testing.assert_allclose(np.asarray(base.logp), want, atol=2e-5)
    assert base.logp.shape == (N, LENGTH - 1, VOCAB)
    np.testing.assert_array_equal(base.top1, want.argmax(-1))
    top2 = np.sort(want, -1)[..., -2:]
    np.testing.assert_allclose(base.margin, top2[..., 1] - top2[..., 0], atol=2e-5)
    np.testing.assert_array_equal(base.tokens, _rows()[:, 1:])
    assert base.tokens.dtype == np.int32
    np.testing.assert_array_equal(base.target_logp, _tlogp_expected())


def test_a_topk_baseline_keeps_the_top_k_the_tail_mass_and_tail_draws() -> None:
    logits = _logits(1)
    base = fidelity.compute_baseline(
        _Engine(logits), _rows(), exact=False, top_k=5, tail_samples=7, seed=3
    )
    assert not base.exact and base.logp is None
    want = _logsm(logits[:, : LENGTH - 1])
    order = np.argsort(-want, -1)[..., :5]
    np.testing.assert_array_equal(np.asarray(base.topk_ids), order)
    np.testing.assert_allclose(
        np.asarray(base.topk_logp), np.take_along_axis(want, order, -1), atol=2e-5
    )
    outside = want.copy()
    np.put_along_axis(outside, order, -np.inf, -1)
    tail = np.log(np.exp(outside).sum(-1))
    np.testing.assert_allclose(np.asarray(base.tail_logp), tail, atol=2e-5)
    ids = np.asarray(base.tail_ids)
    assert ids.shape == (N, LENGTH - 1, 7)
    assert not (ids[..., :, None] == order[..., None, :]).any()  # draws come from the tail
    np.testing.assert_allclose(
        np.asarray(base.tail_sample_logp), np.take_along_axis(want, ids, -1), atol=2e-5
    )
    # each batch draws with the seed's key folded with its first row: seeded and per batch
    for start in (0, 2):
        m = min(N - start, 2)
        key = jax.random.fold_in(jax.random.PRNGKey(3), start)
        parts = fidelity._top_k_tail(
            jax.numpy.asarray(want[start : start + m], np.float32), 5, 7, key
        )
        np.testing.assert_array_equal(ids[start : start + m], np.asarray(parts[3]))
    again = fidelity.compute_baseline(
        _Engine(logits), _rows(), exact=False, top_k=5, tail_samples=7, seed=4
    )
    assert not np.array_equal(np.asarray(again.tail_ids), ids)


def test_compare_gives_per_token_kl_agreement_and_the_candidates_logp() -> None:
    base_logits, cand_logits = _logits(0), _logits(0) + _logits(5, 0.5)
    base = fidelity.compute_baseline(_Engine(base_logits), _rows(), exact=True, top_k=4)
    engine = _Engine(cand_logits)
    out = fidelity.compare(engine, _rows(), base, kv_tokens=32)
    assert engine.calls == [(N, 32)]
    p, q = _logsm(base_logits[:, : LENGTH - 1]), _logsm(cand_logits[:, : LENGTH - 1])
    kl = (np.exp(p) * (p - q)).sum(-1)
    np.testing.assert_allclose(out["kl"], kl, rtol=1e-4, atol=1e-6)
    assert out["kl"].shape == (N, LENGTH - 1) and out["kl"].dtype == np.float32
    np.testing.assert_array_equal(out["top1_agree"], p.argmax(-1) == q.argmax(-1))
    assert out["top1_agree"].dtype == bool and not out["top1_agree"].all()
    np.testing.assert_array_equal(out["target_logp"], _tlogp_expected())
    same = fidelity.compare(_Engine(base_logits), _rows(), base)
    assert np.abs(same["kl"]).max() < 1e-6 and same["top1_agree"].all()


def test_compare_on_a_topk_baseline_samples_or_lumps_the_tail() -> None:
    base_logits, cand_logits = _logits(0), _logits(0) + _logits(6, 0.7)
    exact = fidelity.compute_baseline(_Engine(base_logits), _rows(), exact=True, top_k=4)
    want = fidelity.compare(_Engine(cand_logits), _rows(), exact)["kl"]
    topk = fidelity.topk_from_exact(exact, 6, tail_samples=256, seed=1)
    assert not topk.exact and np.asarray(topk.topk_ids).shape == (N, LENGTH - 1, 6)
    assert topk.tokens is exact.tokens and topk.margin is exact.margin
    sampled = fidelity.compare(_Engine(cand_logits), _rows(), topk)
    lumped = fidelity.compare(_Engine(cand_logits), _rows(), topk, lumped_tail=True)
    # the one-bin tail is a lower bound (log-sum inequality); the sampled one is closer on
    # average over positions (256 draws of a 34-token tail)
    assert (lumped["kl"] <= want + 1e-5).all() and (lumped["kl"] < want - 1e-4).any()
    assert abs(sampled["kl"].mean() - want.mean()) < abs(lumped["kl"].mean() - want.mean())
    np.testing.assert_array_equal(sampled["top1_agree"], lumped["top1_agree"])
    np.testing.assert_array_equal(sampled["target_logp"], _tlogp_expected())
    # the same draws as the sampler's own function with the seed's key
    parts = fidelity._top_k_tail(exact.logp, 6, 256, jax.random.PRNGKey(1))
    np.testing.assert_array_equal(np.asarray(topk.tail_ids), np.asarray(parts[3]))
    with pytest.raises(ValueError, match=r"^topk_from_exact needs an exact baseline$"):
        fidelity.topk_from_exact(topk, 4)


@pytest.mark.parametrize("exact", [True, False])
def test_a_saved_baseline_reads_back_equal(tmp_path, exact: bool) -> None:
    base = fidelity.compute_baseline(
        _Engine(_logits(2)), _rows(), exact=exact, top_k=3, tail_samples=2
    )
    path = tmp_path / "b.parquet"
    fidelity.save_baseline(base, path)
    assert [p.name for p in tmp_path.iterdir()] == ["b.parquet"]  # no temp file left
    back = fidelity.load_baseline(path, _rows())
    assert back.exact == exact
    for name in ("tokens", "target_logp", "top1", "margin"):
        np.testing.assert_array_equal(getattr(back, name), getattr(base, name), err_msg=name)
    fields = ("logp",) if exact else (
        "topk_ids", "topk_logp", "tail_logp", "tail_ids", "tail_sample_logp"
    )  # fmt: skip
    for name in fields:
        got, want = np.asarray(getattr(back, name)), np.asarray(getattr(base, name))
        assert got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    assert table.column("row").to_pylist()[:6] == [0, 0, 0, 0, 0, 1]
    assert table.column("pos").to_pylist()[:6] == [0, 1, 2, 3, 4, 0]
    # the file's row and position columns are int32, as its other id columns
    assert table.schema.field("row").type == table.schema.field("pos").type == pa.int32()


def test_a_baseline_of_other_rows_is_refused(tmp_path) -> None:
    base = fidelity.compute_baseline(_Engine(_logits()), _rows(), exact=True, top_k=3)
    path = tmp_path / "b.parquet"
    fidelity.save_baseline(base, path)
    # the whole one-line message: which file, what it holds, what was needed
    with pytest.raises(ValueError) as err:
        fidelity.load_baseline(path, _rows()[:2])
    assert str(err.value) == f"baseline cache {path} holds 15 tokens, need 10"
    with pytest.raises(ValueError) as err:  # 3 rows of 4 predicted positions
        fidelity.load_baseline(path, np.zeros((3, 5), np.int32))
    assert str(err.value) == f"baseline cache {path} holds 15 tokens, need 12"
    other = _rows().copy()
    other[2, 5] += 1
    with pytest.raises(ValueError) as err:
        fidelity.load_baseline(path, other)
    assert str(err.value) == f"baseline cache {path} was computed on other tokens"
    first = _rows().copy()
    first[:, 0] = 99  # the BOS column is not predicted: not compared
    assert fidelity.load_baseline(path, first).exact


def test_tail_draws_follow_the_baseline_probabilities_outside_the_top_k() -> None:
    # 8 tokens, the top 2 kept; the other 6 hold 0.4, 0.2 and 4 x 0.1 of the tail's mass
    probs = np.array([0.5, 0.3, 0.08, 0.04, 0.02, 0.02, 0.02, 0.02])
    logp = jax.numpy.asarray(np.log(probs)[None, None, :], np.float32)
    n = 20_000
    ids, _, tail, draws, draw_logp = fidelity._top_k_tail(logp, 2, n, jax.random.PRNGKey(0))
    assert sorted(np.asarray(ids).ravel().tolist()) == [0, 1]
    assert float(tail[0, 0]) == pytest.approx(np.log(0.2), abs=1e-6)
    freq = np.bincount(np.asarray(draws).ravel(), minlength=8) / n
    want = np.r_[0.0, 0.0, probs[2:] / 0.2]
    # binomial sd of a frequency is at most sqrt(0.25 / n) = 0.0035: 5 sd is 0.018; uniform
    # draws over the tail (1/6 each) would miss token 2's 0.4 by 0.23
    np.testing.assert_allclose(freq, want, atol=0.018)
    np.testing.assert_allclose(np.asarray(draw_logp), np.log(probs)[np.asarray(draws)], atol=1e-6)


def test_a_topk_comparison_is_the_top_k_terms_plus_the_sampled_or_lumped_tail() -> None:
    # the top-k part and the tail written out in numpy from the baseline's own draws:
    # sampled: p_tail * mean_j log(p_sj / q_sj); lumped: p_tail * log(p_tail / q_tail), q_tail
    # being the candidate's mass outside the baseline's top k
    base_logits, cand_logits = _logits(0), _logits(0) + _logits(7, 0.8)
    exact = fidelity.compute_baseline(_Engine(base_logits), _rows(), exact=True, top_k=4)
    topk = fidelity.topk_from_exact(exact, 5, tail_samples=9, seed=2)
    p, q = _logsm(base_logits[:, : LENGTH - 1]), _logsm(cand_logits[:, : LENGTH - 1])
    ids, tail_ids = np.asarray(topk.topk_ids), np.asarray(topk.tail_ids)
    head = (np.exp(np.take_along_axis(p, ids, -1)) * np.take_along_axis(p - q, ids, -1)).sum(-1)
    in_head = np.zeros(p.shape, bool)
    np.put_along_axis(in_head, ids, True, -1)
    p_tail = np.where(in_head, 0.0, np.exp(p)).sum(-1)
    q_tail = np.where(in_head, 0.0, np.exp(q)).sum(-1)
    sampled = head + p_tail * np.take_along_axis(p - q, tail_ids, -1).mean(-1)
    lumped = head + p_tail * np.log(p_tail / q_tail)
    got = fidelity.compare(_Engine(cand_logits), _rows(), topk)["kl"]
    np.testing.assert_allclose(got, sampled, rtol=1e-3, atol=1e-5)
    got = fidelity.compare(_Engine(cand_logits), _rows(), topk, lumped_tail=True)["kl"]
    np.testing.assert_allclose(got, lumped, rtol=1e-3, atol=1e-5)


def test_draw_counts_seeds_and_the_kv_window_default_to_64_draws_seed_0_and_none() -> None:
    # The signatures' defaults (compute_baseline, topk_from_exact: 64 tail draws from seed 0;
    # no KV window floor) are what the evaluator relies on when it passes none of them.
    logits = _logits(3)
    engine = _Engine(logits)
    base = fidelity.compute_baseline(engine, _rows(), exact=False, top_k=4)
    assert engine.calls == [(N, None)]
    assert np.asarray(base.tail_ids).shape == (N, LENGTH - 1, 64)
    seeded = fidelity.compute_baseline(
        _Engine(logits), _rows(), exact=False, top_k=4, tail_samples=64, seed=0
    )
    np.testing.assert_array_equal(np.asarray(base.tail_ids), np.asarray(seeded.tail_ids))
    exact = fidelity.compute_baseline(_Engine(logits), _rows(), exact=True, top_k=4)
    engine = _Engine(logits)
    fidelity.compare(engine, _rows(), exact)
    assert engine.calls == [(N, None)]
    topk = fidelity.topk_from_exact(exact, 4)
    parts = fidelity._top_k_tail(exact.logp, 4, 64, jax.random.PRNGKey(0))
    for name, want in zip(
        ("topk_ids", "topk_logp", "tail_logp", "tail_ids", "tail_sample_logp"), parts, strict=True
    ):
        np.testing.assert_array_equal(np.asarray(getattr(topk, name)), np.asarray(want), name)
    # the per-token summaries are the exact baseline's own arrays
    for name in ("tokens", "target_logp", "top1", "margin"):
        assert getattr(topk, name) is getattr(exact, name), name
    assert topk.logp is None and not topk.exact


def test_a_saved_baseline_is_zstd_compressed(tmp_path) -> None:
    # The cache holds a [rows, positions, V] log-distribution in exact mode: zstd keeps it a
    # fraction of its raw size (the column chunks' codec, read from the file's metadata).
    import pyarrow.parquet as pq

    base = fidelity.compute_baseline(_Engine(_logits()), _rows(), exact=True, top_k=3)
    path = tmp_path / "b.parquet"
    fidelity.save_baseline(base, path)
    meta = pq.ParquetFile(path).metadata
    group = meta.row_group(0)
    codecs = {group.column(i).compression for i in range(group.num_columns)}
    assert codecs == {"ZSTD"}
