"""Read a Hugging Face checkpoint folder (safetensors only) into engine params.

The safetensors header is parsed here and each tensor is memory-mapped on its own, so a
load touches one tensor at a time: it is transposed to the engine's [in, out] layout and,
when a plan is given, quantized at once, which keeps peak host memory near the quantized
model plus one tensor. Pickle (`*.bin`) is never read. Errors name the tensor, the file
and what was expected.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from tenantq.model.config import ModelConfig
from tenantq.model.decoder import check_supported

# safetensors dtype codes the loader reads; others (ints, fp8, packed GPTQ) are rejected.
READABLE_DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
}
# HF tensors that carry nothing the engine needs (precomputed RoPE tables).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")

_ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


def hf_names(config: ModelConfig) -> dict[str, tuple[str, bool]]:
    """Engine tensor path -> (HF tensor name, transpose on load)."""
    out: dict[str, tuple[str, bool]] = {"embed": ("model.embed_tokens.weight", False)}
    for path in config.tensors():
        parts = path.split("/")
        if parts[0] != "layers":
            continue
        hf = f"model.layers.{parts[1]}"
        kind, name = parts[2], parts[-1]
        if kind == "input_norm":
            out[path] = (f"{hf}.input_layernorm.weight", False)
        elif kind == "post_attn_norm":
            out[path] = (f"{hf}.post_attention_layernorm.weight", False)
        elif kind == "mlp":
            out[path] = (f"{hf}.mlp.{name}.weight", True)
        elif name in _ATTN_PROJ:
            out[path] = (f"{hf}.self_attn.{name}.weight", True)
        elif name.endswith("_bias"):
            out[path] = (f"{hf}.self_attn.{name[0]}_proj.bias", False)
        elif name.endswith("_norm"):
            out[path] = (f"{hf}.self_attn.{name}.weight", False)
    out["final_norm"] = ("model.norm.weight", False)
    if not config.tie_word_embeddings:
        out["lm_head"] = ("lm_head.weight", True)
    missing = set(config.tensors()) - set(out)
    if missing:  # a new tensor kind in config.tensors() without a mapping here
        raise ValueError(f"no Hugging Face name known for {sorted(missing)}")
    return out


class SafetensorsFile:
    """One `.safetensors` file: its header, and one tensor at a time as a read-only view."""

    def __init__(self, path: Path):
        self.path = path
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{path}: not a safetensors file (shorter than its header)")
            (header_len,) = struct.unpack("<Q", raw)
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"{path}: unreadable safetensors header ({err})") from None
        header.pop("__metadata__", None)
        self.header: dict[str, dict[str, Any]] = header
        self.data_offset = 8 + header_len

    def names(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def read(self, name: str) -> np.ndarray:
        info = self.header[name]
        code = info["dtype"]
        if code not in READABLE_DTYPES:
            raise ValueError(
                f"{self.path.name}: tensor {name} has dtype {code}, which the loader cannot "
                f"read; readable: {', '.join(READABLE_DTYPES)}"
            )
        dtype = np.dtype(READABLE_DTYPES[code])
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - start != count * dtype.itemsize:
            raise ValueError(
                f"{self.path.name}: tensor {name} spans {end - start} bytes, expected "
                f"{count * dtype.itemsize} for {code} {list(shape)}"
            )
        mapped = np.memmap(
            self.path, dtype=dtype, mode="r", offset=self.data_offset + start, shape=(count,)
        )
        return mapped.reshape(shape)


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """HF tensor name -> the file holding it (sharded via the index, or every file)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.glob("*.bin"))
        hint = f" (found {pickles}; pickle checkpoints are never read)" if pickles else ""
        raise ValueError(f"no *.safetensors files in {folder}{hint}")
    out: dict[str, Path] = {}
    for path in files:
        for name in SafetensorsFile(path).names():
            out[name] = path
    return out


def iter_checkpoint(folder: str | Path, config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(engine path, float array in engine layout) per tensor, one at a time, in order."""
    folder = Path(folder)
    check_supported(config)
    where = checkpoint_files(folder)
    names = hf_names(config)
    expected = config.tensors()
    wanted = {hf for hf, _ in names.values()}
    tied_head = {"lm_head.weight"} if config.tie_word_embeddings else set()
    extra = sorted(
        n for n in where if n not in wanted and n not in tied_head and not _IGNORED.fullmatch(n)
    )
    if extra:
        raise ValueError(
            f"{folder}: tensors the {config.model_type} engine does not use: {extra[:5]} "
            f"({len(extra)} in all); the checkpoint does not match its config.json"
        )
    opened: dict[Path, SafetensorsFile] = {}
    for path, (hf, transpose) in names.items():
        file = where.get(hf)
        if file is None:
            searched = sorted({p.name for p in where.values()})
            raise ValueError(f"tensor {hf} ({path}) is missing; searched {searched} in {folder}")
        if not file.is_file():
            raise ValueError(f"tensor {hf} ({path}): the index names {file.name}, which is missing")
        st = opened.setdefault(file, SafetensorsFile(file))
        if hf not in st.header:
            raise ValueError(f"tensor {hf} ({path}) is missing from {file.name}")
        want = expected[path].shape
        want_hf = tuple(reversed(want)) if transpose else want
        if st.shape(hf) != want_hf:
            raise ValueError(
                f"tensor {hf} ({path}) in {file.name} has shape {list(st.shape(hf))}, "
                f"expected {list(want_hf)} from config.json"
            )
        array = st.read(hf)
        yield path, (array.T if transpose else array)


def load_params(
    folder: str | Path, config: ModelConfig, *, plan=None, dtype=jnp.bfloat16
) -> dict[str, Any]:
    """Params (path -> jax array or QArray) with the plan applied tensor by tensor.

    Tensors the plan quantizes go straight to their `QArray` (via `quantize_tensor`, the
    same function `apply_plan` uses); the rest are cast to `dtype`. Unused rules are not
    reported here; `apply_plan` (which the Engine runs on these params) reports them.
    """
    from tenantq.quant.apply import quantize_tensor

    resolved = plan.resolve(config) if plan is not None else {}
    params: dict[str, Any] = {}
    for path, array in iter_checkpoint(folder, config):
        how = resolved.get(path)
        if how is None:
            params[path] = jnp.asarray(np.asarray(array), dtype=dtype)
        else:
            params[path] = quantize_tensor(np.asarray(array, dtype=np.float32), how)
        del array
    return params
