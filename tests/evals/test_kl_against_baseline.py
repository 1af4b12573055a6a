"""`kl_against_baseline`, the KL figure every caller reports, against numpy references.

A stand-in engine yields fixed logits through `device_logits` the way `Engine` does
(`engine.py`: chunks of `max_seqs` rows, `b` and `s` "the padded bucket": rows past the end
and positions past a row's end are padding). Padding here holds loud garbage, so any
padded row or position that leaks into a figure moves it far past the tolerances. The
references are direct numpy: log-softmax in float64, KL(p || q) = sum_v p_v (log p_v - log
q_v) with p the baseline (bf16) and q the candidate (the module docstring's direction), the
per-window mean over the predicted positions, and the paired percentile bootstrap of those
means against 0 written out from the seed's generator.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tenantq.evals import fidelity, stats

N, LENGTH, VOCAB = 5, 7, 24  # 5 windows of 7 tokens: 6 predicted positions each
P = LENGTH - 1
GARBAGE = 50.0  # padded logits: a one-hot-like distribution far from every real one


def _logsm(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(p || q) per position, [N, P], over the real positions only."""
    p, q = _logsm(p_logits[:, :P]), _logsm(q_logits[:, :P])
    return (np.exp(p) * (p - q)).sum(-1)


class _Engine:
    """`device_logits` over fixed [N, LENGTH, VOCAB] logits: chunks of `batch` rows padded
    to `batch` rows and `seq` positions with garbage; `empty_chunk` adds one more chunk
    starting at the row count, all padding (a chunk with zero real rows)."""

    def __init__(self, logits, batch=2, seq=LENGTH, empty_chunk=False):
        self.logits = np.asarray(logits, np.float32)
        self.batch, self.seq, self.empty_chunk, self.calls = batch, seq, empty_chunk, []

    def _padded(self, part: np.ndarray) -> np.ndarray:
        out = np.zeros((self.batch, self.seq, VOCAB), np.float32)
        out[..., 0] = GARBAGE
        out[: part.shape[0], : part.shape[1]] = part
        return out

    def device_logits(self, rows, kv_tokens=None):
        self.calls.append((len(rows), kv_tokens))
        n = len(rows)
        starts = list(range(0, n, self.batch)) + ([n] if self.empty_chunk else [])
        for start in starts:
            part = self._padded(self.logits[start : min(start + self.batch, n)])
            # the candidate's log p(next token): row r, position t holds -(100 r + t)
            tlogp = np.full((self.batch, self.seq), GARBAGE, np.float32)
            for i in range(min(self.batch, max(0, n - start))):
                tlogp[i] = -(100.0 * (start + i) + np.arange(self.seq))
            yield start, jnp.asarray(part), jnp.asarray(tlogp)


def _rows(n: int = N) -> np.ndarray:
    return (np.arange(n * LENGTH, dtype=np.int32).reshape(n, LENGTH) * 7) % VOCAB


def _logits(seed: int, scale: float) -> np.ndarray:
    return np.random.default_rng(seed).normal(scale=scale, size=(N, LENGTH, VOCAB))


def _pair() -> tuple[np.ndarray, np.ndarray]:
    """A peaked baseline and a flatter, shifted candidate: KL(p || q) and KL(q || p) differ
    by far more than float32 rounding at every position (checked in the test)."""
    base = _logits(0, 4.0)
    return base, 0.4 * base + _logits(1, 1.5)


