"""The algorithms a plan rule may name, as one literal table: name -> quantizing function.

Each entry is `fn(weight float32 [in, out] (embedding [vocab, hidden]), how, **inputs) ->
QArray`. The table is written out here, not filled by import side effects, so no algorithm
module imports back into `apply`; tests assert its names equal `plan.ALGORITHM_NAMES`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tenantq.numerics import QArray, quantize
from tenantq.quant.awq import awq_weight
from tenantq.quant.gptq import gptq_weight
from tenantq.quant.plan import TensorQuant
from tenantq.quant.smoothquant import smoothquant_weight

Algorithm = Callable[..., QArray]


def round_to_nearest(weight, how: TensorQuant, **_: Any) -> QArray:
    """The `rtn` algorithm: each group's scale from its own max, values rounded to nearest."""
    return quantize(
        weight, how.format, axis=how.axis, group_size=how.group_size, symmetric=how.symmetric
    )


ALGORITHMS: dict[str, Algorithm] = {
    "rtn": round_to_nearest,
    "gptq": gptq_weight,
    "awq": awq_weight,
    "smoothquant": smoothquant_weight,
}
