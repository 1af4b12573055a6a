"""Model configuration read from a Hugging Face `config.json`, and the tensor inventory.

`ModelConfig` is the one description of a decoder's shapes that the engine (to build and
load), the quantization plan (to match tensor paths) and the capacity planner (to count
bytes) all share, so the three can never disagree about what a model holds. Pure Python:
no JAX here, the capacity planner imports it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Architectures the engine can run. Others (gemma3) are known to the capacity planner only.
ENGINE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
KNOWN_MODEL_TYPES = (*ENGINE_MODEL_TYPES, "gemma3", "gemma3_text")

ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the model as the engine stores it.

    Linear weights are stored `[in, out]` (x @ W) and quantized along axis 0, the input
    dimension; the embedding is `[vocab, hidden]` and quantized along axis 1 so that a row
    gather dequantizes one token. Norms and biases are never quantized.
    """

    path: str
    shape: tuple[int, ...]
    kind: str  # "linear" | "embedding" | "norm" | "bias"
    quant_axis: int | None  # axis the scales reduce over; None for never-quantized tensors

    @property
    def quantizable(self) -> bool:
        return self.kind in ("linear", "embedding")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of a Llama-family decoder."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling_items: tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    # Per layer: "full" or "sliding"; a sliding layer keeps at most `sliding_window` tokens.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())
    name: str = ""

    def __post_init__(self) -> None:
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, key)
            if not _is_int(value) or value <= 0:
                raise ValueError(
                    f"model config: {HF_KEYS.get(key, key)} must be an integer >= 1, got {value!r}"
                )
        if not _is_number(self.rope_theta) or not self.rope_theta > 0:
            raise ValueError(
                f"model config: rope_theta must be a finite number > 0 (e.g. 10000.0), "
                f"got {self.rope_theta!r}"
            )
        if not _is_number(self.rms_norm_eps) or not self.rms_norm_eps >= 0:
            raise ValueError(
                f"model config: rms_norm_eps must be a finite number >= 0 (e.g. 1e-5), "
                f"got {self.rms_norm_eps!r}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        for key, ids in (
            ("bos_token_id", (self.bos_token_id,)),
            ("eos_token_id", self.eos_token_ids),
        ):
            bad = [
                i for i in ids if i is not None and not (_is_int(i) and 0 <= i < self.vocab_size)
            ]
            if bad:
                raise ValueError(
                    f"model config: {key} {bad[0]!r} is not a token id; valid ids are integers "
                    f"0..{self.vocab_size - 1} (vocab_size {self.vocab_size})"
                )
        if self.rope_scaling_items is not None:
            _check_rope_scaling(self.rope_scaling)
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full",) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"model config: layer_types has {len(self.layer_types)} entries, "
                f"expected num_hidden_layers={self.num_layers}"
            )
        bad = sorted(set(self.layer_types) - {"full", "sliding"})
        if bad:
            raise ValueError(f"model config: unknown layer types {bad}; valid: full, sliding")
        if "sliding" in self.layer_types and not (
            _is_int(self.sliding_window) and self.sliding_window > 0
        ):
            raise ValueError(
                f"model config: sliding layers need sliding_window, an integer >= 1 "
                f"(tokens), got {self.sliding_window!r}"
            )

    # ---------------------------------------------------------------- derived figures
    @property
    def rope_scaling(self) -> dict[str, Any] | None:
        return None if self.rope_scaling_items is None else dict(self.rope_scaling_items)

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def check_tensor_parallel(self, tp: int, *, valid_name: str = "tp values") -> None:
        """Devices must split heads, KV heads and MLP units evenly (KV heads are never copied).

        Shared by the engine's mesh and the capacity planner so both accept the same degrees.
        """
        dims = {
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
        }
        bad = [f"{k}={v}" for k, v in dims.items() if v % tp]
        if bad:
            valid = [
                n for n in range(1, self.num_kv_heads + 1) if all(v % n == 0 for v in dims.values())
            ]
            raise ValueError(
                f"tensor-parallel degree {tp} does not divide {', '.join(bad)}; it must divide "
                f"the heads, KV heads and MLP units: valid {valid_name} are "
                f"{', '.join(map(str, valid))}"
            )

    def layer_kv_tokens(self, layer: int, context_tokens: int) -> int:
        """Tokens of KV a sequence of `context_tokens` keeps in `layer` (windowed layers cap)."""
        if self.layer_types[layer] == "sliding":
            return min(context_tokens, int(self.sliding_window or context_tokens))
        return context_tokens

    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor the engine holds, by path, in a stable order."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        out: dict[str, TensorInfo] = {}

        def add(path: str, shape: tuple[int, ...], kind: str, axis: int | None) -> None:
            out[path] = TensorInfo(path, shape, kind, axis)

        add("embed", (v, h), "embedding", 1)
        for layer in range(self.num_layers):
            p = f"layers/{layer}"
            add(f"{p}/input_norm", (h,), "norm", None)
            add(f"{p}/attn/q_proj", (h, q_out), "linear", 0)
            add(f"{p}/attn/k_proj", (h, kv_out), "linear", 0)
            add(f"{p}/attn/v_proj", (h, kv_out), "linear", 0)
            add(f"{p}/attn/o_proj", (q_out, h), "linear", 0)
            if self.attention_bias:
                add(f"{p}/attn/q_bias", (q_out,), "bias", None)
                add(f"{p}/attn/k_bias", (kv_out,), "bias", None)
                add(f"{p}/attn/v_bias", (kv_out,), "bias", None)
                if self.model_type != "qwen2":
                    # Llama/Mistral/Qwen3 `attention_bias` also biases o_proj; Qwen2 does not.
                    add(f"{p}/attn/o_bias", (h,), "bias", None)
            if self.qk_norm:
                add(f"{p}/attn/q_norm", (self.head_dim,), "norm", None)
                add(f"{p}/attn/k_norm", (self.head_dim,), "norm", None)
            add(f"{p}/post_attn_norm", (h,), "norm", None)
            if self.model_type.startswith("gemma3"):
                # Gemma 3 wraps both blocks in pre- and post-norms (4 norms per layer).
                add(f"{p}/pre_mlp_norm", (h,), "norm", None)
                add(f"{p}/post_mlp_norm", (h,), "norm", None)
            add(f"{p}/mlp/gate_proj", (h, i), "linear", 0)
            add(f"{p}/mlp/up_proj", (h, i), "linear", 0)
            add(f"{p}/mlp/down_proj", (i, h), "linear", 0)
        add("final_norm", (h,), "norm", None)
        if not self.tie_word_embeddings:
            add("lm_head", (h, v), "linear", 0)
        return out

    def param_count(self) -> int:
        return sum(t.numel for t in self.tensors().values())

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` body that `from_hf_dict` reads back to an equal config."""
        d: dict[str, Any] = {
            "model_type": self.model_type,
            "architectures": [_ARCH_NAMES.get(self.model_type, "LlamaForCausalLM")],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": self.hidden_act,
            "torch_dtype": "bfloat16",
        }
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = (
                self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
            )
        if self.sliding_window:
            d["sliding_window"] = self.sliding_window
            d["layer_types"] = [
                "sliding_attention" if t == "sliding" else "full_attention"
                for t in self.layer_types
            ]
        return d

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Read a Hugging Face config dict; a missing or out-of-range field is an error
        naming it and its valid range. What differs by model_type is its `Architecture`."""
        raw = _decoder_fields(raw, source)
        model_type = raw.get("model_type")
        if model_type not in KNOWN_MODEL_TYPES:
            raise ValueError(
                f"{source}: unsupported model_type {model_type!r}; "
                f"supported: {', '.join(KNOWN_MODEL_TYPES)}"
            )
        arch = ARCHITECTURES[model_type]
        hf = _HFFields(raw, source, model_type)
        num_heads = hf.integer("num_attention_heads", hf.need("num_attention_heads"))
        hidden = hf.integer("hidden_size", hf.need("hidden_size"))
        num_layers = hf.integer("num_hidden_layers", hf.need("num_hidden_layers"))
        if num_heads <= 0:
            raise ValueError(
                f"{source}: num_attention_heads must be an integer >= 1, got {num_heads}"
            )
        head_dim = raw.get("head_dim")  # an explicit 0 is refused below, not replaced
        if head_dim is None:
            if hidden % num_heads:
                raise ValueError(
                    f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads "
                    f"{num_heads} and there is no head_dim; give head_dim, or a hidden_size "
                    "that num_attention_heads divides"
                )
            head_dim = hidden // num_heads
        rope_theta, rope_scaling = _rope_fields(raw, source)
        if rope_scaling is not None and arch.rope_scaling_types is not None:
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if rtype not in arch.rope_scaling_types:
                raise ValueError(
                    f"{source}: rope_scaling type {rtype!r} is not supported; "
                    "supported: llama3 (or none)"
                )
        sliding_window = raw.get("sliding_window")
        layer_types = _layer_types(raw, arch, num_layers, sliding_window)
        eos = raw.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        attention_bias = hf.flag("attention_bias", arch.attention_bias)
        hidden_act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
        if not isinstance(hidden_act, str):
            raise ValueError(f"{source}: hidden_act must be a string such as 'silu'")
        kv_heads = raw.get("num_key_value_heads")  # absent or null: one per query head
        try:
            return cls(
                model_type=model_type,
                vocab_size=hf.integer("vocab_size", hf.need("vocab_size")),
                hidden_size=hidden,
                intermediate_size=hf.integer("intermediate_size", hf.need("intermediate_size")),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=hf.integer(
                    "num_key_value_heads", num_heads if kv_heads is None else kv_heads
                ),
                head_dim=hf.integer("head_dim", head_dim),
                max_position_embeddings=hf.integer(
                    "max_position_embeddings", hf.need("max_position_embeddings")
                ),
                rope_theta=rope_theta,
                rope_scaling_items=None
                if rope_scaling is None
                else tuple(sorted((k, _freeze(v)) for k, v in rope_scaling.items())),
                rms_norm_eps=hf.number("rms_norm_eps", 1e-6),
                tie_word_embeddings=hf.flag("tie_word_embeddings", arch.tie_word_embeddings),
                attention_bias=attention_bias,
                qk_norm=arch.qk_norm,
                layer_types=layer_types,
                sliding_window=hf.integer("sliding_window", sliding_window)
                if "sliding" in layer_types
                else None,
                hidden_act=hidden_act,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                name=str(raw.get("_name_or_path", "")),
            )
        except ValueError as err:  # field checks in __post_init__: say which file
            message = str(err)
            if message.startswith("model config:"):
                message = f"{source}:" + message[len("model config:") :]
            raise ValueError(message) from None

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` (or the folder holding it)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ValueError(f"no config.json at {p}: expected a Hugging Face checkpoint folder")
        try:
            raw = json.loads(p.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{p}: not valid JSON ({err})") from err
        return cls.from_hf_dict(raw, source=str(p))


# ---------------------------------------------------------------- a folder's quantization
# Read here, beside the rest of config.json, so the plain loader can refuse a compressed
# folder without importing the compressed-tensors reader (which builds on the loader).
def quantization_config(folder: str | Path) -> dict | None:
    """config.json's `quantization_config` when it is a compressed-tensors one, else None."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # ModelConfig.from_file names the fault
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    if isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors":
        return qc
    return None


def is_compressed_tensors(folder: str | Path) -> bool:
    return quantization_config(folder) is not None


_ARCH_NAMES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
}


# ModelConfig field -> the config.json key a user edits, for error messages.
HF_KEYS = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _check_rope_scaling(scaling: dict[str, Any]) -> None:
    """llama3 scaling needs its four numbers in range (Meta's `apply_scaling` divides by
    high_freq_factor - low_freq_factor and by factor)."""
    rtype = scaling.get("rope_type", scaling.get("type", "default"))
    if rtype != "llama3":
        return
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in fields if k not in scaling]
    if missing:
        raise ValueError(f"model config: llama3 rope_scaling lacks {missing}; it needs {fields}")
    bad = [k for k in fields if not _is_number(scaling[k]) or not scaling[k] > 0]
    if bad:
        raise ValueError(
            f"model config: rope_scaling {bad[0]} must be a finite number > 0, "
            f"got {scaling[bad[0]]!r}"
        )
    if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError(
            "model config: rope_scaling high_freq_factor must exceed low_freq_factor, got "
            f"{scaling['high_freq_factor']!r} <= {scaling['low_freq_factor']!r}"
        )


def _rope_fields(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config layout.

    transformers < 5 writes top-level `rope_theta` and `rope_scaling`; transformers >= 5
    folds both into `rope_parameters` ({"rope_type", "rope_theta", scaling keys...}).
    A per-layer-type `rope_parameters` (Gemma 3: keyed by attention type) is left alone.
    """
    theta = raw.get("rope_theta")
    scaling = raw.get("rope_scaling")
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and ("rope_type" in params or "rope_theta" in params):
        if theta is None:
            theta = params.get("rope_theta")
        if scaling is None and params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(
            f'{source}: rope_scaling must be an object such as {{"rope_type": "llama3", '
            f"...}} or null, got {scaling!r}"
        )
    if theta is None:
        return 10000.0, scaling
    if not _is_number(theta):
        raise ValueError(
            f"{source}: rope_theta must be a finite number > 0 (e.g. 10000.0), got {theta!r}"
        )
    return float(theta), scaling


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(value)
    return value


def _decoder_fields(raw: Any, source: str) -> dict[str, Any]:
    """The decoder's fields of a config.json object: multimodal wrappers (Gemma 3 12B/27B)
    keep them under `text_config`, with the wrapper's model_type and tie setting."""
    if not isinstance(raw, dict):
        raise ValueError(
            f"{source}: expected a JSON object of model fields (model_type, hidden_size, "
            f"...), got a JSON {_json_type(raw)}"
        )
    if "text_config" in raw and isinstance(raw["text_config"], dict):
        inner = dict(raw["text_config"])
        inner.setdefault("model_type", raw.get("model_type", ""))
        if "tie_word_embeddings" in raw:  # the wrapper's setting applies to the decoder
            inner.setdefault("tie_word_embeddings", raw["tie_word_embeddings"])
        return inner
    return raw


@dataclass(frozen=True)
class _HFFields:
    """Typed reads of one config.json's fields; a bad value is one line naming file and key."""

    raw: dict[str, Any]
    source: str
    model_type: str

    def need(self, key: str) -> Any:
        if key not in self.raw or self.raw[key] is None:
            raise ValueError(f"{self.source}: missing required field {key!r} for {self.model_type}")
        return self.raw[key]

    def integer(self, key: str, value: Any) -> int:
        if _is_int(value) or (isinstance(value, float) and value.is_integer()):
            return int(value)
        raise ValueError(
            f"{self.source}: {key} must be an integer >= 1, got {value!r} ({_json_type(value)})"
        )

    def number(self, key: str, default: float) -> float:
        value = self.raw.get(key, default)
        if value is None:
            return default
        if not _is_number(value):
            raise ValueError(
                f"{self.source}: {key} must be a finite number, got {value!r} ({_json_type(value)})"
            )
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        if not isinstance(value, bool):
            raise ValueError(
                f"{self.source}: {key} must be true or false, got {value!r} ({_json_type(value)})"
            )
        return value


# ---------------------------------------------------------------- one adapter per architecture
SlidingLayers = Callable[[dict[str, Any], int, Any], tuple[str, ...] | None]


def _no_sliding_layers(raw: dict[str, Any], num_layers: int, window: Any) -> None:
    return None


def _mistral_sliding_layers(raw: dict[str, Any], num_layers: int, window: Any):
    """Mistral: a sliding_window makes every layer sliding."""
    return ("sliding",) * num_layers if window else None


def _qwen_sliding_layers(raw: dict[str, Any], num_layers: int, window: Any):
    """Qwen2/3: layers from `max_window_layers` on slide, only with `use_sliding_window`."""
    if not (raw.get("use_sliding_window") and window):
        return None
    max_window_layers = int(raw.get("max_window_layers", num_layers))
    return tuple("full" if i < max_window_layers else "sliding" for i in range(num_layers))


def _gemma3_sliding_layers(raw: dict[str, Any], num_layers: int, window: Any):
    """Gemma 3: five local (sliding) layers to one global; `sliding_window_pattern` = 6
    (Gemma 3 technical report, sec. 2; HF Gemma3TextConfig default)."""
    if not window:
        return None
    pattern = int(raw.get("sliding_window_pattern", 6))
    return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers))


