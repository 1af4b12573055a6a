"""tenantq.workers: the Ray `HostWorker` actor that owns one host's devices, and its pool.

Workers are pure compute: each loads the model and the eval data once, keeps the bf16
baseline and compiled executables, and turns a plan (JSON) into a `TrialResult`. The driver
owns all state; only plans and results cross the wire.
"""

from tenantq.workers.host import HostWorker, TrialResult, worker_options
from tenantq.workers.pool import Finished, WorkerPool

__all__ = ["Finished", "HostWorker", "TrialResult", "WorkerPool", "worker_options"]
