"""`export_checkpoint`: a model under a plan, written as a compressed-tensors checkpoint.

The quantized params (tenantq's `QArray`s, from `apply_plan` or streamed from the source
folder) are re-laid out, never re-quantized: codes are transposed to Hugging Face's
`[out, in]` and packed as compressed-tensors packs them (int: offset to unsigned, element
i at bit i*num_bits of little-endian int32 words), scales and zero points keep their
float32/int8 values. The folder is written under a temporary name beside `out` and renamed
at the end, so a failure leaves nothing half-written.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from tenantq.export.schemes import (
    COMPRESSED_TENSORS_VERSION,
    LM_HEAD,
    PACK_QUANTIZED,
    NotExportable,
    WeightScheme,
    kv_scheme,
    weight_scheme,
)
from tenantq.model.config import ModelConfig
from tenantq.model.layers import StaticActQArray
from tenantq.numerics import QArray, dequantize, unpack_int4
from tenantq.quant.plan import QuantPlan

log = logging.getLogger(__name__)

PROVENANCE_FILE = "tenantq_export.json"
WEIGHTS_FILE = "model.safetensors"
# Tokenizer files (any one makes the export servable as it stands); when none is copied
# the export warns. Every other top-level file of the source is copied too, except these.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "tiktoken.model",
)


def _not_copied(name: str) -> bool:
    """Source files the export replaces: its weights and their index, config.json, our
    own provenance file."""
    return (
        name.endswith(".safetensors")
        or name.endswith(".safetensors.index.json")
        or name.endswith((".bin", ".pt", ".pth", ".gguf"))  # other weight files
        or name.endswith(".bin.index.json")
        or name in ("config.json", PROVENANCE_FILE)
    )


def copy_side_files(model: Path, dest: Path) -> list[str]:
    """Copy every top-level file of `model` the export does not replace (tokenizer files,
    chat templates, generation config, added tokens, ...) into `dest`; the names copied.
    Warns when none of them is a tokenizer."""
    copied = []
    for path in sorted(model.iterdir()):
        if path.is_file() and not path.name.startswith(".") and not _not_copied(path.name):
            shutil.copy2(path, dest / path.name)
            copied.append(path.name)
    if not any(name in TOKENIZER_FILES for name in copied):
        log.warning(
            "%s has no tokenizer file (%s): the export has none; add one before serving it",
            model, ", ".join(TOKENIZER_FILES),
        )  # fmt: skip
    return copied


@dataclass
class ExportResult:
    """Where the export went and what it holds (for the CLI's --json and MLflow)."""

    out: Path
    quantized: dict[str, str] = field(default_factory=dict)  # HF module -> tenantq format
    dequantized: list[str] = field(default_factory=list)  # opted-in float32 fallbacks
    kv_cache_scheme: dict | None = None
    choices: list[str] = field(default_factory=list)
    nbytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "quantized": self.quantized,
            "dequantized": self.dequantized,
            "kv_cache_scheme": self.kv_cache_scheme,
            "choices": self.choices,
            "nbytes": self.nbytes,
        }


def export_command(model: str | Path, plan: str | Path, out: str | Path) -> str:
    """The shell command that exports `plan` of `model` to `out` (for the report)."""
    import shlex

    return "tenantq export " + " ".join(
        f"--{k} {shlex.quote(str(v))}" for k, v in (("model", model), ("plan", plan), ("out", out))
    )


def pack_int32(codes: np.ndarray, num_bits: int) -> np.ndarray:
    """Signed `num_bits` codes [rows, cols] packed along cols as compressed-tensors packs
    them: each code offset by 2^(bits-1) to unsigned, element i at bit i*num_bits of
    little-endian int32 words, ceil(cols * bits / 32) words a row (4 or 8 bits only)."""
    if num_bits not in (4, 8):
        raise ValueError(f"pack_int32 packs 4- or 8-bit codes, not {num_bits}")
    rows, cols = codes.shape
    per_word = 32 // num_bits
    padded = -(-cols // per_word) * per_word
    unsigned = np.zeros((rows, padded), np.uint8)
    unsigned[:, :cols] = (codes.astype(np.int16) + (1 << (num_bits - 1))).astype(np.uint8)
    if num_bits == 4:
        unsigned = unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)
    return np.ascontiguousarray(unsigned).view("<i4").astype(np.int32)


def _codes(q: QArray) -> np.ndarray:
    if q.fmt == "int4":
        return np.asarray(unpack_int4(q.data, q.shape[-1]), np.int8)
    return np.asarray(q.data)


