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
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, create_model
from pydantic import ValidationError as _PydanticError

from tenantq.model.checks import validation_line
from tenantq.model.config import ModelConfig, TensorInfo
from tenantq.model.files import atomic_write_text
from tenantq.numerics import FORMATS, get_format

# Formats only the KV cache may use (asymmetric 2-bit: KIVI's cache format; int2 weights
# would need their own grouping study and are not supported in rules).
KV_ONLY_FORMATS = tuple(n for n, s in FORMATS.items() if s.asymmetric_only)
# Weight formats: the numerics registry's names, in its order, less the KV-only ones.
FORMAT_NAMES = tuple(n for n in FORMATS if n not in KV_ONLY_FORMATS)
# Algorithms a rule may name; tenantq.quant.algorithms.ALGORITHMS holds their functions under
# these names (a test asserts the two agree).
ALGORITHM_NAMES = ("rtn", "gptq", "awq", "smoothquant")
# W8A8: activations quantized per token at run time; the weight must be in the same family,
# or int4 (W4A8: its codes -8..7 are exact in int8 and in fp8_e4m3, so the product runs on
# the 8-bit units with the weight stored at 4 bits).
ACTIVATION_FORMATS = {"fp8_e4m3": ("fp8_e4m3", "fp8_e5m2", "int4"), "int8": ("int8", "int4")}
ACTIVATION_NAMES = tuple(ACTIVATION_FORMATS)
# W8A8 activation scales: "dynamic" (per token at run time) or "static" (one per input,
# from calibration statistics, stored with the weight; values beyond it clip).
ACTIVATION_SCALES = ("dynamic", "static")
# A static scale is one float32 per tensor (model.layers.StaticActQArray.act_scale).
STATIC_ACT_SCALE_BYTES = 4
# "channel": a scale per (head, channel) per page (KIVI keys); "token": per (token, head)
# (KIVI values); "tensor": one static scale per layer; "head": one static scale per KV head
# per layer (vLLM-style static scales, calibrated: `tenantq.quant.kv_calibration`).
KV_AXES = ("channel", "token", "tensor", "head")
STATIC_KV_AXES = ("tensor", "head")
# Formats a KV page may use: every registry format (int2 included). bf16 is the baseline.
KV_FORMAT_NAMES = tuple(FORMATS)
# Formats a static (tensor/head) scale applies to: one float scale with no block of its own.
STATIC_KV_FORMATS = tuple(
    n for n, s in FORMATS.items() if s.scale_dtype == "float32" and s.block_size is None
)
# Each KV format's default (key axis, value axis), chosen on the quick quality suite (README,
# "KV cache formats and static scales"): QuantPlan.uniform and `tenantq capacity --kv` use
# them. 8-bit: one static scale per tensor (KL within 1/10 of the gate's tolerance, no scale
# bytes per token); 4/2-bit: KIVI's per-channel keys, per-token values (static scales are a
# KL regression at int4). fp8_e5m2 follows fp8_e4m3 by analogy (not measured).
DEFAULT_KV_AXES = {
    **{name: ("channel", "token") for name in KV_FORMAT_NAMES},
    "fp8_e4m3": ("tensor", "tensor"),
    "fp8_e5m2": ("tensor", "tensor"),
    "int8": ("tensor", "tensor"),
}
# How page and token scales (and int2 zero points) are stored in the pool: "float32" (the
# codec's own), "bf16" (round to nearest: relative error <= 2^-8) or "e8m0" (a power of two,
# the OCP Microscaling v1.0 scale type, sec. 5.4.1, rounded *up* so no element clips;
# symmetric formats only). Static (tensor/head) scales are one float32 per layer whatever
# this says; MX and nvfp4 fix their own block scales.
KV_SCALE_DTYPES = ("float32", "bf16", "e8m0")
# Each KV format's default scale dtype in `QuantPlan.uniform` and `tenantq capacity --kv`
# (a plan that names none keeps float32, so written plans and their fingerprints stay as they
# were). Chosen on the quick suite (README "KV scale storage"): bf16 scales are within the
# float32 KL CI with the same needle result for int4 (0.00471 vs 0.00474) and int2, and cost
# half the bytes; E8M0 more than doubles int4's KL (0.0122, a gate regression).
DEFAULT_KV_SCALE_DTYPES = {"int4": "bf16", "int2": "bf16"}


