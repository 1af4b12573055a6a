"""`QuantPlan`: which format each tensor and each layer's KV cache is stored in.

Rules are an ordered list of `{pattern, format, group_size?, algorithm?, activations?}`;
a pattern is a regex matched with `re.fullmatch` against tensor paths such as
`layers/3/mlp/down_proj`, the first match wins and unmatched tensors stay bf16 (the shape
of google/qwix's rules). The KV part says how each layer's keys and values are stored in
the paged pool. A plan is pure data: JSON/TOML round-trip and a stable fingerprint, so a
trial's record in MLflow reproduces it exactly.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tenantq.model.config import ModelConfig, TensorInfo
from tenantq.numerics import FORMATS, get_format

FORMAT_NAMES = tuple(FORMATS)  # the numerics registry's names, in its order
# Algorithms a rule may name. Only "rtn" is built in; GPTQ/AWQ/SmoothQuant register
# themselves in tenantq.quant.apply when they land.
ALGORITHM_NAMES = ("rtn", "gptq", "awq", "smoothquant")
# W8A8: activations quantized per token at run time; the weight must be in the same family.
ACTIVATION_FORMATS = {"fp8_e4m3": ("fp8_e4m3", "fp8_e5m2"), "int8": ("int8",)}
KV_AXES = ("channel", "token")
# Formats a KV page may use. fp16 is allowed; bf16 is the baseline.
KV_FORMAT_NAMES = FORMAT_NAMES


def _check_format(name: Any, where: str, valid: tuple[str, ...] = FORMAT_NAMES) -> str:
    if name not in valid:
        raise ValueError(f"{where}: unknown format {name!r}; valid formats: {', '.join(valid)}")
    return name


@dataclass(frozen=True)
class Rule:
    """Tensors whose path fully matches `pattern` are stored in `format`."""

    pattern: str
    format: str
    group_size: int | None = None
    algorithm: str = "rtn"
    activations: str | None = None
    symmetric: bool = True

    def __post_init__(self) -> None:
        where = f"rule {self.pattern!r}"
        try:
            object.__setattr__(self, "_regex", re.compile(self.pattern))
        except re.error as err:
            raise ValueError(f"{where}: invalid regex ({err})") from None
        _check_format(self.format, where)
        if self.group_size is not None and (
            not isinstance(self.group_size, int) or self.group_size <= 0
        ):
            raise ValueError(f"{where}: group_size must be a positive integer or absent")
        if self.algorithm not in ALGORITHM_NAMES:
            raise ValueError(
                f"{where}: unknown algorithm {self.algorithm!r}; "
                f"valid: {', '.join(ALGORITHM_NAMES)}"
            )
        if self.activations is not None:
            if self.activations not in ACTIVATION_FORMATS:
                raise ValueError(
                    f"{where}: activations {self.activations!r} not supported; "
                    f"valid: {', '.join(ACTIVATION_FORMATS)} (or absent for weight-only)"
                )
            if self.format not in ACTIVATION_FORMATS[self.activations]:
                raise ValueError(
                    f"{where}: W8A8 with {self.activations} activations needs weights in "
                    f"{' or '.join(ACTIVATION_FORMATS[self.activations])}, got {self.format}"
                )

    def matches(self, path: str) -> bool:
        return self._regex.fullmatch(path) is not None  # type: ignore[attr-defined]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"pattern": self.pattern, "format": self.format}
        if self.group_size is not None:
            d["group_size"] = self.group_size
        if self.algorithm != "rtn":
            d["algorithm"] = self.algorithm
        if self.activations is not None:
            d["activations"] = self.activations
        if not self.symmetric:
            d["symmetric"] = False
        return d


@dataclass(frozen=True)
class TensorQuant:
    """What the plan decided for one tensor: format and granularity, resolved."""

    path: str
    format: str
    axis: int
    group_size: int | None
    symmetric: bool
    algorithm: str
    activations: str | None


@dataclass(frozen=True)
class KVTensorSpec:
    """How one tensor (keys or values) of one layer is stored: its format and scale axis.

    Axis "channel": one scale per (head, channel) per page (scales reduce over the page's
    tokens, axis 0); "token": one scale per (token, head) (reduce over head_dim, axis -1).
    """

    format: str
    axis: str  # "channel" | "token"

    @property
    def quantized(self) -> bool:
        return self.format != "bf16"

    @property
    def needs_residual(self) -> bool:
        """A per-channel scale needs the whole page's tokens: the newest page waits."""
        return self.quantized and self.axis == "channel"

    @property
    def axis_index(self) -> int:
        return 0 if self.axis == "channel" else -1