def module_tensors(q: QArray, scheme: WeightScheme, transpose: bool) -> dict[str, np.ndarray]:
    """A quantized weight's compressed-tensors entries (names local to its module)."""
    codes = _codes(q)
    scale = np.asarray(q.scale, np.float32)
    zero_point = None if q.zero_point is None else np.asarray(q.zero_point, np.int8)
    if transpose:  # tenantq [in, out], scales [groups, out] -> HF [out, in], [out, groups]
        codes, scale = codes.T, scale.T
        zero_point = None if zero_point is None else zero_point.T
    out: dict[str, np.ndarray] = {"weight_scale": np.ascontiguousarray(scale)}
    if scheme.compressor != PACK_QUANTIZED:  # int-/float-/naive-quantized: plain codes
        dtype = ml_dtypes.float8_e4m3fn if scheme.type == "float" else np.int8
        out["weight"] = np.ascontiguousarray(codes).astype(dtype)
    else:
        out["weight_packed"] = pack_int32(np.ascontiguousarray(codes), scheme.num_bits)
        out["weight_shape"] = np.asarray(codes.shape, np.int64)
        if zero_point is not None:  # packed along the output dimension (dim 0)
            out["weight_zero_point"] = np.ascontiguousarray(
                pack_int32(np.ascontiguousarray(zero_point.T), scheme.num_bits).T
            )
    if isinstance(q, StaticActQArray) and q.act_scale is not None:
        out["input_scale"] = np.asarray(q.act_scale, np.float32).reshape(1)
    return out


def _dense(value: Any, transpose: bool) -> np.ndarray:
    array = np.asarray(value)
    return np.ascontiguousarray(array.T if transpose else array)


def check_out(out: Path, overwrite: bool, model: Path | None = None) -> None:
    """One line when `out` cannot be written: it exists (without `overwrite`), is a file,
    has no parent, is the source model, a folder above it or inside it, or (with
    `overwrite`) is a folder that is not a tenantq export."""
    out = Path(out)
    if model is not None:
        src, dst = Path(model).resolve(), out.resolve()
        if dst == src or dst in src.parents or src in dst.parents:
            relation = "is" if dst == src else "contains" if dst in src.parents else "is inside"
            raise ValueError(
                f"--out {out} {relation} the source --model {model}; write the export to a "
                "folder outside it"
            )
    if out.exists() and not overwrite:
        raise ValueError(f"--out {out} already exists; choose a new folder (or --overwrite)")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; --out must name a folder")
    if out.exists() and not (out / PROVENANCE_FILE).is_file():
        raise ValueError(
            f"--out {out} has no {PROVENANCE_FILE}: --overwrite replaces only a folder "
            "tenantq export wrote; choose a new folder"
        )
    if not out.parent.is_dir():
        raise ValueError(f"--out {out}: its parent folder {out.parent} does not exist")


def _stream_params(model: Path, config: ModelConfig, plan: QuantPlan) -> Iterable[tuple]:
    """(path, QArray or source array in engine layout): rtn plans only."""
    from tenantq.model.loader import iter_checkpoint
    from tenantq.quant.apply import quantize_tensor

    resolved = plan.resolve(config)
    for how in resolved.values():
        if how.algorithm != "rtn" or how.activation_scale == "static":
            what = how.algorithm if how.algorithm != "rtn" else "static activation scales"
            raise ValueError(
                f"{how.path}: {what} needs calibration statistics; export from Python with "
                "tenantq.export.export_checkpoint(..., params=apply_plan(...)) (the CLI "
                "exports round-to-nearest plans)"
            )
    for path, array in iter_checkpoint(model, config):
        how = resolved.get(path)
        yield path, (array if how is None else quantize_tensor(np.asarray(array, np.float32), how))


def decide(
    plan: QuantPlan,
    config: ModelConfig,
    *,
    dequantize_unsupported=False,
    kv_bf16=False,
    quantize_lm_head=False,
):
    """(scheme per exported tensor, refused tensor -> why, kv_cache_scheme, choices made).

    Without the opt-ins, every part the format cannot express is named in one ValueError
    line (`NotExportable`); with them, each fallback is logged and listed in `choices`.
    """
    tensors = config.tensors()
    schemes: dict[str, WeightScheme] = {}
    refused: dict[str, str] = {}
    for path, how in plan.resolve(config).items():
        try:
            schemes[path] = weight_scheme(how, tensors[path], quantize_lm_head=quantize_lm_head)
        except NotExportable as err:
            refused[path] = str(err)
    problems, choices = [], []
    if quantize_lm_head and LM_HEAD in schemes:
        choices.append(
            f"lm_head quantized ({schemes[LM_HEAD].compressor}) by --quantize-lm-head: "
            "transformers reads it, vLLM cannot load a quantized lm_head"
        )
    if refused and not dequantize_unsupported:
        more = f" (and {len(refused) - 1} more tensors)" if len(refused) > 1 else ""
        problems.append(f"{next(iter(refused.values()))}{more} [--dequantize-unsupported]")
    for path, why in refused.items() if dequantize_unsupported else ():
        choices.append(f"{path} written as dequantized float32 ({why})")
    kv = None
    try:
        kv = kv_scheme(plan, config)
    except NotExportable as err:
        if not kv_bf16:
            problems.append(f"{err} [--kv-bf16]")
        else:
            choices.append(f"KV part dropped, the cache stays unquantized ({err})")
    if problems:
        raise NotExportable("; ".join(problems))
    for choice in choices:
        log.warning("%s", choice)
    for note in unfused_schemes(schemes, config):
        log.warning("%s", note)
    return schemes, refused, kv, choices


