"""Checks of plain values that every package makes: one wording, one place.

A count (`page_tokens`, `tp`, `batch`, tenants) is an int >= 1 and never a bool (`True` is an
int to Python, not a count). It lives in `model` (pure Python, no JAX) because quant, engine
and capacity all check counts and all import `model`.
"""

from __future__ import annotations

import numbers
from typing import Any


def check_positive_int(name: str, value: Any, *, numpy_ints: bool = False) -> None:
    """Raise `ValueError("{name} must be a positive integer, got {value!r}")` unless `value` is
    an int >= 1 (a numpy integer too with `numpy_ints`); a bool is never a count."""
    kinds = numbers.Integral if numpy_ints else int  # numpy registers its ints as Integral
    if isinstance(value, bool) or not isinstance(value, kinds) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def validation_line(err: Any, model: Any, *, source: str = "", prefix: str = "") -> str:
    """The first problem of a pydantic `ValidationError` raised by `model`, as one line.

    The one wording of every config error (plans, study specs, suites): `source` (a file or
    "spec"), then the dotted location (`prefix` + pydantic's), then what is wrong:
    `unknown key 'x'; valid keys here: a, b`, `required key 'x' is missing`,
    `unknown format 'x'; valid formats: a, b` (a choice), or pydantic's message with the
    value given, `(got ...)`; `(and N more)` when pydantic found several problems.
    """
    errors = err.errors()
    e = errors[0]
    loc = tuple(e["loc"])
    key = str(loc[-1]) if loc else ""
    kind = e["type"]
    msg = e["msg"].removeprefix("Value error, ")
    if kind == "extra_forbidden":
        valid = ", ".join(_fields_at(model, loc[:-1])) or "see the schema"
        loc, msg = loc[:-1], f"unknown key {key!r}; valid keys here: {valid}"
    elif kind == "missing":
        loc, msg = loc[:-1], f"required key {key!r} is missing"
    elif kind == "literal_error":
        valid = e["ctx"]["expected"].replace("'", "").replace(" or ", ", ")
        names = [str(x) for x in loc if not isinstance(x, int)]  # a list's item: its list
        name = names[-1] if names else "value"
        if isinstance(loc[-1], int):
            name = name[:-4] + "axis" if name.endswith("axes") else name.removesuffix("s")
        noun = "format" if name.endswith("format") else name.replace("_", " ")
        nouns = noun[:-2] + "es" if noun.endswith("is") else noun + "s"  # axis -> axes
        msg = f"unknown {noun} {e['input']!r}; valid {nouns}: {valid}"
    elif "input" in e and not isinstance(e["input"], dict | list | tuple):
        msg = f"{msg} (got {e['input']!r})"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more)"
    where = ".".join(p for p in (prefix, *(str(x) for x in loc)) if p)
    return ": ".join(p for p in (source, where, msg) if p)


def _fields_at(model: Any, loc: tuple) -> list[str]:
    """The keys valid at `loc` (a pydantic error location) of `model`, a pydantic model
    class; [] where the location is not a model (a free-form table)."""
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        found = None
        ann = field.annotation
        for cand in (ann, *getattr(ann, "__args__", ())):
            for inner in (cand, *getattr(cand, "__args__", ())):
                if isinstance(inner, type) and hasattr(inner, "model_fields"):
                    found = inner
        if found is None:
            return []
        model = found
    return list(model.model_fields)
