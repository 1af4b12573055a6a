"""K/V calibration statistics and the static scales derived from them.

The statistics must describe what the cache holds (keys after RoPE): they are checked against
the keys and values a bf16 engine wrote into a contiguous cache on the same windows. Scales
follow from the format's range (fp8: amax / 448, int8: amax / 127, int2: [min, max] / 3).
"""

from __future__ import annotations

import numpy as np
import pytest

from tenantq.engine import Engine
from tenantq.engine.cache import ContiguousCache
from tenantq.model.loader import load_params
from tenantq.quant.kv_calibration import kv_static_scales
from tenantq.quant.plan import KVTensorSpec

BF16_STEP = 2.0**-8  # bf16's relative rounding step: 8 significand bits


@pytest.fixture(scope="module")
def scales(checkpoint, windows, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kvcache")
    first = kv_static_scales(checkpoint, windows, model_id="m", data_hash="d", cache_dir=folder)
    return first, folder


def test_statistics_are_those_of_the_cached_keys_and_values(checkpoint, config, windows, scales):
    # The engine's bf16 forward caches K (after RoPE) and V; per layer and head, their max |x|,
    # min and max over the windows equal the calibration's within bf16's relative step (the
    # two runs are separately compiled programs of the same bf16 arithmetic).
    stats = scales[0].stats
    params = load_params(checkpoint, config)
    cache = ContiguousCache(config, dtype="bfloat16", max_seqs=4, max_seq_tokens=32)
    engine = Engine(config, params, dtype="bfloat16", cache=cache)
    engine.logits(windows)
    for layer, (k_all, v_all) in enumerate(engine.cache.state):
        for name, x in (("keys", k_all), ("values", v_all)):
            x = np.asarray(x, np.float32)  # [slots, tokens, heads, d]
            want = np.abs(x).max(axis=(0, 1, 3))
            got = stats[name]["absmax"][layer]
            assert np.allclose(got, want, rtol=2 * BF16_STEP), (layer, name)
            assert np.allclose(stats[name]["min"][layer], x.min(axis=(0, 1, 3)), rtol=2 * BF16_STEP)
            # the percentile of |x| lies at or below the max
            assert np.all(stats[name]["percentile"][layer] <= got)


def test_second_call_reads_the_cache(checkpoint, windows, scales) -> None:
    first, folder = scales
    assert not first.from_cache and first.tokens == windows.size
    again = kv_static_scales(checkpoint, windows, model_id="m", data_hash="d", cache_dir=folder)
    assert again.from_cache
    assert again.fingerprint() == first.fingerprint()
    other = kv_static_scales(checkpoint, windows[:2], model_id="m", data_hash="e", cache_dir=folder)
    assert not other.from_cache  # another dataset hash is another entry


def test_a_cache_not_every_host_found_is_computed_again(checkpoint, windows, scales) -> None:
    # On a multi-host slice the hosts read a cache only if every host found it (`agree` is
    # engine.sharding.on_every_host there): a host that has the file but is told "not on every
    # host" computes, as the others do, instead of reading and leaving them in a collective.
    first, folder = scales
    asked = []
    again = kv_static_scales(
        checkpoint, windows, model_id="m", data_hash="d", cache_dir=folder,
        agree=lambda found: asked.append(found) or False,
    )  # fmt: skip
    assert asked == [True] and not again.from_cache
    assert again.fingerprint() == first.fingerprint()


def test_scales_follow_the_format_range(scales, config) -> None:
    s = scales[0]
    amax = s.stats["keys"]["absmax"][1]
    scale, zp = s.for_tensor(1, "keys", KVTensorSpec("fp8_e4m3", "tensor"))
    assert zp is None and scale.shape == (1,)
    assert scale[0] == np.float32(amax.max()) / np.float32(448.0)
    scale, _ = s.for_tensor(1, "keys", KVTensorSpec("int8", "head"))
    assert scale.shape == (config.num_kv_heads,)
    assert np.array_equal(scale, amax / np.float32(127.0))
    lo, hi = s.stats["values"]["min"][0], s.stats["values"]["max"][0]
    scale, zp = s.for_tensor(0, "values", KVTensorSpec("int2", "head"))
    assert np.allclose(scale, (hi - lo) / 3) and np.allclose((0 - zp) * scale, lo, atol=1e-6)
    with pytest.raises(ValueError, match="static KV scales apply to axes tensor/head"):
        s.for_tensor(0, "keys", KVTensorSpec("int8", "channel"))
