"""tenantq.workers: the Ray `HostWorker` actor that owns one host's devices, the
`SliceWorker` that runs one trial across the hosts of a slice, and their pool.

Workers are pure compute: each loads the model and the eval data once, keeps the bf16
baseline and compiled executables, and turns a plan (JSON) into a `TrialResult`. The driver
owns all state; only plans and results cross the wire.
"""

from tenantq.workers.host import HostWorker, TrialResult, worker_options
from tenantq.workers.pool import Finished, WorkerPool
from tenantq.workers.slice import SliceHost, SliceWorker

__all__ = [
    "Finished", "HostWorker", "SliceHost", "SliceWorker", "TrialResult", "WorkerPool",
    "worker_options",
]  # fmt: skip
