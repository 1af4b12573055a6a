"""Helpers shared by the export tests: a tiny HF folder, and compressed-tensors' own reading.

`library_weights` decompresses every quantized module of an export with compressed-tensors'
compressors (the classes vLLM's loader and transformers use), driven by the export's own
config.json validated as a `QuantizationConfig`: no tenantq code touches the bytes on the
way back.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tenantq.model.loader import hf_names
from tenantq.numerics import dequantize
from tenantq.testing import tiny_checkpoint


def write_folder(folder: Path, config, params) -> Path:
    """`params` (float32, engine layout) saved as a bf16 HF checkpoint folder (no tokenizer)."""
    tiny_checkpoint(
        folder, config, params, metadata={"format": "pt"},
        config_overrides={"architectures": ["LlamaForCausalLM"]},
    )  # fmt: skip
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False}) + "\n")
    return folder


def library_weights(folder: Path) -> dict[str, np.ndarray]:
    """HF module name -> float32 weight [out, in] as compressed-tensors decompresses it."""
    import torch
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name
    from safetensors.torch import load_file

    raw = json.loads((folder / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(raw)  # the library's own schema check
    state = load_file(str(folder / "model.safetensors"))
    modules = sorted({k.rsplit(".", 1)[0] for k in state if k.endswith(".weight_scale")})
    out = {}
    for module in modules:
        matched = [
            s
            for s in config.config_groups.values()
            if any(match_name(module, t) or t == "Linear" for t in s.targets)  # all *_proj
        ]
        assert len(matched) == 1, f"{module} matches {len(matched)} config groups"
        scheme = matched[0]
        compressor = BaseCompressor.get_value_from_registry(scheme.format)
        local = {k[len(module) + 1 :]: v for k, v in state.items() if k.startswith(module + ".")}
        with torch.no_grad():
            weight = compressor.decompress(local, scheme)["weight"]
        assert weight.dtype == torch.float32, f"{module}: decompressed as {weight.dtype}"
        out[module] = weight.numpy()
    return out


def tenantq_weights(params, config) -> dict[str, np.ndarray]:
    """HF module name -> float32 [out, in] weight tenantq's codec dequantizes, per QArray."""
    from tenantq.numerics import QArray

    out = {}
    for path, (hf, transpose) in hf_names(config).items():
        value = params.get(path)
        if isinstance(value, QArray):
            w = np.asarray(dequantize(value), np.float32)
            out[hf.removesuffix(".weight")] = w.T if transpose else w
    return out


def assert_bit_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        a, b = np.ascontiguousarray(got[name]), np.ascontiguousarray(want[name])
        assert a.shape == b.shape, f"{name}: {a.shape} vs {b.shape}"
        differ = int(np.count_nonzero(a.view(np.uint32) != b.view(np.uint32)))
        assert differ == 0, f"{name}: {differ} of {a.size} float32 values differ in their bits"


def library_folder(
    source: Path,
    out: Path,
    weights: dict,
    acts: dict | None = None,
    *,
    fmt: str,
    extra: dict | None = None,
    g_idx: bool = False,
) -> Path:
    """A compressed-tensors folder of the HF folder `source` written by the library alone
    (its qparams, its compressor for `fmt`, its config schema): every `*_proj` Linear under
    one scheme, float32 scales, lm_head in `ignore`. `extra` is merged into the config;
    `g_idx` adds an activation-order permutation tensor per module."""
    import shutil

    import torch
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file
    from safetensors.torch import save_file as save_torch

    out.mkdir(parents=True)
    for f in source.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**weights),
        input_activations=None if acts is None else QuantizationArgs(**acts),
        format=fmt,
    )
    compressor = BaseCompressor.get_value_from_registry(fmt)
    state = {}
    for name, w in load_file(str(source / "model.safetensors")).items():
        w = w.float()
        if not name.endswith("proj.weight"):
            state[name] = w.to(torch.bfloat16)
            continue
        module, args = name.removesuffix(".weight"), scheme.weights
        grouped = w.reshape(w.shape[0], -1, args.group_size) if args.strategy == "group" else w
        low, high = (
            grouped.amin(-1, keepdim=args.strategy != "group"),
            grouped.amax(-1, keepdim=args.strategy != "group"),
        )
        scale, zero_point = calculate_qparams(low, high, args)
        local = {"weight": w, "weight_scale": scale.float(), "weight_zero_point": zero_point}
        for key, value in compressor.compress(local, scheme).items():
            state[f"{module}.{key}"] = value
        if g_idx:
            order = torch.arange(w.shape[1], dtype=torch.int32).flip(0)
            state[f"{module}.weight_g_idx"] = order // args.group_size
    save_torch({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    config = QuantizationConfig(
        config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
        ignore=["lm_head"],
    )  # fmt: skip
    qc = {**config.model_dump(), "quant_method": "compressed-tensors", **(extra or {})}
    raw = json.loads((source / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "quantization_config": qc}, indent=1))
    return out
