"""`tenantq.model.files.cache_key`, the one key of every on-disk cache entry: the same parts give
the same key in every process (whatever the hash seed or the order the parts were built in),
and parts with no stable text form are refused instead of keyed by an address or a summary."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tenantq.model.files import cache_key

PLATFORM = Path(__file__).resolve().parents[2] / "platform"

_KEY = """
from tenantq.model.files import cache_key
print(cache_key(version=3, model="m", formats={"int4", "nvfp4", "mxfp4", "fp8_e4m3", "int8"},
                suite={"b": [1, 2], "a": {"y": 1.5, "x": None}}))
"""


def test_the_key_is_the_same_in_processes_with_different_hash_seeds():
    # String hashing is salted per process (PYTHONHASHSEED): a set's iteration order, and so
    # str(set), changes between runs, which must not change the key (a cache missed for ever).
    keys = {
        subprocess.run(
            [sys.executable, "-c", _KEY], env={"PYTHONPATH": str(PLATFORM), "PYTHONHASHSEED": seed},
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        for seed in ("1", "2", "3", "4")
    }  # fmt: skip
    assert len(keys) == 1 and len(next(iter(keys))) == 24, keys


def test_the_key_ignores_keyword_and_mapping_order():
    a = cache_key(model="m", suite={"x": 1, "y": [1, 2]})
    assert a == cache_key(suite={"y": [1, 2], "x": 1}, model="m")
    assert a != cache_key(model="m", suite={"x": 1, "y": [2, 1]})  # list order is content
    # plain JSON parts key as before (tenantq.evals.identity.cache_key): existing caches and
    # study fingerprints stay valid
    canon = json.dumps({"model": "m", "suite": {"x": 1, "y": [1, 2]}}, sort_keys=True,
                       separators=(",", ":"))  # fmt: skip
    assert a == hashlib.sha256(canon.encode()).hexdigest()[:24]


def test_large_arrays_are_keyed_by_every_value_not_by_a_printed_summary():
    # str() of a numpy array over 1,000 values elides the middle ("..."): two arrays differing
    # there would share a key.
    a, b = np.zeros(2000), np.zeros(2000)
    b[1000] = 1
    assert cache_key(x=a) != cache_key(x=b)


def test_a_part_with_no_stable_text_form_is_refused_naming_it():
    with pytest.raises(TypeError, match="cache_key part 'engine': object has no stable text form"):
        cache_key(model="m", engine=object())