# vLLM loads these projections as one fused layer each and needs one scheme per fused layer.
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def unfused_schemes(schemes: Mapping[str, WeightScheme], config: ModelConfig) -> list[str]:
    """One warning per layer whose fused projections (q/k/v, gate/up) differ in scheme:
    transformers and tenantq read such an export, vLLM may refuse it."""
    notes = []
    for layer in range(config.num_layers):
        for names in FUSED:
            kind = "attn" if names[0] == "q_proj" else "mlp"
            paths = [f"layers/{layer}/{kind}/{n}" for n in names]
            if len({schemes.get(p) for p in paths}) > 1:
                notes.append(
                    f"layers/{layer}: {'/'.join(names)} differ in format; vLLM fuses them "
                    "into one layer and may refuse the export (give them one rule)"
                )
    return notes


def export_checkpoint(
    model: str | Path,
    plan: QuantPlan,
    out: str | Path,
    *,
    params: Mapping[str, Any] | None = None,
    kv_scales: Any = None,
    dequantize_unsupported: bool = False,
    kv_bf16: bool = False,
    quantize_lm_head: bool = False,
    overwrite: bool = False,
    model_identity: str | None = None,
) -> ExportResult:
    """Write `model` (a HF folder) under `plan` to `out` as a compressed-tensors checkpoint.

    `params`: the quantized params to write (`apply_plan`'s output, e.g. after GPTQ/AWQ or
    with static activation scales); None streams the folder's tensors through `plan` (rtn).
    `kv_scales`: the calibrated static KV scales (`KVScales`) a static fp8 KV part needs.
    A plan part the format cannot express raises one ValueError line naming it, unless
    the caller opts in: `dequantize_unsupported` writes such weights as their dequantized
    float32 values, `kv_bf16` drops a KV part the format cannot hold, `quantize_lm_head`
    writes a quantized lm_head (which vLLM cannot load); each choice is logged and
    recorded in `tenantq_export.json`.
    """
    from tenantq.model.loader import hf_names

    model, out = Path(model), Path(out)
    config = ModelConfig.from_file(model)
    check_out(Path(out), overwrite, model)
    result = ExportResult(out)
    schemes, refused, result.kv_cache_scheme, result.choices = decide(
        plan, config, dequantize_unsupported=dequantize_unsupported, kv_bf16=kv_bf16,
        quantize_lm_head=quantize_lm_head,
    )  # fmt: skip
    result.dequantized = sorted(refused)
    resolved = plan.resolve(config)
    tensors = config.tensors()
    if result.kv_cache_scheme is not None and kv_scales is None:
        raise ValueError(
            f"kv: {plan.kv.key_format} with {plan.kv.key_axis} scales needs calibrated static "
            "scales; pass kv_scales=tenantq.quant.kv_calibration.kv_static_scales(...) "
            "(tenantq export calibrates them)"
        )

    names = hf_names(config)
    stream = params.items() if params is not None else _stream_params(model, config, plan)
    state: dict[str, np.ndarray] = {}
    groups: dict[WeightScheme, list[str]] = {}
    for path, value in stream:
        hf, transpose = names[path]
        module = hf.removesuffix(".weight")
        if path in schemes:
            if not isinstance(value, QArray) or value.fmt != resolved[path].format:
                got = getattr(value, "fmt", "full precision")
                raise ValueError(
                    f"params[{path!r}] is {got}; the plan wants {resolved[path].format}"
                )
            for name, array in module_tensors(value, schemes[path], transpose).items():
                state[f"{module}.{name}"] = array
            groups.setdefault(schemes[path], []).append(module)
            result.quantized[module] = value.fmt
        elif isinstance(value, QArray):
            if path not in refused:
                raise ValueError(f"params[{path!r}] is quantized ({value.fmt}) but the plan is not")
            state[hf] = _dense(np.asarray(dequantize(value), np.float32), transpose)
        else:
            state[hf] = _dense(value, transpose)
    missing = [p for p in tensors if names[p][0] not in state and p not in schemes]
    if missing:
        raise ValueError(f"params lack tensors of the model: {missing[:5]}")
    if result.kv_cache_scheme is not None:
        state.update(_kv_scale_tensors(plan, config, kv_scales))

    # Every Linear left unquantized is named in `ignore`, as llm-compressor writes it.
    ignore = [
        names[p][0].removesuffix(".weight")
        for p, info in tensors.items()
        if info.kind == "linear" and p not in schemes
    ]
    quantization_config = _quantization_config(groups, result.kv_cache_scheme, ignore)
    _write_folder(model, out, state, quantization_config, plan, result, model_identity)
    return result