def _target_logp(n: int = N) -> np.ndarray:
    return -(100.0 * np.arange(n)[:, None] + np.arange(P)[None, :])


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "top-k"])
def test_kl_is_of_the_baseline_against_the_candidate_per_token_and_per_window(exact) -> None:
    # KL(p || q), p the baseline: the module docstring's figure. The top-k baseline keeps
    # VOCAB - 1 tokens, so its tail is one token and every tail draw is that token: the
    # sampled tail term p_tail * log(p_tail / q_tail) is then exact, and both modes must
    # match the full sum to float32 rounding (rtol 1e-4 of a KL of order 1).
    base_logits, cand_logits = _pair()
    base = fidelity.compute_baseline(_Engine(base_logits), _rows(), exact=True, top_k=4)
    if not exact:
        base = fidelity.topk_from_exact(base, VOCAB - 1, tail_samples=3, seed=5)
    engine = _Engine(cand_logits)
    got = fidelity.kl_against_baseline(engine, _rows(), base, resamples=200, kv_tokens=48)
    assert engine.calls == [(N, 48)]  # one pass over all the windows, at the baseline's window
    want = _kl(base_logits, cand_logits)
    reverse = _kl(cand_logits, base_logits)
    # the direction is visible at every position: the reverse KL is over 100 times the
    # tolerance below away from the forward one
    assert (np.abs(want - reverse) > 100 * (1e-4 * want + 1e-6)).all()
    np.testing.assert_allclose(got.per_token["kl"], want, rtol=1e-4, atol=1e-6)
    assert got.per_token["kl"].shape == (N, P) and got.per_token["kl"].dtype == np.float32
    np.testing.assert_allclose(got.per_window, want.mean(axis=1), rtol=1e-4)
    assert got.per_window.shape == (N,)
    np.testing.assert_allclose(got.ci.delta, want.mean(), rtol=1e-4)
    assert got.ci.baseline == 0.0 and got.ci.n == N
    np.testing.assert_array_equal(got.per_token["target_logp"], _target_logp())


def test_top1_agreement_is_the_candidates_argmax_against_the_baselines() -> None:
    # agreement per position: argmax_v q == argmax_v p (numpy's argmax of the float64
    # log-softmax); the pair is built to agree at some positions and not at others
    base_logits = _logits(2, 3.0)
    cand_logits = base_logits.copy()
    cand_logits[:, ::2] += _logits(3, 6.0)[:, ::2]
    base = fidelity.compute_baseline(_Engine(base_logits), _rows(), exact=True, top_k=4)
    want = _logsm(base_logits[:, :P]).argmax(-1) == _logsm(cand_logits[:, :P]).argmax(-1)
    assert want.any() and not want.all()
    for b in (base, fidelity.topk_from_exact(base, 3, tail_samples=2)):
        got = fidelity.kl_against_baseline(_Engine(cand_logits), _rows(), b, resamples=50)
        np.testing.assert_array_equal(got.per_token["top1_agree"], want)
        assert got.per_token["top1_agree"].dtype == bool


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "top-k"])
def test_padded_rows_and_positions_do_not_count(exact) -> None:
    # The same windows through chunks of 1 unpadded row and through chunks of 4 rows
    # (3 garbage rows in the last) padded to 10 positions (3 of garbage past each row's end,
    # and the row's own last position, which predicts nothing): every figure is the same,
    # and equal to numpy's over the real rows and their P predicted positions.
    base_logits, cand_logits = _pair()
    plain = fidelity.compute_baseline(
        _Engine(base_logits, batch=1), _rows(), exact=exact, top_k=VOCAB - 1, tail_samples=3
    )
    padded = fidelity.compute_baseline(
        _Engine(base_logits, batch=4, seq=LENGTH + 3), _rows(), exact=exact,
        top_k=VOCAB - 1, tail_samples=3,
    )  # fmt: skip
    for name in ("tokens", "target_logp", "top1", "margin"):
        assert getattr(padded, name).shape == (N, P), name
        np.testing.assert_allclose(getattr(padded, name), getattr(plain, name), err_msg=name)
    np.testing.assert_array_equal(padded.top1, _logsm(base_logits[:, :P]).argmax(-1))
    # (one tail token: every draw is that token, whatever each chunk's key)
    fields = ("logp",) if exact else (
        "topk_ids", "topk_logp", "tail_logp", "tail_ids", "tail_sample_logp"
    )  # fmt: skip
    for name in fields:
        got = np.asarray(getattr(padded, name))
        assert got.shape[:2] == (N, P), name
        np.testing.assert_allclose(got, np.asarray(getattr(plain, name)), atol=1e-6, err_msg=name)
    want = _kl(base_logits, cand_logits)
    for engine in (_Engine(cand_logits, batch=1), _Engine(cand_logits, 4, seq=LENGTH + 3)):
        got = fidelity.kl_against_baseline(engine, _rows(), padded, resamples=100)
        np.testing.assert_allclose(got.per_token["kl"], want, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(got.per_window, want.mean(axis=1), rtol=1e-4)
        np.testing.assert_array_equal(got.per_token["target_logp"], _target_logp())


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "top-k"])
def test_a_chunk_with_no_real_rows_changes_nothing(exact) -> None:
    # A chunk that starts at the row count holds only padding (zero real rows): the baseline
    # and the comparison keep N rows, and their figures are those without that chunk.
    base_logits, cand_logits = _pair()

    def baseline(engine):
        return fidelity.compute_baseline(
            engine, _rows(), exact=exact, top_k=VOCAB - 1, tail_samples=3
        )

    plain, extra = baseline(_Engine(base_logits)), baseline(_Engine(base_logits, empty_chunk=True))
    fields = ("logp",) if exact else ("topk_ids", "topk_logp", "tail_logp", "tail_ids")
    for name in ("top1", "margin", "target_logp", *fields):
        got, want = np.asarray(getattr(extra, name)), np.asarray(getattr(plain, name))
        assert got.shape == want.shape and got.shape[:2] == (N, P), name
        np.testing.assert_array_equal(got, want, err_msg=name)
    got = fidelity.kl_against_baseline(
        _Engine(cand_logits, empty_chunk=True), _rows(), extra, resamples=100
    )
    np.testing.assert_allclose(got.per_token["kl"], _kl(base_logits, cand_logits), rtol=1e-4)
    assert got.per_window.shape == (N,)
    np.testing.assert_array_equal(got.per_token["target_logp"], _target_logp())


