"""The study's Prometheus series, exported through Ray's metrics agent (`ray.util.metrics`).

The names, tags and buckets are the contract dashboards/README.md documents for the Grafana
dashboard: trials finished by state, trial duration, busy workers, failed attempts by reason.
A study without Ray (capacity only) exports nothing.
"""

from __future__ import annotations

# Histogram buckets (s), as dashboards/README.md specifies.
DURATION_BOUNDARIES_S = [1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600]


class StudyMetrics:
    def __init__(self, study: str, enabled: bool) -> None:
        self.tags = {"study": study}
        self.enabled = enabled
        if not enabled:
            return
        from ray.util.metrics import Counter, Gauge, Histogram

        self.trials = Counter(
            "tenantq_trials_total", "trials finished, by final state", tag_keys=("study", "state")
        )
        self.duration = Histogram(
            "tenantq_trial_duration_s",
            "wall seconds from submitting a trial to a worker to its result",
            boundaries=DURATION_BOUNDARIES_S,
            tag_keys=("study",),
        )
        self.busy = Gauge("tenantq_workers_busy", "workers with a trial in flight", ("study",))
        self.failures = Counter(
            "tenantq_trial_failures_total",
            "failed attempts, by reason (error, worker_died, timeout)",
            tag_keys=("study", "reason"),
        )

    def finished(self, state: str) -> None:
        if self.enabled:
            self.trials.inc(1, tags={**self.tags, "state": state})

    def attempt(self, duration_s: float, failure: str | None = None) -> None:
        if not self.enabled:
            return
        self.duration.observe(duration_s, tags=self.tags)
        if failure:
            self.failures.inc(1, tags={**self.tags, "reason": failure})

    def workers_busy(self, n: int) -> None:
        if self.enabled:
            self.busy.set(n, tags=self.tags)
