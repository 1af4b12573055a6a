"""Specs, suites and plans generated from their schemas, one field perturbed into an invalid
value: the validating function (`parse_spec`, `parse_suite`, `QuantPlan.from_dict`) must
either refuse it with one ValueError line naming the field, or give exactly the result of
the unperturbed input (a value it legitimately reads the same). Nothing else: no other
exception type, no silently different result.

The invalid values are read off each field's schema (pydantic annotations and bounds): a
choice outside a Literal, a number past its bound, a NaN where only finite numbers go, the
wrong type, an unknown key beside the field; and one element of a list changed (a negative,
a huge value, an element repeated). Specs, suites and plans are checked as `--check` and
the run check them: against the reference model too (`check_study`,
`check_suite_for_model`, `QuantPlan.check_model`), so a value the schema lets through but
the model check misses is found. `test_schema_bounds_are_refused` lists bounds by hand: a
bound dropped from the schema is caught there even though the perturbation (which reads
the schema) would no longer try it.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any, Literal, get_args, get_origin

import annotated_types as at
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from tenantq.evals import suite as suite_mod
from tenantq.model.config import ModelConfig
from tenantq.quant import plan as plan_mod
from tenantq.reference import reference_model_path
from tenantq.search import spec as spec_mod

REF_CONFIG = ModelConfig.from_file(reference_model_path() / "config.json")  # 4 layers, 1,024 pos

SETTINGS = settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


# ------------------------------------------------------------------ the schema, read
def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """(the annotation without Optional/Annotated, the constraint objects found on the way)."""
    constraints: list[Any] = []
    while True:
        origin = get_origin(annotation)
        if origin is typing.Annotated:
            annotation, *meta = get_args(annotation)
            for m in meta:
                constraints.extend(m.metadata if isinstance(m, FieldInfo) else [m])
            continue
        if origin in (typing.Union, types.UnionType):
            args = [a for a in get_args(annotation) if a is not type(None)]
            if len(args) == 1:
                annotation = args[0]
                continue
        return annotation, constraints


def invalid_values(field: FieldInfo) -> list[Any]:
    """Values outside what `field`'s schema allows (each one wrong for one reason)."""
    annotation, constraints = _unwrap(field.annotation)
    constraints += list(field.metadata)
    origin = get_origin(annotation)
    out: list[Any] = [{"a": "table"}]  # a table where a plain value (or list) goes
    if origin in (typing.Union, types.UnionType):  # e.g. reserve: "10%", "4GiB" or 0.1
        return [*out, "lots", math.nan, -1.0] if float in get_args(annotation) else out
    if origin is Literal:
        return [*out, "zz-not-a-choice", 3]
    if origin in (list, tuple):
        out += ["not-a-list", 7]
        (inner, *_rest) = get_args(annotation) or (Any,)
        inner, _ = _unwrap(inner)
        if get_origin(inner) is Literal:
            out.append(["zz-not-a-choice"])
        return out
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [7, "not-a-table"]
    base = getattr(annotation, "__origin__", annotation)
    if annotation is bool or "Bool" in str(annotation):
        return [*out, "perhaps", 2]
    if annotation is int or "Int" in str(annotation) or base is int:
        out += ["many", 2.5]
        for c in constraints:
            if isinstance(c, at.Ge):
                out.append(c.ge - 1)
            elif isinstance(c, at.Gt):
                out.append(c.gt)
            elif isinstance(c, at.Le):
                out.append(c.le + 1)
        return out
    if annotation is float:
        # No float of these schemas means anything as NaN or infinity (tolerances, bounds).
        out += ["lots", math.nan, math.inf, -math.inf]
        for c in constraints:
            if isinstance(c, at.Ge):
                out.append(c.ge - 0.5)
        return out
    if annotation is str or "Str" in str(annotation):
        return [*out, 3, ["a"]]
    return out


def element_values(current: Any, negatives: bool = True) -> list[Any]:
    """Lists like `current` with one element changed: negative, huge, or repeated."""
    if not isinstance(current, list) or not current:
        return []
    out = [[*current, current[0]]]  # an element repeated
    if all(isinstance(x, int) and not isinstance(x, bool) for x in current):
        out.append([*current[:-1], 10**6])
        if negatives:  # plans take negative layer indices (counted from the end)
            out.append([*current[:-1], -4])
    return out


