"""tenantq.capacity: how many tenants fit on a deployment, by exact arithmetic.

Hardware profiles, model presets, the per-chip budget (HBM -> weights -> reserve -> KV pool
-> pages -> tenants) and the KV pool's byte formula shared with the engine. Imports no JAX,
Ray or MLflow at import time (the search driver imports it); byte counts come from
`tenantq.numerics.storage_nbytes`, loaded when a budget is first computed.
"""

from tenantq.capacity.budget import Budget, KVLine, WeightLine, budget, max_context_for
from tenantq.capacity.hardware import (
    HARDWARE,
    Deployment,
    HardwareProfile,
    Reserve,
    get_hardware,
    hardware_names,
)
from tenantq.capacity.kv import kv_pool_bytes
from tenantq.capacity.presets import PRESETS, get_model_config, model_names
from tenantq.capacity.units import parse_bytes

__all__ = [
    "HARDWARE",
    "PRESETS",
    "Budget",
    "Deployment",
    "HardwareProfile",
    "KVLine",
    "Reserve",
    "WeightLine",
    "budget",
    "get_hardware",
    "get_model_config",
    "hardware_names",
    "kv_pool_bytes",
    "max_context_for",
    "model_names",
    "parse_bytes",
]
