"""`apply_plan`: the one function that turns full-precision params into quantized params.

A plan resolves to one `TensorQuant` per quantized tensor; each is produced by the
algorithm its rule names, looked up in a registry. Round-to-nearest ("rtn") is built in;
GPTQ, AWQ and SmoothQuant are the other entries of `quant.algorithms.ALGORITHMS` and receive
whatever calibration inputs the caller passes through. `load_quantized` is where a plan
meets a checkpoint: it quantizes the loader's tensor stream one tensor at a time with the
same `quantize_tensor`, so both paths store identical bytes.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tenantq.model.config import ModelConfig, TensorInfo
from tenantq.model.layers import StaticActQArray
from tenantq.numerics import QArray, compute_scale_zero_point
from tenantq.quant.algorithms import ALGORITHMS
from tenantq.quant.plan import QuantPlan, TensorQuant, check_w8a8


class UnusedRuleWarning(UserWarning):
    """A plan rule was the first match for no tensor (a typo, or shadowed by an earlier rule)."""


def registered_algorithms() -> tuple[str, ...]:
    return tuple(ALGORITHMS)


def quantize_tensor(weight, how: TensorQuant, *, act_amax=None, **inputs: Any) -> QArray:
    """Quantize one tensor as `how` says, with the algorithm its rule names.

    Static W8A8 (`how.activation_scale == "static"`) also needs `act_amax`, the calibrated
    max |x| of the tensor's input (`calibrate.prepare` passes it); the activation scale is
    the activation format's own scale for that amax, stored with the weight.
    """
    check_w8a8(how)
    algorithm = ALGORITHMS.get(how.algorithm)
    if algorithm is None:
        raise ValueError(
            f"{how.path}: algorithm {how.algorithm!r} is not available; "
            f"registered: {', '.join(ALGORITHMS)}"
        )
    if how.activation_scale != "static":
        return algorithm(jnp.asarray(weight, dtype=jnp.float32), how, **inputs)
    if act_amax is None:
        raise ValueError(
            f"{how.path}: static activation scales need calibration statistics; run "
            "tenantq.quant.calibrate.prepare(params, plan, config, stats) and pass its inputs "
            "to apply_plan"
        )
    q = algorithm(jnp.asarray(weight, dtype=jnp.float32), how, **inputs)
    return StaticActQArray.wrap(q, static_activation_scale(act_amax, how.activations))


def static_activation_scale(act_amax, activations: str) -> jax.Array:
    """The one per-tensor scale `activations` prescribes for inputs of max |x| `act_amax`."""
    amax = np.float32(act_amax)
    if not np.isfinite(amax) or amax < 0:
        raise ValueError(f"act_amax must be a finite max |x| >= 0, got {act_amax!r}")
    scale, _ = compute_scale_zero_point(jnp.zeros((1,)), activations, axis=None, amax=amax)
    return scale.reshape(())


def infer_tensors(params: Mapping[str, Any]) -> dict[str, TensorInfo]:
    """The tensor inventory read off params keyed by tensor path, for callers without a config.

    Same conventions as `ModelConfig.tensors()`: `embed` [vocab, hidden] is quantized along
    axis 1, 2-D `*_proj` and `lm_head` [in, out] along axis 0, everything else never.
    """
    out = {}
    for path, value in params.items():
        shape = tuple(int(d) for d in getattr(value, "shape", ()))
        if isinstance(value, QArray):
            shape = value.shape
        name = path.rsplit("/", 1)[-1]
        if path == "embed" and len(shape) == 2:
            out[path] = TensorInfo(path, shape, "embedding", 1)
        elif (name.endswith("_proj") or path == "lm_head") and len(shape) == 2:
            out[path] = TensorInfo(path, shape, "linear", 0)
        else:
            kind = "bias" if name.endswith("_bias") else "norm"
            out[path] = TensorInfo(path, shape, kind, None)
    return out


def apply_plan(
    params: Mapping[str, Any],
    plan: QuantPlan | None,
    config: ModelConfig | None = None,
    *,
    strict: bool = False,
    inputs: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Params with every tensor the plan quantizes replaced by its `QArray`.

    `params` maps tensor paths (`config.tensors()`) to arrays; tensors the plan leaves
    alone are returned as they are (casting is the engine's business). Without `config`
    the inventory is read off the params themselves (`infer_tensors`). A tensor that is
    already a QArray of the planned format is kept, so applying a plan twice is harmless;
    any other QArray leaf is an error, since re-quantizing quantized values compounds error.
    Unused rules warn (`UnusedRuleWarning`), or raise with `strict=True`. `inputs[path]`
    is passed to that tensor's algorithm as keyword arguments (calibration statistics).
    """
    plan = plan or QuantPlan()
    expected = config.tensors() if config is not None else infer_tensors(params)
    unknown = sorted(set(params) - set(expected))
    if unknown:
        raise ValueError(f"params hold tensors the model does not have: {unknown[:5]}")
    unused = plan.unused_rules(expected)
    if unused:
        names = ", ".join(repr(r.pattern) for r in unused)
        message = f"plan rules matched no tensor (first match wins): {names}"
        if strict:
            raise ValueError(message)
        warnings.warn(message, UnusedRuleWarning, stacklevel=2)
    resolved = plan.resolve(expected)
    out: dict[str, Any] = {}
    for path, value in params.items():
        how = resolved.get(path)
        if isinstance(value, QArray):
            if how is None or value.fmt != how.format:
                planned = "full precision" if how is None else how.format
                raise ValueError(
                    f"{path} is already quantized to {value.fmt} but the plan wants {planned}; "
                    "apply a plan to full-precision params"
                )
            out[path] = value
        elif how is None:
            out[path] = value
        else:
            out[path] = quantize_tensor(value, how, **dict((inputs or {}).get(path, {})))
    return out


def load_quantized(
    folder: str | Path,
    config: ModelConfig,
    plan: QuantPlan | None = None,
    *,
    dtype: Any = "bfloat16",
) -> dict[str, Any]:
    """Params of a checkpoint folder with `plan` applied as each tensor streams in.

    Tensors the plan quantizes go straight from the loader's float array to their `QArray`
    (rtn through `quantize_tensor`, as `apply_plan` does); the rest are cast to `dtype`.
    Peak host memory stays near the result plus one full-precision tensor. Unused rules
    are not reported here; `apply_plan` (which the Engine runs on these params) does.
    A compressed-tensors folder (`tenantq export`) gives its quantized tensors as stored;
    the plan must quantize them to the same formats (`model.compressed.checkpoint_plan`).
    """
    import numpy as np

    from tenantq.model.compressed import iter_compressed
    from tenantq.model.config import is_compressed_tensors
    from tenantq.model.loader import iter_checkpoint

    resolved = (plan or QuantPlan()).resolve(config)
    params: dict[str, Any] = {}
    compressed = is_compressed_tensors(folder)
    stream = iter_compressed(folder, config) if compressed else iter_checkpoint(folder, config)
    for path, array in stream:
        how = resolved.get(path)
        if isinstance(array, QArray):  # stored quantized (compressed-tensors): kept as stored
            if how is None or how.format != array.fmt:
                planned = "full precision" if how is None else how.format
                raise ValueError(
                    f"{folder}: {path} is stored as {array.fmt} but the plan wants {planned}; "
                    "load a compressed-tensors folder with plan=None (its own plan)"
                )
            params[path] = array
        elif how is None:
            params[path] = jnp.asarray(array, dtype=jnp.dtype(dtype))
        else:
            params[path] = quantize_tensor(np.asarray(array, dtype=np.float32), how)
        del array
    return params