def test_no_windows_at_all_is_refused_not_a_nan_figure() -> None:
    # Zero rows: no chunk at all; the mean KL of no window has no interval, so the
    # measurement is refused (stats.paired_bootstrap's error), never a NaN that a gate reads.
    base_logits = _logits(0, 4.0)
    base = fidelity.compute_baseline(_Engine(base_logits), _rows(), exact=True, top_k=4)
    engine = _Engine(base_logits)
    with pytest.raises(ValueError, match="at least one example"):
        fidelity.kl_against_baseline(engine, _rows(0), base, resamples=10)
    assert engine.calls == [(0, None)]


def _bootstrap(per_window: np.ndarray, resamples: int, seed: int) -> tuple[float, float]:
    """The 95% percentile interval of the mean over `resamples` draws of the windows with
    replacement, from numpy's generator seeded `seed` (one [resamples, n] index draw)."""
    idx = np.random.default_rng(seed).integers(0, per_window.size, size=(resamples, N))
    means = np.asarray(per_window, np.float64)[idx].mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return float(lo), float(hi)


def test_the_interval_is_the_seeded_paired_bootstrap_of_the_window_means() -> None:
    # The CI resamples whole windows (the pairing unit) `resamples` times from `seed`:
    # equal to the numpy percentile bootstrap of the per-window means against 0; the same
    # seed gives the same interval, another seed another one (5 windows: 3,125 equally
    # likely resamples, so two seeds' 400-draw quantiles differ), and the default seed is 0.
    base_logits, cand_logits = _pair()
    base = fidelity.compute_baseline(_Engine(base_logits), _rows(), exact=True, top_k=4)

    def measure(**kw):
        return fidelity.kl_against_baseline(_Engine(cand_logits), _rows(), base, **kw)

    a, again = measure(resamples=400, seed=7), measure(resamples=400, seed=7)
    b, default = measure(resamples=400, seed=8), measure(resamples=400)
    want = _kl(base_logits, cand_logits).mean(axis=1)
    assert a.ci == again.ci
    assert (a.ci.ci_low, a.ci.ci_high) != (b.ci.ci_low, b.ci.ci_high)
    for got, seed in ((a, 7), (b, 8), (default, 0)):
        lo, hi = _bootstrap(got.per_window, 400, seed)
        assert (got.ci.ci_low, got.ci.ci_high) == pytest.approx((lo, hi), rel=1e-12)
        assert got.ci.ci_low <= got.ci.delta <= got.ci.ci_high
        assert got.ci == stats.paired_bootstrap(
            np.zeros(N), got.per_window, resamples=400, seed=seed
        )
        np.testing.assert_allclose(_bootstrap(want, 400, seed), (lo, hi), rtol=1e-4)
    fewer = measure(resamples=40, seed=7)  # `resamples` reaches the bootstrap
    assert (fewer.ci.ci_low, fewer.ci.ci_high) == pytest.approx(_bootstrap(fewer.per_window, 40, 7))
