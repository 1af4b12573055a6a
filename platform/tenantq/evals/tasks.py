"""The suite's tasks as objects: each runs on a candidate engine and scores against its baseline.

The evaluator draws the examples (`evals.windows`, `evals.needle_grid`, `evals.structured`),
then loops over these: `run(engine, baseline)` measures the candidate, `summarize(baseline,
measured, rows)` turns the pair into the summary's figures and one row per example. Two kinds:
`FidelityTask` (KL, top-1 agreement and perplexity, bootstrap CIs over windows) and
`PassFailTask` (needles, structured: Tango's paired-proportion CI and exact McNemar per group).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tenantq.evals import fidelity, stats
from tenantq.evals.generation import Generated
from tenantq.evals.suite import pass_fail_key


@dataclass
class FidelityTask:
    """KL, top-1 agreement and perplexity of the candidate on the fidelity windows."""

    rows: np.ndarray  # [n, L] BOS + window
    kv_tokens: int | None  # the KV window the baseline was computed at
    resamples: int
    seed: int
    phase: str = "fidelity"
    steps: int = 1  # progress steps

    def baseline_of(self, baseline: dict[str, Any]):
        return baseline["fidelity"]

    def run(self, engine, base) -> fidelity.KLMeasurement:
        return fidelity.kl_against_baseline(
            engine, self.rows, base, resamples=self.resamples, seed=self.seed,
            kv_tokens=self.kv_tokens,
        )  # fmt: skip

    def _ci(self, base, cand, **kw) -> stats.PairedCI:
        return stats.paired_bootstrap(base, cand, resamples=self.resamples, seed=self.seed, **kw)

    def summarize(self, base, measured: fidelity.KLMeasurement, rows: list) -> dict[str, Any]:
        cand, kl_seq, kl = measured.per_token, measured.per_window, measured.ci
        agree_seq = cand["top1_agree"].mean(axis=1)
        nll_base, nll_cand = -base.target_logp.mean(axis=1), -cand["target_logp"].mean(axis=1)
        agree = self._ci(np.ones_like(agree_seq), agree_seq)
        ppl = self._ci(nll_base, nll_cand, contrast=lambda c, b: np.exp(c - b))
        out = {
            "fidelity.kl_mean": kl.delta, "fidelity.kl_mean.ci_low": kl.ci_low,
            "fidelity.kl_mean.ci_high": kl.ci_high,
            "fidelity.kl_p99": float(np.quantile(cand["kl"], 0.99)),
            "fidelity.kl_max": float(cand["kl"].max()),
            "fidelity.top1_agree": agree.candidate,
            "fidelity.top1_agree_delta": agree.delta,
            "fidelity.top1_agree_delta.ci_low": agree.ci_low,
            "fidelity.top1_agree_delta.ci_high": agree.ci_high,
            "fidelity.ppl_base": float(np.exp(nll_base.mean())),
            "fidelity.ppl_cand": float(np.exp(nll_cand.mean())),
            "fidelity.ppl_ratio": ppl.delta, "fidelity.ppl_ratio.ci_low": ppl.ci_low,
            "fidelity.ppl_ratio.ci_high": ppl.ci_high,
            "fidelity.tokens": int(cand["kl"].size),
            "fidelity.exact": int(base.exact),
        }  # fmt: skip
        for i in range(len(kl_seq)):
            rows.append({
                "task": "fidelity", "example_id": f"fidelity/{i}",
                "length": int(self.rows.shape[1]), "depth": float("nan"),
                "baseline_score": float(nll_base[i]), "candidate_score": float(nll_cand[i]),
                "kl": float(kl_seq[i]), "top1_agree": float(agree_seq[i]),
                "margin": float(base.margin[i].mean()), "candidate_margin": float("nan"),
                "flip": "", "baseline_tokens": [], "candidate_tokens": [],
                "baseline_margins": [],
            })  # fmt: skip
        return out


@dataclass
class PassFailTask:
    """Greedy answers checked pass/fail (needles, structured), paired with bf16's.

    `generate(engine, items)` runs them; `passed(item, generated)` checks one; `group`
    "len" reports per prompt length (needles), "task" per task and whole (structured).
    `offset`: where this task's items start in the baseline's one list of generations."""

    phase: str
    items: list
    group: str
    generate: Callable[[Any, list], list[Generated]]
    passed: Callable[[Any, Generated], bool]
    offset: int = 0
    steps: int = 1
    baseline_passes: dict[str, tuple[int, int]] = field(default_factory=dict)

    def baseline_of(self, baseline: dict[str, Any]) -> list[Generated]:
        return baseline["generations"][self.offset : self.offset + len(self.items)]

    def run(self, engine, base=None) -> list[Generated]:
        return self.generate(engine, self.items)

    def summarize(self, base_gens, cand_gens, rows: list) -> dict[str, Any]:
        base_pass = [self.passed(i, g) for i, g in zip(self.items, base_gens, strict=True)]
        cand_pass = [self.passed(i, g) for i, g in zip(self.items, cand_gens, strict=True)]
        return self.pair(base_pass, cand_pass, base_gens, cand_gens, rows)

    def pair(self, base_pass, cand_pass, base_gens, cand_gens, rows: list) -> dict[str, Any]:
        """The paired figures of each group from the verdicts; one row per item; the bf16
        passes per group in `baseline_passes` (the suite's pass-rate bar)."""
        items, group = self.items, self.group
        out: dict[str, float | int] = {}
        base_pass, cand_pass = np.asarray(base_pass, bool), np.asarray(cand_pass, bool)
        # (name prefix, name suffix, examples): needle.acc_delta.len1019, structured.acc_delta,
        # structured.acc_delta.close_line
        groups: list[tuple[str, str, np.ndarray]] = []
        task_of = np.array([i.task for i in items])
        key_of = np.array([f"len{i.length}" if group == "len" else i.task_name for i in items])
        for task in dict.fromkeys(task_of):
            in_task = task_of == task
            if group == "task":
                groups.append((task, "", in_task))
            for key in dict.fromkeys(key_of[in_task]):
                groups.append((task, f".{key}", in_task & (key_of == key)))
        for prefix, suffix, mask in groups:
            b, c = base_pass[mask], cand_pass[mask]
            ci = stats.paired_proportion_ci(b, c)  # Tango's score CI, not the bootstrap
            c2w, w2c = stats.discordant_counts(b, c)
            if suffix:  # one task or one length: the unit the suite's pass-rate bar applies to
                self.baseline_passes[f"{prefix}{suffix}"] = (int(b.sum()), int(b.size))
            figures = {
                "acc_base": ci.baseline, "acc_cand": ci.candidate, "acc_delta": ci.delta,
                "acc_delta.ci_low": ci.ci_low, "acc_delta.ci_high": ci.ci_high,
                "flips.correct_to_wrong": c2w,
                "flips.wrong_to_correct": w2c, "mcnemar_p": stats.mcnemar_exact(c2w, w2c),
                "n": int(mask.sum()),
            }  # fmt: skip
            for m, v in figures.items():
                out[pass_fail_key(prefix, m, suffix)] = v
        for item, b, c, gb, gc in zip(
            items, base_pass, cand_pass, base_gens, cand_gens, strict=True
        ):
            rows.append({
                "task": item.task, "example_id": item.example_id,
                "length": int(getattr(item, "length", len(item.prompt))),
                "depth": float(getattr(item, "depth", float("nan"))),
                "baseline_score": float(b), "candidate_score": float(c), "kl": float("nan"),
                "top1_agree": float("nan"),
                # min over the recorded steps: a teacher-forced needle that fails records
                # them up to its first wrong token only (`generation.Generated`)
                "margin": float(min(gb.margins)) if gb.margins else float("nan"),
                "candidate_margin": float(min(gc.margins)) if gc.margins else float("nan"),
                "flip": flip(b, c),
                "baseline_tokens": gb.tokens, "candidate_tokens": gc.tokens,
                "baseline_margins": gb.margins,
            })  # fmt: skip
        return out


def flip(baseline_pass: bool, candidate_pass: bool) -> str:
    """ "correct_to_wrong", "wrong_to_correct", or "" when the verdict did not change."""
    if baseline_pass == candidate_pass:
        return ""
    return "correct_to_wrong" if baseline_pass else "wrong_to_correct"