@dataclass(frozen=True)
class Architecture:
    """What one model_type's config.json means its own way; every other field is shared.

    Defaults are those of a field the file leaves out (transformers' config classes)."""

    qk_norm: bool = False  # RMSNorm over each head's q and k (Qwen3, Gemma 3)
    attention_bias: bool = False  # q/k/v projections with biases (Qwen2)
    tie_word_embeddings: bool = False  # lm_head is the embedding (Gemma)
    # rope_scaling types the engine runs; None: not checked (the engine does not run it)
    rope_scaling_types: tuple[str | None, ...] | None = ("llama3", "default", None)
    sliding_layers: SlidingLayers = _no_sliding_layers  # layer types without `layer_types`


_QWEN = {"sliding_layers": _qwen_sliding_layers}
_GEMMA3 = Architecture(
    qk_norm=True,
    tie_word_embeddings=True,
    rope_scaling_types=None,
    sliding_layers=_gemma3_sliding_layers,
)
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(),
    "mistral": Architecture(sliding_layers=_mistral_sliding_layers),
    "qwen2": Architecture(attention_bias=True, **_QWEN),
    "qwen3": Architecture(qk_norm=True, **_QWEN),
    "gemma3": _GEMMA3,
    "gemma3_text": _GEMMA3,
}


def _layer_types(
    raw: dict[str, Any], arch: Architecture, num_layers: int, sliding_window: Any
) -> tuple[str, ...]:
    explicit = raw.get("layer_types")
    if explicit:
        mapping = {"sliding_attention": "sliding", "full_attention": "full"}
        try:
            return tuple(mapping[t] for t in explicit)
        except KeyError as err:
            raise ValueError(
                f"layer_types entry {err.args[0]!r} unknown; expected sliding_attention or "
                "full_attention"
            ) from None
    return arch.sliding_layers(raw, num_layers, sliding_window) or ("full",) * num_layers