@dataclass(frozen=True)
class LayerKV:
    """The plan's word on one layer's keys and values (formats and axes); the pool's arrays
    and their bytes are `tenantq.quant.storage.LayerKVStorage`."""

    key_format: str
    key_axis: str
    value_format: str
    value_axis: str

    @property
    def keys(self) -> KVTensorSpec:
        return KVTensorSpec(self.key_format, self.key_axis)

    @property
    def values(self) -> KVTensorSpec:
        return KVTensorSpec(self.value_format, self.value_axis)

    @property
    def is_bf16(self) -> bool:
        return self.key_format == "bf16" and self.value_format == "bf16"


@dataclass(frozen=True)
class KVPlan:
    """The KV-cache part of a plan (keys per channel, values per token by default, as KIVI)."""

    key_format: str = "bf16"
    key_axis: str = "channel"
    value_format: str = "bf16"
    value_axis: str = "token"
    sink_tokens: int = 0
    bf16_layers: tuple[int, ...] = ()
    # Per-layer overrides: ((layer_index, key_format, value_format), ...); negative = from end.
    layer_formats: tuple[tuple[int, str, str], ...] = ()

    def __post_init__(self) -> None:
        _check_format(self.key_format, "kv.key_format", KV_FORMAT_NAMES)
        _check_format(self.value_format, "kv.value_format", KV_FORMAT_NAMES)
        for name in ("key_axis", "value_axis"):
            if getattr(self, name) not in KV_AXES:
                raise ValueError(
                    f"kv.{name}: {getattr(self, name)!r} is not valid; use 'channel' or 'token'"
                )
        if not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ValueError(f"kv.sink_tokens must be an integer >= 0, got {self.sink_tokens!r}")
        object.__setattr__(self, "bf16_layers", tuple(int(i) for i in self.bf16_layers))
        fixed = []
        for entry in self.layer_formats:
            idx, kf, vf = entry
            _check_format(kf, f"kv.layer_formats[{idx}].key_format", KV_FORMAT_NAMES)
            _check_format(vf, f"kv.layer_formats[{idx}].value_format", KV_FORMAT_NAMES)
            fixed.append((int(idx), kf, vf))
        object.__setattr__(self, "layer_formats", tuple(fixed))

    def for_layer(self, layer: int, num_layers: int) -> LayerKV:
        def norm(i: int) -> int:
            j = i + num_layers if i < 0 else i
            if not 0 <= j < num_layers:
                raise ValueError(f"kv layer index {i} out of range for {num_layers} layers")
            return j

        if layer in {norm(i) for i in self.bf16_layers}:
            return LayerKV("bf16", self.key_axis, "bf16", self.value_axis)
        for idx, kf, vf in self.layer_formats:
            if norm(idx) == layer:
                return LayerKV(kf, self.key_axis, vf, self.value_axis)
        return LayerKV(self.key_format, self.key_axis, self.value_format, self.value_axis)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bf16_layers"] = list(self.bf16_layers)
        if self.layer_formats:
            d["layer_formats"] = [
                {"layer": i, "key_format": k, "value_format": v} for i, k, v in self.layer_formats
            ]
        else:
            del d["layer_formats"]
        return d

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KVPlan:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"kv: unknown keys {unknown}; valid keys: {sorted(known)}")
        d = dict(raw)
        d["bf16_layers"] = tuple(d.get("bf16_layers", ()))
        d["layer_formats"] = tuple(
            (e["layer"], e.get("key_format", "bf16"), e.get("value_format", "bf16"))
            for e in d.get("layer_formats", ())
        )
        return cls(**d)


