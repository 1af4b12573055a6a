"""Tiny models and a tiny tokenizer that every test (and the benches' smoke runs) share.

Shapes are small enough to compile in about a second. `tiny_config` is the engine's
2-layer Llama; `odd_config` has odd sizes on purpose (packing pads a nibble, groups and
MX/nvfp4 blocks run partial) for byte-count tests; `tiny_tokenizer` is a character-level
tokenizer whose ids fit `tiny_config`'s vocabulary; `tiny_checkpoint` writes a model as a
Hugging Face folder (the one checkpoint writer of the tests). After gemma's `gm/testing`.
"""

from __future__ import annotations

from typing import Any

from tenantq.model.config import ModelConfig

# Special ids of `tiny_tokenizer`, matching `tiny_config`'s eos.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_CHARACTERS = " abcdefghijklmnopqrstuvwxyz0123456789.,:;!?'\"()[]{}-+*/=<>_#\n"


def tiny_config(**overrides: Any) -> ModelConfig:
    """2 layers, width 32, 4 query heads sharing 2 KV heads of 8, vocabulary 64, context 128."""
    fields: dict[str, Any] = dict(
        model_type="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        bos_token_id=BOS_ID,
        eos_token_ids=(EOS_ID,),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def odd_config(**overrides: Any) -> ModelConfig:
    """A 2-layer Llama-shaped config with odd sizes (vocab 11, width 8, MLP 13, head_dim 4)."""
    odd = dict(vocab_size=11, hidden_size=8, intermediate_size=13, num_heads=2, num_kv_heads=1,
               head_dim=4, max_position_embeddings=256)  # fmt: skip
    return tiny_config(**{**odd, **overrides})


def tiny_params(config: ModelConfig | None = None, seed: int = 0) -> dict[str, Any]:
    """Random float32 params of `config` (default `tiny_config()`), keyed by tensor path."""
    from tenantq.model.decoder import init_params

    return init_params(config or tiny_config(), seed=seed)


def hf_tensors(config: ModelConfig, params: Any, dtype: Any = "bfloat16") -> dict[str, Any]:
    """`params` (engine layout, [in, out]) under their Hugging Face names and layout
    ([out, in]), as `dtype` numpy arrays: what a checkpoint's safetensors hold."""
    import ml_dtypes
    import numpy as np

    from tenantq.model.loader import hf_names

    cast = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    out = {}
    for path, (name, transpose) in hf_names(config).items():
        value = np.asarray(params[path], np.float32)
        out[name] = np.ascontiguousarray(value.T if transpose else value).astype(cast)
    return out


def tiny_checkpoint(
    folder: Any,
    config: ModelConfig | None = None,
    params: Any = None,
    *,
    tensors: dict[str, Any] | None = None,
    dtype: Any = "bfloat16",
    shards: int = 1,
    config_overrides: dict[str, Any] | None = None,
    metadata: dict[str, str] | None = None,
) -> Any:
    """A Hugging Face folder (config.json and safetensors, no tokenizer) of `params`
    (default: `tiny_params(config)`) in `dtype`, or of `tensors` (HF names) as they are; split
    over `shards` files (`model-0000k.safetensors`, no index) when shards > 1. The one
    checkpoint writer the tests share. Returns the folder."""
    import json
    from pathlib import Path

    from safetensors.numpy import save_file

    config = config or tiny_config()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if tensors is None:
        tensors = hf_tensors(config, tiny_params(config) if params is None else params, dtype)
    raw = {**config.to_hf_dict(), **(config_overrides or {})}
    (folder / "config.json").write_text(json.dumps(raw))
    names = sorted(tensors)
    for k in range(shards):
        file = "model.safetensors" if shards == 1 else f"model-{k:05d}.safetensors"
        save_file({n: tensors[n] for n in names[k::shards]}, str(folder / file), metadata)
    return folder


def tiny_tokenizer():
    """A character-level `Tokenizer`: ids 0-2 are <pad>, <s>, </s>; then one id per
    character of lowercase text: 64 ids, exactly `tiny_config`'s vocabulary."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from tenantq.model.tokenizer import Tokenizer

    vocab = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID}
    vocab.update({c: i + 3 for i, c in enumerate(_CHARACTERS)})
    inner = HFTokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    inner.decoder = decoders.Fuse()
    inner.add_special_tokens(["<pad>", "<s>", "</s>"])
    return Tokenizer(inner, source="tenantq.testing.tiny_tokenizer")


# The smallest quality suite that still runs a trial's whole path: fidelity on 2 windows of
# 64 tokens and one gate (seconds per trial). The `ray job submit` test and the search
# bench's smoke run write it beside their spec.
TINY_SUITE = """seed = 0
split = "search"
resamples = 200
[fidelity]
rows = 2
row_tokens = 64
[[gates]]
metric = "fidelity.kl_mean"
tolerance = 0.05
higher_is_better = false
"""


def tiny_study_spec(
    state: Any,
    *,
    name: str,
    trials: int,
    suite: Any,
    objectives: tuple[str, ...] = ("tenants", "fidelity.kl_mean"),
    confirm_suite: Any = None,
    algorithm: str = "rtn",
    sampler: str = "nsga2",
    seed: int = 1,
    workers: int = 2,
    key_formats: tuple[str, ...] = ("bf16", "fp8_e4m3", "int8"),
    bf16_first_layers: tuple[int, ...] = (0, 1),
    calibration_windows: tuple[int, int] | None = None,
) -> str:
    """TOML text of a small study on the shipped reference model, its stores under `state`.

    The quickstart's deployment (9830 KiB, 256-token tenants: weights and KV formats both
    move the tenant count) with a 3 x 3 x 2 structured space; the tests that run a real
    study (search e2e, report, `ray job submit`) and the search bench's smoke run share it.
    Objectives are maximized when they are `tenants` or a needle delta, minimized otherwise.
    """

    def toml_list(values) -> str:
        return "[" + ", ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in values) + "]"

    lines = [
        'model = "reference"',
        "[deployment]",
        'hardware = "cpu"',
        'memory = "9830KiB"',
        "context_tokens = 256",
        "[space]",
        'weight_formats = ["bf16", "fp8_e4m3", "int4"]',
        "group_size = 64",
        f"key_formats = {toml_list(key_formats)}",
        'value_formats = ["bf16", "fp8_e4m3"]',
        f"bf16_first_layers = {toml_list(bf16_first_layers)}",
        "bf16_last_layers = [0]",
    ]
    for metric in objectives:
        up = metric == "tenants" or ".acc_delta." in metric
        direction = "maximize" if up else "minimize"
        lines += ["[[objectives]]", f'metric = "{metric}"', f'direction = "{direction}"']
    lines += ["[eval]", f'suite = "{suite}"', f'cache_dir = "{state}/cache"']
    if confirm_suite is not None:
        lines.append(f'confirm_suite = "{confirm_suite}"')
    lines += ["[calibration]", f'algorithm = "{algorithm}"']
    if calibration_windows is not None:  # (sequences, tokens each)
        lines += [f"sequences = {calibration_windows[0]}"]
        lines += [f"sequence_tokens = {calibration_windows[1]}"]
    lines += ["[sampler]", f'kind = "{sampler}"', f"seed = {seed}"]
    if sampler == "nsga2":
        lines.append("population_size = 4")
    lines += ["[study]", f'name = "{name}"', f"trials = {trials}"]
    lines.append(f'storage = "sqlite:///{state}/optuna.db"')
    lines += ["[workers]", f"count = {workers}", "cpus_per_worker = 1"]
    lines += ["[tracking]", f'uri = "sqlite:///{state}/mlflow.db"', f'experiment = "{name}"']
    return "\n".join(lines) + "\n"