# ------------------------------------------------------------------------ typed validation
# Each plan part's fields, types and ranges are declared once, on its dataclass (`Rule`,
# `KVPlan`); the strict pydantic model that checks them is derived from that declaration
# (`_fields_model`; strict: "false" is not a bool, "13" is not a list of layers, 2.0 is not a
# group size). A failure is one ValueError line naming the field, the value and what is allowed.
_STRICT = ConfigDict(strict=True, extra="forbid")


class _LayerFormatFields(BaseModel):
    model_config = _STRICT
    layer: StrictInt = Field(description="layer index; negative counts from the end")
    # absent: the plan's kv.key_format / kv.value_format (an entry naming neither is refused)
    key_format: Literal[KV_FORMAT_NAMES] | None = None
    value_format: Literal[KV_FORMAT_NAMES] | None = None


def _fields_model(cls: type, name: str, **json_fields: tuple[Any, Any]) -> type[BaseModel]:
    """The strict pydantic model of a plan dataclass, read off its own field declarations
    (types with their ranges and descriptions, defaults): the one schema. `json_fields` gives
    (type, default) where the JSON/TOML shape differs from the dataclass's (lists, not tuples)."""
    hints = get_type_hints(cls, include_extras=True)
    spec: dict[str, Any] = {}
    for f in fields(cls):
        default = ... if f.default is MISSING else f.default  # ...: required
        spec[f.name] = json_fields.get(f.name, (hints[f.name], default))
    return create_model(name, __config__=_STRICT, **spec)


class _PlanFields(BaseModel):
    model_config = _STRICT
    rules: list[dict[str, Any]] = Field([], description="ordered rules, first match wins")
    kv: dict[str, Any] = Field({}, description="the KV-cache part")