def _kv_scale_tensors(plan: QuantPlan, config: ModelConfig, kv_scales) -> dict[str, np.ndarray]:
    """`k_scale`/`v_scale` of every attention module: (1,) per tensor, [heads, 1, 1] per head."""
    out = {}
    for layer, kv in enumerate(plan.kv_layers(config)):
        for tensor, spec, name in (("keys", kv.keys, "k_scale"), ("values", kv.values, "v_scale")):
            scale, _ = kv_scales.for_tensor(layer, tensor, spec)
            scale = np.asarray(scale, np.float32)
            shape = (1,) if spec.axis == "tensor" else (config.num_kv_heads, 1, 1)
            out[f"model.layers.{layer}.self_attn.{name}"] = scale.reshape(shape)
    return out


def _quantization_config(
    groups: Mapping[WeightScheme, list[str]], kv: dict | None, ignore: list[str]
) -> dict:
    config_groups = {
        f"group_{i}": {
            "targets": modules,
            "weights": scheme.weights_args(),
            "input_activations": scheme.input_args(),
            "output_activations": None,
            "format": scheme.compressor,
        }
        for i, (scheme, modules) in enumerate(groups.items())
    }
    formats = {scheme.compressor for scheme in groups}
    # The library's summary: dense without quantized weights, the one format, or mixed.
    summary = "dense" if not formats else formats.pop() if len(formats) == 1 else "mixed-precision"
    return {
        "quant_method": "compressed-tensors",
        "format": summary,
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "kv_cache_scheme": kv,
        "ignore": ignore,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }


def _readable(folder: Path) -> None:
    """mkdtemp and safetensors create 0700/0600; the export gets the modes a plain mkdir and
    open would (the umask's), so a server running as another user can read it."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _write_folder(
    model: Path,
    out: Path,
    state: dict[str, np.ndarray],
    quantization_config: dict,
    plan: QuantPlan,
    result: ExportResult,
    model_identity: str | None,
) -> None:
    from safetensors.numpy import save_file

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        raw_config = json.loads((model / "config.json").read_text())
        raw_config["quantization_config"] = quantization_config
        (tmp / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
        copy_side_files(model, tmp)
        metadata = {"format": "pt", "tenantq_plan_fingerprint": plan.fingerprint()}
        save_file(state, str(tmp / WEIGHTS_FILE), metadata=metadata)
        provenance = {
            "plan": plan.to_dict(),
            "plan_fingerprint": plan.fingerprint(),
            "source_model": str(model.resolve()),
            "source_model_identity": model_identity,
            "compressed_tensors_version": COMPRESSED_TENSORS_VERSION,
            "choices": result.choices,
            "dequantized": result.dequantized,
        }
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        result.nbytes = sum(p.stat().st_size for p in tmp.iterdir())
        _readable(tmp)
        if out.exists():  # --overwrite: the old folder goes only once the new one is whole
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            try:
                os.rename(out, old)  # onto the fresh empty folder (POSIX renames over one)
            except BaseException:
                old.rmdir()
                raise
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old, out)  # the earlier export goes back where it was
                raise
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_plans(
    model: str | Path, plans: Mapping[str, QuantPlan], out_root: str | Path, **options: Any
) -> dict[str, ExportResult | str]:
    """Each named plan (a study's front) exported to `out_root/NAME`; a plan the format
    cannot express gets its one-line refusal instead, and the others still go out.
    `options` are `export_checkpoint`'s (opt-ins, overwrite)."""
    out_root = Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    results: dict[str, ExportResult | str] = {}
    for name, plan in plans.items():
        try:
            results[name] = export_checkpoint(model, plan, out_root / name, **options)
        except NotExportable as err:
            results[name] = str(err)
    return results
