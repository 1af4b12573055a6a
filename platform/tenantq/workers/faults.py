"""Workers that fail on purpose, for the tests of what a study does when a trial raises.

`SearchDriver(..., worker_class=FailQuantizedTrials)` runs the study on workers whose
`evaluate` raises for every plan that quantizes something, while the all-bf16 baseline
completes: the failure is the worker's own exception, raised in the Ray actor, exactly as a
real one (an out-of-memory compile, a format a kernel lacks) would be. Lives in the package
so that Ray's workers import it by name.
"""

from __future__ import annotations

from tenantq.workers.host import HostWorker

INJECTED_ERROR = "injected failure (tenantq.workers.faults): this worker refuses quantized plans"


class FailQuantizedTrials(HostWorker):
    """A HostWorker whose trials raise `RuntimeError(INJECTED_ERROR)` unless the plan is all
    bf16 (the default `QuantPlan()`)."""

    def evaluate(self, plan_json: str, suite: str | None = None, split: str = "search"):
        from tenantq.quant.plan import QuantPlan

        plan = QuantPlan.from_json(plan_json)
        if plan.fingerprint() != QuantPlan().fingerprint():  # anything but all bf16
            raise RuntimeError(INJECTED_ERROR)
        return super().evaluate(plan_json, suite, split)