def _validated(model: type[BaseModel], raw: Any, where: str) -> BaseModel:
    """`raw` checked against `model`; the first problem as one ValueError line."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object (a table) of fields, got {raw!r}")
    try:
        return model.model_validate(raw)
    except _PydanticError as err:
        e = err.errors()[0]
        if e["type"] == "literal_error" and e["input"] in KV_ONLY_FORMATS:
            loc = ".".join(str(x) for x in e["loc"])
            raise ValueError(
                f"{where}.{loc}: {e['input']} is a KV-cache format only (weights in "
                f"{e['input']} are not supported); valid weight formats: "
                f"{', '.join(FORMAT_NAMES)}"
            ) from None
        raise ValueError(validation_line(err, model, prefix=where)) from None


def check_w8a8(how: Rule | TensorQuant) -> None:
    """W8A8 runs the matmul on stored codes: the weight needs one symmetric scale per output
    channel (no groups) in its activations' family; W4A8 (int4 weights) may also have groups
    along the input, each group's integer partial sum rescaled apart. The one check, for
    rules and tensors."""
    where = how.path if isinstance(how, TensorQuant) else f"rule {how.pattern!r}"
    if how.activations is None:
        if how.activation_scale != "dynamic":
            raise ValueError(
                f"{where}: activation_scale={how.activation_scale!r} applies to W8A8 only; "
                "set activations (int8 or fp8_e4m3) or drop activation_scale"
            )
        return
    family = ACTIVATION_FORMATS[how.activations]
    if how.format not in family:
        raise ValueError(
            f"{where}: W8A8 with {how.activations} activations needs weights in "
            f"{' or '.join(family)}, got {how.format}"
        )
    if not how.symmetric or (how.group_size is not None and how.format != "int4"):
        raise ValueError(
            f"{where}: W8A8 ({how.activations} activations) needs symmetric per-channel "
            f"weight scales (no group_size; W4A8 int4 weights may have groups), got "
            f"group_size={how.group_size}, symmetric={how.symmetric}"
        )


@dataclass(frozen=True)
class Rule:
    """Tensors whose path fully matches `pattern` are stored in `format`."""

    pattern: Annotated[StrictStr, Field(description="regex fully matched against tensor paths")]
    format: Annotated[
        Literal[FORMAT_NAMES], Field(description="storage format of matching tensors")
    ]
    group_size: Annotated[
        Annotated[StrictInt, Field(gt=0)] | None,
        Field(description="elements per scale group along the quantization axis"),
    ] = None
    algorithm: Annotated[Literal[ALGORITHM_NAMES], Field(description="quantization algorithm")] = (
        "rtn"
    )
    activations: Annotated[
        Literal[ACTIVATION_NAMES] | None,
        Field(description="W8A8: activation format (absent: weight-only)"),
    ] = None
    symmetric: Annotated[StrictBool, Field(description="false: int zero points")] = True
    activation_scale: Annotated[
        Literal[ACTIVATION_SCALES],
        Field(description="W8A8: per-token scales at run time, or one static calibrated"),
    ] = "dynamic"

    def __post_init__(self) -> None:
        where = f"rule {self.pattern!r}"
        _validated(_RuleFields, {f.name: getattr(self, f.name) for f in fields(self)}, where)
        try:
            object.__setattr__(self, "_regex", re.compile(self.pattern))
        except re.error as err:
            raise ValueError(f"{where}: invalid regex ({err})") from None
        check_w8a8(self)
        # Settings of a quantizer a bf16 tensor never meets. (`algorithm` is left alone: a
        # search space gives every rule the study's calibration algorithm, bf16 ones too, and
        # plans stored by earlier studies carry it.)
        if self.format == "bf16":
            ignored = [
                f"{name}={getattr(self, name)!r}"
                for name, default in (("group_size", None), ("symmetric", True))
                if getattr(self, name) != default
            ]
            if ignored:
                raise ValueError(
                    f"{where}: {', '.join(ignored)} on a bf16 rule does nothing (bf16 tensors "
                    "are not quantized) but would change the plan's fingerprint; drop it"
                )
        else:  # the quantizer's own check of group and symmetry, on a one-group stand-in
            from tenantq.numerics.layout import resolve_layout

            try:
                resolve_layout(
                    (self.group_size or 32,), self.format, axis=-1, group_size=self.group_size,
                    symmetric=self.symmetric,
                )  # fmt: skip
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None

    @classmethod
    def from_dict(cls, raw: Any, where: str = "rule") -> Rule:
        """A rule from its JSON/TOML table (unknown keys, wrong types: one-line errors naming
        `where`, e.g. `plan rules[0]`, and the rule's pattern)."""
        fields_ = _validated(_RuleFields, raw, where).model_dump()
        try:
            return cls(**fields_)
        except ValueError as err:
            message, own = str(err), f"rule {fields_['pattern']!r}"
            if message.startswith(own):
                message = f"{where} (pattern {fields_['pattern']!r})" + message[len(own) :]
            else:
                message = f"{where}: {message}"
            raise ValueError(message) from None

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
        if self.activation_scale != "dynamic":
            d["activation_scale"] = self.activation_scale
        return d


_RuleFields = _fields_model(Rule, "_RuleFields")


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
    activation_scale: str = "dynamic"


@dataclass(frozen=True)
class KVTensorSpec:
    """How one tensor (keys or values) of one layer is stored: its format and scale axis.

    Axis "channel": one scale per (head, channel) per page (scales reduce over the page's
    tokens, axis 0); "token": one scale per (token, head) (reduce over head_dim, axis -1).
    """

    format: str
    axis: str  # "channel" | "token" | "tensor" | "head"
    scale_dtype: str = "float32"  # KV_SCALE_DTYPES: storage of page/token scales

    @property
    def quantized(self) -> bool:
        return self.format != "bf16"

    @property
    def stored_scale_dtype(self) -> str | None:
        """How this tensor's page/token scales are stored: `scale_dtype` for formats whose
        codec scale is float32 (fp8, int8, int4, int2); None when there are none to store
        (bf16, static axes) or the format fixes its own (MX E8M0, nvfp4 E4M3)."""
        if not self.quantized or self.static or get_format(self.format).scale_dtype != "float32":
            return None
        return self.scale_dtype

    @property
    def static(self) -> bool:
        """Scaled by calibrated static scales (tensor/head) held beside the pool, not per page."""
        return self.quantized and self.axis in STATIC_KV_AXES

    @property
    def needs_residual(self) -> bool:
        """A per-channel scale needs the whole page's tokens: the newest page waits."""
        return self.quantized and self.axis == "channel"

    @property
    def axis_index(self) -> int:
        """The page axis the codec reduces over: tokens (0) for channel scales, head_dim (-1)
        otherwise (a static scale is given per head or per tensor and broadcast along it)."""
        return 0 if self.axis == "channel" else -1


@dataclass(frozen=True)
class LayerKV:
    """The plan's word on one layer's keys and values (formats and axes); the pool's arrays
    and their bytes are `tenantq.storage.kv.LayerKVStorage`."""

    key_format: str
    key_axis: str
    value_format: str
    value_axis: str
    scale_dtype: str = "float32"

    @property
    def keys(self) -> KVTensorSpec:
        return KVTensorSpec(self.key_format, self.key_axis, self.scale_dtype)

    @property
    def values(self) -> KVTensorSpec:
        return KVTensorSpec(self.value_format, self.value_axis, self.scale_dtype)

    @property
    def is_bf16(self) -> bool:
        return self.key_format == "bf16" and self.value_format == "bf16"


def _check_kv_axis(name: str, axis: str, formats: set[str]) -> None:
    """A static axis needs a format with one free float32 scale (not MX/nvfp4 blocks)."""
    if axis not in STATIC_KV_AXES:
        return
    bad = sorted(f for f in formats if f != "bf16" and f not in STATIC_KV_FORMATS)
    if bad:
        raise ValueError(
            f"kv.{name}: {axis!r} (a static scale) needs a format with a float32 scale "
            f"({', '.join(STATIC_KV_FORMATS)}); {', '.join(bad)} fixes its own block scales: "
            "use 'channel' or 'token'"
        )


def _check_scale_dtype(scale_dtype: str, scaled: set[str]) -> None:
    """`scale_dtype` against the formats of tensors with page/token scales (`scaled`): a
    cheaper scale needs a float32 codec scale to replace, E8M0 a symmetric format, and some
    tensor must have such scales (a setting that changes nothing is refused, not ignored)."""
    if scale_dtype == "float32":
        return
    where = f"kv.scale_dtype: {scale_dtype!r}"
    own = sorted(f for f in scaled if FORMATS[f].scale_dtype != "float32")
    if own:
        raise ValueError(
            f"{where} replaces float32 page/token scales; {', '.join(own)} fixes its own "
            f"block scales: use scale_dtype 'float32' or fp8_e4m3, fp8_e5m2, int8, int4, int2"
        )
    if scale_dtype == "e8m0" and any(FORMATS[f].asymmetric_only for f in scaled):
        raise ValueError(
            f"{where} is a power-of-two scale for symmetric formats; int2 (asymmetric, with a "
            "zero point) takes scale_dtype 'float32' or 'bf16'"
        )
    if not scaled:
        raise ValueError(
            f"{where} applies to page/token scales, and no quantized KV tensor has them "
            "(bf16 or static tensor/head axes only); use 'float32' or a channel/token axis"
        )


def _check_bf16_settings(kv: KVPlan, entries: list[tuple[int, str, str]]) -> None:
    """Sink tokens and bf16 layers keep quantized KV in bf16: with bf16 keys and values in
    every layer there is nothing to keep, and the setting would only change the plan's
    fingerprint (as group_size on a bf16 rule; refused the same way)."""
    formats = {kv.key_format, kv.value_format} | {f for e in entries for f in e[1:]}
    if formats != {"bf16"}:
        return
    ignored = [f"sink_tokens={kv.sink_tokens}"] if kv.sink_tokens else []
    if kv.bf16_layers:
        ignored.append(f"bf16_layers={list(kv.bf16_layers)}")
    if ignored:
        raise ValueError(
            f"kv: {', '.join(ignored)} with bf16 keys and values does nothing (every KV "
            "tensor is bf16 already) but would change the plan's fingerprint; drop it"
        )


def _check_layers_once(bf16: list[int], formats: list[int], num_layers: int | None) -> None:
    """Each layer named once across `bf16_layers` and `layer_formats` (an index and its negative
    alias, e.g. 0 and -4 on a 4-layer model, are the same layer once `num_layers` is known):
    two entries for one layer would leave one silently ignored, and a layer named twice in
    `bf16_layers` would give one plan two fingerprints."""

    def layer(i: int) -> int:
        return i + num_layers if num_layers is not None and i < 0 else i

    seen: dict[int, tuple[str, int]] = {}
    for name, indices in (("layer_formats", formats), ("bf16_layers", bf16)):
        for i in indices:
            j = layer(i)
            if j in seen:
                first, index = seen[j]
                raise ValueError(
                    f"kv.{name}: layer {i} is already given in kv.{first} (as {index}); "
                    "name each layer once (negative indices count from the end)"
                )
            seen.setdefault(j, (name, i))


@dataclass(frozen=True)
class KVPlan:
    """The KV-cache part of a plan (keys per channel, values per token by default, as KIVI)."""

    key_format: Literal[KV_FORMAT_NAMES] = "bf16"
    key_axis: Literal[KV_AXES] = "channel"
    value_format: Literal[KV_FORMAT_NAMES] = "bf16"
    value_axis: Literal[KV_AXES] = "token"
    sink_tokens: Annotated[
        StrictInt, Field(ge=0, description="first tokens of each sequence kept unquantized")
    ] = 0
    bf16_layers: Annotated[tuple[int, ...], Field(description="layers whose KV stays bf16")] = ()
    # Per-layer overrides: ((layer_index, key_format, value_format), ...); negative = from end.
    layer_formats: Annotated[
        tuple[tuple[int, str, str], ...], Field(description="per-layer KV formats")
    ] = ()
    scale_dtype: Annotated[
        Literal[KV_SCALE_DTYPES],
        Field(description="storage of page/token scales and int2 zero points"),
    ] = "float32"

    def __post_init__(self) -> None:
        raw = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("bf16_layers", "layer_formats"):  # tuples here, lists in JSON
            if isinstance(raw[name], tuple):
                raw[name] = list(raw[name])
        raw["layer_formats"] = [
            dict(zip(("layer", "key_format", "value_format"), e, strict=True))
            if isinstance(e, tuple | list) and len(e) == 3
            else e
            for e in raw["layer_formats"]
        ] if isinstance(raw["layer_formats"], list) else raw["layer_formats"]  # fmt: skip
        checked = _validated(_KVFields, raw, "kv")
        entries = []
        for i, e in enumerate(checked.layer_formats):
            if e.key_format is None and e.value_format is None:
                raise ValueError(
                    f"kv.layer_formats[{i}]: layer {e.layer} names neither key_format nor "
                    "value_format, so it changes nothing; give one or both, or remove it"
                )
            entries.append(
                (e.layer, e.key_format or self.key_format, e.value_format or self.value_format)
            )
        checked = checked.model_copy(
            update={
                "layer_formats": [
                    _LayerFormatFields(layer=i, key_format=k, value_format=v) for i, k, v in entries
                ]
            }
        )
        _check_bf16_settings(self, entries)
        scaled: set[str] = set()  # formats of tensors with page/token scales
        for fmt_key, axis_key in (("key_format", "key_axis"), ("value_format", "value_axis")):
            formats = {getattr(self, fmt_key)} | {
                e.key_format if fmt_key == "key_format" else e.value_format
                for e in checked.layer_formats
            }
            _check_kv_axis(axis_key, getattr(self, axis_key), formats)
            if getattr(self, axis_key) not in STATIC_KV_AXES:
                scaled |= {f for f in formats if FORMATS[f].scale_dtype is not None}
        _check_scale_dtype(self.scale_dtype, scaled)
        _check_layers_once(
            list(checked.bf16_layers), [e.layer for e in checked.layer_formats], None
        )
        object.__setattr__(self, "bf16_layers", tuple(checked.bf16_layers))
        object.__setattr__(
            self,
            "layer_formats",
            tuple((e.layer, e.key_format, e.value_format) for e in checked.layer_formats),
        )

    def check_model(self, config: ModelConfig) -> None:
        """Layer indices and sink tokens against the model the plan meets (one-line errors)."""
        n = config.num_layers
        indices = [("bf16_layers", i) for i in self.bf16_layers]
        indices += [("layer_formats", e[0]) for e in self.layer_formats]
        for name, i in indices:
            if not -n <= i < n:
                raise ValueError(
                    f"kv.{name}: layer {i} is out of range for a model of {n} layers; "
                    f"valid indices are {-n}..{n - 1} (negative counts from the end)"
                )
        _check_layers_once(list(self.bf16_layers), [e[0] for e in self.layer_formats], n)
        context = config.max_position_embeddings
        if self.sink_tokens > context:
            raise ValueError(
                f"kv.sink_tokens: {self.sink_tokens} is more than the model's context of "
                f"{context} tokens; valid: 0..{context}"
            )

    def for_layer(self, layer: int, num_layers: int) -> LayerKV:
        def norm(i: int) -> int:
            j = i + num_layers if i < 0 else i
            if not 0 <= j < num_layers:
                raise ValueError(
                    f"kv layer index {i} is out of range for a model of {num_layers} layers; "
                    f"valid indices are {-num_layers}..{num_layers - 1}"
                )
            return j

        k_axis, v_axis, scale = self.key_axis, self.value_axis, self.scale_dtype
        if layer in {norm(i) for i in self.bf16_layers}:
            return LayerKV("bf16", k_axis, "bf16", v_axis, scale)
        for idx, kf, vf in self.layer_formats:
            if norm(idx) == layer:
                return LayerKV(kf, k_axis, vf, v_axis, scale)
        return LayerKV(self.key_format, k_axis, self.value_format, v_axis, scale)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.scale_dtype == "float32":  # the default is left out: fingerprints stay as they were
            del d["scale_dtype"]
        d["bf16_layers"] = list(self.bf16_layers)
        if self.layer_formats:
            d["layer_formats"] = [
                {"layer": i, "key_format": k, "value_format": v} for i, k, v in self.layer_formats
            ]
        else:
            del d["layer_formats"]
        return d

    @classmethod
    def from_dict(cls, raw: Any) -> KVPlan:
        """The KV part from its JSON/TOML table (one-line errors naming the field)."""
        checked = _validated(_KVFields, raw, "kv")
        return cls(
            **checked.model_dump(exclude={"bf16_layers", "layer_formats"}),
            bf16_layers=tuple(checked.bf16_layers),
            layer_formats=tuple(
                (e.layer, e.key_format, e.value_format) for e in checked.layer_formats
            ),
        )


# JSON/TOML give lists (of layers, of {layer, key_format, value_format} tables) where the
# dataclass holds tuples.
_KVFields = _fields_model(
    KVPlan,
    "_KVFields",
    bf16_layers=(Annotated[list[StrictInt], Field(description="layers whose KV stays bf16")], []),
    layer_formats=(
        Annotated[list[_LayerFormatFields], Field(description="per-layer KV formats")],
        [],
    ),
)


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
        inventory = _inventory(config)
        self._check_embed_activations(inventory)
        for path, info in inventory.items():
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
                activation_scale=rule.activation_scale,
            )
        return out

    def _check_embed_activations(self, inventory: Mapping[str, TensorInfo]) -> None:
        """W8A8 activations on an untied `embed` (a model with its own `lm_head`): the
        embedding is a row lookup, not a matmul, so a rule giving only embed activations
        does nothing. A broader rule (".*") keeps them for its matmuls and is accepted."""
        rule = self.match("embed") if "lm_head" in inventory and "embed" in inventory else None
        if rule is None or rule.activations is None:
            return
        others = [
            p for p, info in inventory.items()
            if info.quantizable and p != "embed" and self.match(p) is rule
        ]  # fmt: skip
        if not others:
            raise ValueError(
                f"rule {rule.pattern!r}: activations={rule.activations!r} on embed does "
                "nothing: this model's embedding is untied (it has an lm_head), so embed is a "
                "lookup, not a matmul; drop activations from this rule"
            )

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

    def check_model(self, config: ModelConfig) -> None:
        """The whole plan against the model it meets (KV layers and sinks, W8A8 on embed):
        the checks engine, capacity and tracking each run when they use the plan, run at
        once by a command before its work."""
        self.kv.check_model(config)
        self.resolve(config)

    def kv_layers(self, config: ModelConfig) -> list[LayerKV]:
        """Each layer's KV formats, once the KV part is checked against `config`."""
        self.kv.check_model(config)
        return [self.kv.for_layer(i, config.num_layers) for i in range(config.num_layers)]

    # ---------------------------------------------------------------- construction
    @classmethod
    def uniform(
        cls,
        weights: str = "bf16",
        kv: str = "bf16",
        *,
        group_size: int | None = None,
        kv_scale_dtype: str | None = None,
    ) -> QuantPlan:
        """Every linear weight (embedding included) in `weights`, every KV layer in `kv` with
        that format's default axes (`DEFAULT_KV_AXES`) and page/token scales stored as
        `kv_scale_dtype` (None: the format's default, `DEFAULT_KV_SCALE_DTYPES`, else float32)."""
        rules = () if weights == "bf16" else (Rule(".*", weights, group_size=group_size),)
        key_axis, value_axis = DEFAULT_KV_AXES.get(kv, ("channel", "token"))
        if kv_scale_dtype is None:
            kv_scale_dtype = DEFAULT_KV_SCALE_DTYPES.get(kv, "float32")
        return cls(
            rules=rules,
            kv=KVPlan(
                key_format=kv,
                key_axis=key_axis,
                value_format=kv,
                value_axis=value_axis,
                scale_dtype=kv_scale_dtype,
            ),
        )

    @property
    def needs_kv_scales(self) -> bool:
        """True when some KV tensor uses a static (tensor/head) axis: the engine then needs
        calibrated scales (`tenantq.quant.kv_calibration.kv_static_scales`)."""
        kv = self.kv
        formats = {
            "key": {kv.key_format} | {e[1] for e in kv.layer_formats},
            "value": {kv.value_format} | {e[2] for e in kv.layer_formats},
        }
        return any(
            axis in STATIC_KV_AXES and formats[which] - {"bf16"}
            for which, axis in (("key", kv.key_axis), ("value", kv.value_axis))
        )

    # ---------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        return {"rules": [r.to_dict() for r in self.rules], "kv": self.kv.to_dict()}

    @classmethod
    def from_dict(cls, raw: Any) -> QuantPlan:
        """A plan from `{"rules": [...], "kv": {...}}`; wrong keys, types and values are
        one-line ValueErrors naming the field, the value and what is allowed."""
        if not isinstance(raw, dict):
            raise ValueError(
                f"a plan must be an object with 'rules' (a list) and 'kv' (an object), "
                f"got {type(raw).__name__}"
            )
        checked = _validated(_PlanFields, raw, "plan")
        rules = tuple(Rule.from_dict(r, f"plan rules[{i}]") for i, r in enumerate(checked.rules))
        return cls(rules=rules, kv=KVPlan.from_dict(checked.kv))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> QuantPlan:
        """A plan from JSON; a key given twice in one object is an error (JSON keeps the last
        silently). TOML refuses a repeated key itself."""
        return cls.from_dict(json.loads(text, object_pairs_hook=_unique_keys))

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
        if p.is_dir():
            raise ValueError(f"plan file {p} is a directory; pass a .json or .toml plan file")
        if not p.is_file():
            raise ValueError(f"plan file {p} does not exist")
        suffix = p.suffix.lower()  # PLAN.JSON is a JSON file too
        if suffix not in (".json", ".toml"):
            raise ValueError(f"plan file {p}: expected a .json or .toml file")
        try:
            text = p.read_text()
            if suffix == ".toml":
                return cls.from_toml(text)
            return cls.from_json(text)
        except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"plan file {p}: cannot parse ({err})") from None
        except ValueError as err:
            raise ValueError(f"plan file {p}: {err}") from None

    def save(self, path: str | Path) -> None:
        p = Path(path)
        text = self.to_toml() if p.suffix.lower() == ".toml" else self.to_json()
        atomic_write_text(p, text)

    def fingerprint(self) -> str:
        """Stable short hash of the canonical JSON (same plan -> same hash, any process)."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ValueError(f"key {twice[0]!r} is given twice in one object; give each key once")
    return dict(pairs)


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