def _at(doc: dict, path: tuple) -> Any:
    here: Any = doc
    for part in path:
        try:
            here = here[part]
        except (KeyError, IndexError, TypeError):
            return None
    return here


def targets(model: type[BaseModel], doc: dict, path: tuple = ()) -> list[tuple[tuple, FieldInfo]]:
    """(path, field) of every field of `doc` (recursing into nested tables) and of `model`'s
    optional fields absent from it."""
    out = []
    for name, field in model.model_fields.items():
        out.append(((*path, name), field))
        value = doc.get(name)
        inner, _ = _unwrap(field.annotation)
        if isinstance(value, dict) and isinstance(inner, type) and issubclass(inner, BaseModel):
            out += targets(inner, value, (*path, name))
        elif isinstance(value, list | tuple) and get_origin(inner) in (list, tuple):
            item, _ = _unwrap(get_args(inner)[0])
            if isinstance(item, type) and issubclass(item, BaseModel):
                for i, v in enumerate(value):
                    if isinstance(v, dict):
                        out += targets(item, v, (*path, name, i))
    return out


def perturbed(doc: dict, path: tuple, value: Any) -> dict:
    import copy

    out = copy.deepcopy(doc)
    here: Any = out
    for part in path[:-1]:
        if isinstance(part, str) and part not in here:
            here[part] = {}
        here = here[part]
    here[path[-1]] = value
    return out


def _names(path: tuple) -> list[str]:
    return [str(p) for p in path if isinstance(p, str)]


def check_outcome(parse, doc: dict, path: tuple, value: Any) -> None:
    """The property: one ValueError line naming the field, or the unperturbed result."""
    expected = parse(doc)
    try:
        got = parse(perturbed(doc, path, value))
    except ValueError as err:
        message = str(err)
        assert "\n" not in message, message
        named = _names(path)[-1]
        assert named in message, (path, value, message)
        return
    assert got == expected, (path, value, "accepted and gave a different result")


# ------------------------------------------------------------------ valid inputs generated
FORMATS = st.sampled_from(["bf16", "fp8_e4m3", "int8", "int4"])


def _subset(choices: list[str]) -> st.SearchStrategy[list[str]]:
    return st.lists(st.sampled_from(choices), min_size=1, max_size=len(choices), unique=True)


@st.composite
def specs(draw) -> dict:
    doc: dict[str, Any] = {
        "model": "reference",
        "deployment": {
            "hardware": "cpu",
            "memory": draw(st.sampled_from(["10MiB", "16MiB"])),
            "context_tokens": draw(st.sampled_from([128, 256])),
            "page_tokens": draw(st.sampled_from([8, 16])),
        },
        "study": {"name": draw(st.sampled_from(["s", "a-b.1"])), "trials": draw(st.integers(1, 9))},
        "space": {
            "weight_formats": draw(_subset(["bf16", "fp8_e4m3", "int8", "int4"])),
            "key_formats": draw(_subset(["bf16", "fp8_e4m3", "int8", "int4"])),
            "sink_tokens": draw(_subset([0, 4, 8])),
            "kind": draw(st.sampled_from(["structured", "per_tensor"])),
        },
        "sampler": {
            "kind": draw(st.sampled_from(["nsga2", "tpe", "random"])),
            "seed": draw(st.integers(0, 9)),
        },
        "workers": {"count": draw(st.integers(1, 3))},
        "calibration": {"sequences": draw(st.integers(1, 8))},
    }
    if draw(st.booleans()):
        doc["constraints"] = [
            {"metric": "fidelity.kl_mean", "tolerance": draw(st.sampled_from([0.0, 0.05]))}
        ]
    return doc


