"""`--resume` refuses a changed spec, except the resumable fields and fields that a later
tenantq added: absent from the stored spec and holding their default (a study begun before an
upgrade resumes; `make demo` resumes the quickstart study that an earlier version began)."""

from __future__ import annotations

import copy

import pytest

from tenantq.search.driver import _check_same_spec
from tenantq.search.spec import load_spec

SPEC = load_spec("experiments/quickstart.toml")


def _stored() -> dict:
    return copy.deepcopy(SPEC.model_dump(mode="json"))


def test_the_same_spec_resumes_and_so_do_trials_and_workers():
    _check_same_spec(_stored(), SPEC)
    stored = _stored()
    stored["study"]["trials"] += 5
    stored["workers"]["count"] = 1
    _check_same_spec(stored, SPEC)


def test_a_field_added_since_at_its_default_is_unchanged():
    stored = _stored()
    del stored["space"]["kv_scale_dtypes"]  # a study stored before the field existed
    _check_same_spec(stored, SPEC)


def test_a_field_added_since_but_set_is_a_change():
    stored = _stored()
    del stored["space"]["kv_scale_dtypes"]
    space = SPEC.space.model_copy(update={"kv_scale_dtypes": ["float32", "bf16"]})
    spec = SPEC.model_copy(update={"space": space})
    with pytest.raises(
        ValueError, match=r"changed since the study began \(space\.kv_scale_dtypes\)"
    ):
        _check_same_spec(stored, spec)


def test_a_changed_value_is_named():
    stored = _stored()
    stored["space"]["weight_formats"] = ["bf16"]
    stored["sampler"]["seed"] = 7
    with pytest.raises(
        ValueError, match=r"\(space\.weight_formats, sampler\.seed\); only study\.trials"
    ):
        _check_same_spec(stored, SPEC)


def _old_default_stored() -> dict:
    """The quickstart spec as the version before capacity_aware stored it (its sampler as in
    a study `make demo` began then: /tmp/rv/stored_quickstart.json)."""
    stored = _stored()
    stored["sampler"] = {"kind": "nsga2", "seed": 0, "population_size": 6}
    return stored


def test_a_study_begun_under_the_old_default_sampler_resumes_with_it(capsys):
    from tenantq.search.samplers import make_sampler
    from tenantq.search.store import keep_stored_sampler

    spec = load_spec("experiments/quickstart.toml")  # names no sampler.kind
    assert spec.sampler.kind == "capacity_aware"
    keep_stored_sampler(spec, _old_default_stored(), "quickstart")
    _check_same_spec(_old_default_stored(), spec)  # no refusal
    assert (spec.sampler.kind, spec.sampler.population_size) == ("nsga2", 6)
    assert type(make_sampler(spec)).__name__ == "NSGAIISampler"
    assert "with its sampler 'nsga2'" in capsys.readouterr().err


def test_a_spec_naming_the_new_sampler_is_still_a_change():
    from tenantq.search.store import keep_stored_sampler

    sampler = SPEC.sampler.model_copy(update={"kind": "capacity_aware"})
    spec = SPEC.model_copy(update={"sampler": sampler})
    assert "kind" in spec.sampler.model_fields_set
    keep_stored_sampler(spec, _old_default_stored(), "quickstart")
    with pytest.raises(ValueError, match=r"\(sampler\.kind, sampler\.population_size\)"):
        _check_same_spec(_old_default_stored(), spec)