@dataclass(frozen=True)
class QuantPlan:
    """Ordered weight rules plus the KV part. `QuantPlan()` is the bf16 baseline."""

    rules: tuple[Rule, ...] = ()
    kv: KVPlan = field(default_factory=KVPlan)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))

    # ---------------------------------------------------------------- matching
    def match(self, path: str) -> Rule | None:
        """The first rule whose pattern fully matches `path`, or None (tensor stays bf16)."""
        for rule in self.rules:
            if rule.matches(path):
                return rule
        return None

    def resolve(self, config: ModelConfig | Mapping[str, TensorInfo]) -> dict[str, TensorQuant]:
        """Quantized tensors of `config` and how each is stored; absent paths stay bf16.

        `config` may also be the tensor inventory itself (path -> TensorInfo)."""

        out: dict[str, TensorQuant] = {}
        for path, info in _inventory(config).items():
            if not info.quantizable:
                continue
            rule = self.match(path)
            if rule is None or rule.format == "bf16":
                continue
            spec = get_format(rule.format)
            group = rule.group_size if rule.group_size is not None else spec.default_group_size
            out[path] = TensorQuant(
                path=path,
                format=rule.format,
                axis=int(info.quant_axis or 0),
                group_size=group,
                symmetric=rule.symmetric,
                algorithm=rule.algorithm,
                activations=rule.activations,
            )
        return out

    def unused_rules(self, config: ModelConfig | Mapping[str, TensorInfo]) -> list[Rule]:
        """Rules that are the first match for no tensor of `config` (typos, shadowed rules)."""
        used: set[int] = set()
        for path, info in _inventory(config).items():
            if not info.quantizable:
                continue
            for idx, rule in enumerate(self.rules):
                if rule.matches(path):
                    used.add(idx)
                    break
        return [r for i, r in enumerate(self.rules) if i not in used]

    def kv_layers(self, config: ModelConfig) -> list[LayerKV]:
        return [self.kv.for_layer(i, config.num_layers) for i in range(config.num_layers)]

    # ---------------------------------------------------------------- construction
    @classmethod
    def uniform(
        cls, weights: str = "bf16", kv: str = "bf16", *, group_size: int | None = None
    ) -> QuantPlan:
        """Every linear weight (embedding included) in `weights`, every KV layer in `kv`."""
        rules = () if weights == "bf16" else (Rule(".*", weights, group_size=group_size),)
        return cls(rules=rules, kv=KVPlan(key_format=kv, value_format=kv))

    # ---------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        return {"rules": [r.to_dict() for r in self.rules], "kv": self.kv.to_dict()}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> QuantPlan:
        if not isinstance(raw, dict):
            raise ValueError("a plan must be an object with 'rules' and 'kv'")
        unknown = sorted(set(raw) - {"rules", "kv"})
        if unknown:
            raise ValueError(f"plan: unknown keys {unknown}; valid keys: ['kv', 'rules']")
        rules = []
        for i, r in enumerate(raw.get("rules", [])):
            known = set(Rule.__dataclass_fields__)
            bad = sorted(set(r) - known)
            if bad:
                raise ValueError(f"plan rule {i}: unknown keys {bad}; valid keys: {sorted(known)}")
            if "pattern" not in r or "format" not in r:
                raise ValueError(f"plan rule {i}: needs 'pattern' and 'format'")
            rules.append(Rule(**r))
        return cls(rules=tuple(rules), kv=KVPlan.from_dict(raw.get("kv", {})))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> QuantPlan:
        return cls.from_dict(json.loads(text))

    def to_toml(self) -> str:
        lines = []
        for rule in self.rules:
            lines.append("[[rules]]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in rule.to_dict().items())
            lines.append("")
        lines.append("[kv]")
        kv = self.kv.to_dict()
        layer_formats = kv.pop("layer_formats", [])
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in kv.items())
        for entry in layer_formats:
            lines.append("")
            lines.append("[[kv.layer_formats]]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in entry.items())
        return "\n".join(lines) + "\n"

    @classmethod
    def from_toml(cls, text: str) -> QuantPlan:
        return cls.from_dict(tomllib.loads(text))

    @classmethod
    def load(cls, path: str | Path) -> QuantPlan:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"plan file {p} does not exist")
        text = p.read_text()
        try:
            if p.suffix == ".toml":
                return cls.from_toml(text)
            if p.suffix == ".json":
                return cls.from_json(text)
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as err:
            raise ValueError(f"plan file {p}: cannot parse ({err})") from None
        raise ValueError(f"plan file {p}: expected a .json or .toml file")

    def save(self, path: str | Path) -> None:
        p = Path(path)
        text = self.to_toml() if p.suffix == ".toml" else self.to_json()
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(p)

    def fingerprint(self) -> str:
        """Stable short hash of the canonical JSON (same plan -> same hash, any process)."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]


def _inventory(config: ModelConfig | Mapping[str, TensorInfo]) -> Mapping[str, TensorInfo]:
    return config.tensors() if isinstance(config, ModelConfig) else config


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")