@st.composite
def suites(draw) -> dict:
    doc: dict[str, Any] = {"name": "generated", "seed": draw(st.integers(0, 5))}
    tasks = draw(st.lists(st.sampled_from(["fidelity", "needles", "structured"]), min_size=1,
                          unique=True))  # fmt: skip
    if "fidelity" in tasks:
        doc["fidelity"] = {"rows": draw(st.integers(1, 8)), "row_tokens": draw(st.integers(8, 64))}
    if "needles" in tasks:
        doc["needles"] = [
            {
                "lengths": draw(
                    st.lists(st.integers(64, 512), min_size=1, max_size=3, unique=True)
                ),
                "per_length": draw(st.integers(1, 4)),
            }
        ]
    if "structured" in tasks:
        doc["structured"] = {"per_task": draw(st.integers(1, 4))}
    if "fidelity" in tasks and draw(st.booleans()):
        doc["gates"] = [
            {"metric": "fidelity.kl_mean", "tolerance": 0.01, "higher_is_better": False}
        ]
    return doc


@st.composite
def rules(draw) -> dict:
    fmt = draw(FORMATS)
    rule: dict[str, Any] = {
        "pattern": draw(st.sampled_from([".*", "layers/.*/mlp/.*", "embed", "lm_head"])),
        "format": fmt,
    }
    if fmt in ("int8", "int4") and draw(st.booleans()):
        rule["group_size"] = draw(st.sampled_from([32, 128]))
    return rule


@st.composite
def plans(draw) -> dict:
    kv: dict[str, Any] = {
        "key_format": draw(FORMATS),
        "value_format": draw(FORMATS),
        "key_axis": "channel",
        "value_axis": "token",
        "sink_tokens": draw(st.integers(0, 8)),
        "bf16_layers": draw(st.lists(st.integers(0, 3), max_size=2, unique=True)),
    }
    if kv["key_format"] == kv["value_format"] == "bf16":  # sinks, bf16 layers: refused
        kv.update(sink_tokens=0, bf16_layers=[])
    return {"rules": draw(st.lists(rules(), max_size=3)), "kv": kv}


# ------------------------------------------------------------------ the property, per kind
def _spec_targets(doc: dict) -> list[tuple[tuple, FieldInfo]]:
    return targets(spec_mod.ExperimentSpec, doc)


def _plan_targets(doc: dict) -> list[tuple[tuple, FieldInfo]]:
    out = [(("kv", *p), f) for p, f in targets(plan_mod._KVFields, doc["kv"])]
    for i, rule in enumerate(doc["rules"]):
        out += [(("rules", i, *p), f) for p, f in targets(plan_mod._RuleFields, rule)]
    return out


_CHECKED: dict[str, ValueError | None] = {}  # spec JSON -> check_study's outcome


def _parse_spec(doc: dict):
    """What `tenantq search --check` runs: the schema, then `check_study` on the model
    (once per distinct spec: perturbations read the same mostly give the same spec)."""
    import warnings

    from tenantq.search.checks import check_study

    spec = spec_mod.parse_spec(doc, "spec.toml")
    key = spec.model_dump_json()
    if key not in _CHECKED:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                check_study(spec, REF_CONFIG)
            _CHECKED[key] = None
        except ValueError as err:
            _CHECKED[key] = err
    if _CHECKED[key] is not None:
        raise ValueError(str(_CHECKED[key]))
    return spec


def _parse_plan(doc: dict):
    plan = plan_mod.QuantPlan.from_dict(doc)
    plan.check_model(REF_CONFIG)
    return plan


def _parse_suite(doc: dict):
    suite = suite_mod.parse_suite(doc, "suite.toml")
    suite_mod.check_suite_for_model(suite, REF_CONFIG)
    return suite


