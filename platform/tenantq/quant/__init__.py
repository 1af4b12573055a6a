"""tenantq.quant: plans, `apply_plan`, calibration statistics and the calibrated algorithms.

`import tenantq.quant` stays free of JAX (the capacity planner reads plans without it), yet
GPTQ, AWQ and SmoothQuant must be registered wherever a plan is applied. So the package
watches for its `apply` submodule: the moment `tenantq.quant.apply` has loaded (which every
caller of `apply_plan`/`quantize_tensor` triggers), the algorithm modules are imported
and register themselves with `register_algorithm`.
"""

from __future__ import annotations

import importlib
import sys
import types

_ALGORITHM_MODULES = ("tenantq.quant.smoothquant", "tenantq.quant.gptq", "tenantq.quant.awq")


class _QuantPackage(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name == "apply" and isinstance(value, types.ModuleType):  # import system binds it
            for module in _ALGORITHM_MODULES:
                importlib.import_module(module)


sys.modules[__name__].__class__ = _QuantPackage