KINDS = {
    "spec": (specs(), _spec_targets, _parse_spec),
    "suite": (suites(), lambda d: targets(suite_mod.Suite, d), _parse_suite),
    "plan": (plans(), _plan_targets, _parse_plan),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_one_invalid_field_is_named_or_changes_nothing(kind) -> None:
    # Hypothesis draws the valid inputs; every field of each, and every invalid value its
    # schema gives, is then tried in turn (a few hundred perturbations per input).
    strategy, find_targets, parse = KINDS[kind]
    tried: list[tuple] = []

    @SETTINGS
    @given(doc=strategy)
    def prop(doc) -> None:
        parse(doc)  # the generated input is valid
        for path, field in find_targets(doc):
            values = invalid_values(field)
            values += element_values(_at(doc, path), negatives=kind != "plan")
            for value in values:
                check_outcome(parse, doc, path, value)
                tried.append(path)

    prop()
    assert len({p[-1] for p in tried}) >= 10  # the fields of the schema, not a few of them


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_unknown_key_beside_any_field_is_named(kind) -> None:
    strategy, find_targets, parse = KINDS[kind]

    @SETTINGS
    @given(doc=strategy, data=st.data())
    def prop(doc, data) -> None:
        path, _field = data.draw(st.sampled_from(find_targets(doc)), label="field")
        table = (*path[:-1], "bogus_key")
        with pytest.raises(ValueError) as err:
            parse(perturbed(doc, table, 1))
        assert "\n" not in str(err.value) and "bogus_key" in str(err.value), str(err.value)

    prop()


# Bounds the schemas hold, by hand: (kind, a valid document's change, the name the error
# gives). The perturbation above reads the bounds off the schema, so a bound removed there
# would silently stop being tried; this list still asks for it.
SPEC_BASE = {
    "model": "reference",
    "deployment": {"hardware": "cpu", "memory": "10MiB", "context_tokens": 256},
    "study": {"name": "s", "trials": 3},
}
HAND_BOUNDS = [
    ("spec", ("space", "sink_tokens"), [-4], "sink_tokens"),
    ("spec", ("space", "sink_tokens"), [0, 0], "sink_tokens"),
    ("spec", ("space", "bf16_first_layers"), [-1], "bf16_first_layers"),
    ("spec", ("space", "bf16_last_layers"), [0, 9], "bf16"),
    ("spec", ("space", "group_size"), 0, "group_size"),
    ("spec", ("space", "max_keep_bf16"), -1, "max_keep_bf16"),
    ("spec", ("deployment", "context_tokens"), 0, "context_tokens"),
    ("spec", ("deployment", "context_tokens"), 5000, "context_tokens"),
    ("spec", ("deployment", "page_tokens"), 0, "page_tokens"),
    ("spec", ("study", "trials"), 0, "trials"),
    ("spec", ("workers", "count"), 0, "count"),
    ("spec", ("sampler", "seed"), -1, "seed"),
    ("spec", ("sampler", "population_size"), 1, "population_size"),
    ("spec", ("calibration", "sequences"), 0, "sequences"),
    ("spec", ("calibration", "sequence_tokens"), 1, "sequence_tokens"),
    ("spec", ("calibration", "sequence_tokens"), 5000, "sequence_tokens"),
    ("suite", ("seed",), -1, "seed"),
    ("suite", ("resamples",), 99, "resamples"),
    ("suite", ("fidelity", "rows"), 0, "rows"),
    ("suite", ("fidelity", "row_tokens"), 7, "row_tokens"),
    ("suite", ("fidelity", "row_tokens"), 5000, "row_tokens"),
    ("plan", ("kv", "sink_tokens"), -4, "sink_tokens"),
    ("plan", ("kv", "sink_tokens"), 5000, "sink_tokens"),
    ("plan", ("kv", "bf16_layers"), [0, 0], "bf16_layers"),
    ("plan", ("kv", "bf16_layers"), [0, -4], "bf16_layers"),
    ("plan", ("kv", "bf16_layers"), [4], "bf16_layers"),
]
BASES = {
    "spec": (SPEC_BASE, _parse_spec),
    "suite": ({"name": "s", "fidelity": {"rows": 2, "row_tokens": 64}}, _parse_suite),
    "plan": ({"rules": [], "kv": {"key_format": "int8", "value_format": "int8"}}, _parse_plan),
}


@pytest.mark.parametrize(
    ("kind", "path", "value", "named"),
    HAND_BOUNDS,
    ids=[f"{k}-{'.'.join(p)}={v}" for k, p, v, _ in HAND_BOUNDS],
)
def test_schema_bounds_are_refused(kind, path, value, named) -> None:
    doc, parse = BASES[kind]
    parse(doc)  # the base is valid
    with pytest.raises(ValueError) as err:
        parse(perturbed(doc, path, value))
    assert "\n" not in str(err.value) and named in str(err.value), str(err.value)
