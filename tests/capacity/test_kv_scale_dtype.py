"""KV scale storage (`kv.scale_dtype`): plan validation, fingerprints, exact bytes, CLI lines.

The byte figures are arithmetic on Llama-3.1-8B (32 layers, 8 KV heads, head_dim 128, pages
of 16 tokens): per token, keys per channel hold 32 x 8 x 128 / 16 = 2,048 scales, values per
token hold 32 x 8 x (128 / group) scales (int4 group 128: 256; int2 group 32: 1,024).
"""

from __future__ import annotations

import json

import pytest

from tenantq.capacity import Deployment, budget, get_model_config
from tenantq.quant.plan import KVPlan, QuantPlan, Rule
from tenantq.storage.kv import kv_storage

LLAMA = "llama-3.1-8b"
KEY_SCALES_PER_TOKEN = 32 * 8 * 128 // 16  # 2,048
INT4_CODES_PER_TOKEN_BYTES = 2 * 32 * 8 * 128 // 2  # K and V, 2 codes a byte: 32,768
INT2_CODES_PER_TOKEN_BYTES = 2 * 32 * 8 * 128 // 4  # 4 codes a byte: 16,384


def _per_token(kv: str, scale_dtype: str, page_tokens: int = 16) -> float:
    plan = QuantPlan.uniform("bf16", kv, kv_scale_dtype=scale_dtype)
    deployment = Deployment.of("tpu-v6e", 1, page_tokens=page_tokens)
    return budget(get_model_config(LLAMA), plan, deployment, 8192).kv_bytes_per_token


@pytest.mark.parametrize(
    ("kv", "scale_dtype", "scale_bytes", "expected"),
    [
        # int4: 2,048 key scales + 256 value scales per token
        ("int4", "float32", 4, INT4_CODES_PER_TOKEN_BYTES + (2048 + 256) * 4),  # 41,984
        ("int4", "bf16", 2, INT4_CODES_PER_TOKEN_BYTES + (2048 + 256) * 2),  # 37,376
        ("int4", "e8m0", 1, INT4_CODES_PER_TOKEN_BYTES + (2048 + 256) * 1),  # 35,072
        # int2: a zero point beside every scale (2,048 + 1,024 of each)
        ("int2", "float32", 4, INT2_CODES_PER_TOKEN_BYTES + (2048 + 1024) * 2 * 4),  # 40,960
        ("int2", "bf16", 2, INT2_CODES_PER_TOKEN_BYTES + (2048 + 1024) * 2 * 2),  # 28,672
    ],
)
def test_kv_bytes_per_token_on_llama_8b_are_the_arithmetic(kv, scale_dtype, scale_bytes, expected):
    assert _per_token(kv, scale_dtype) == expected


def test_longer_pages_are_key_scales_over_more_tokens_up_to_the_format_group():
    # Keys per channel: one scale per (head, channel) per page, grouped along the tokens in the
    # format's group (int4 128, int2 32 as KIVI). int4 at 64-token pages: 2,048 / 4 = 512 key
    # scales per token, values unchanged: 32,768 + (512 + 256) x 2 B.
    assert _per_token("int4", "bf16", page_tokens=64) == INT4_CODES_PER_TOKEN_BYTES + 768 * 2
    # int2 at 32-token pages: 1,024 key scales per token; at 64 still 1,024 (two groups of 32
    # in a page): 16,384 + (1,024 + 1,024) x (2 B scale + 2 B zero point).
    for page in (32, 64):
        assert _per_token("int2", "bf16", page_tokens=page) == INT2_CODES_PER_TOKEN_BYTES + 2048 * 4
    # ... while the residual window (bf16 keys, one page per sequence slot) grows with the
    # page: 32 layers x 64 tokens x 8 heads x 128 x 2 B = 4 MiB per tenant instead of 1 MiB.
    plan = QuantPlan.uniform("bf16", "int4", kv_scale_dtype="bf16")
    config = get_model_config(LLAMA)
    for page, slot in ((16, 1 << 20), (64, 4 << 20)):
        b = budget(config, plan, Deployment.of("tpu-v6e", 1, page_tokens=page), 8192)
        assert b.tenant_slot_bytes_per_chip == slot


def test_fp8_default_stays_65536_bytes_per_token_plus_its_static_bytes():
    # The figure: fp8 keys and values per tensor, no scale bytes per token; static
    # scales are 2 x 4 B + 2 x 8 B clip counters per layer = 24 B x 32 layers = 768 B.
    b = budget(get_model_config(LLAMA), QuantPlan.uniform("bf16", "fp8_e4m3"),
               Deployment.of("tpu-v6e", 1), 8192)  # fmt: skip
    assert b.kv_bytes_per_token == 65_536
    assert b.kv_static_bytes_per_chip == 768


def test_storage_arrays_carry_the_scale_dtype():
    config = get_model_config(LLAMA)
    plan = QuantPlan(kv=KVPlan("int2", "channel", "int4", "token", scale_dtype="bf16"))
    layer = kv_storage(config, plan, 16)[0]
    keys = {a.name: (a.dtype, a.itemsize) for a in layer.arrays(layer.kv.keys)}
    values = {a.name: (a.dtype, a.itemsize) for a in layer.arrays(layer.kv.values)}
    assert keys["scales"] == keys["zero_points"] == ("bfloat16", 2)
    assert values["scales"] == ("bfloat16", 2)
    plan = QuantPlan(kv=KVPlan("int8", "channel", "int8", "token", scale_dtype="e8m0"))
    layer = kv_storage(config, plan, 16)[0]
    assert {a.name: a.dtype for a in layer.arrays(layer.kv.keys)}["scales"] == "uint8"


# ------------------------------------------------------------------ validation, fingerprints
@pytest.mark.parametrize(
    ("kv", "message"),
    [
        ({"key_format": "int4", "value_format": "int4", "scale_dtype": "fp16"},
         "kv.scale_dtype: unknown scale dtype 'fp16'; valid scale dtypes: float32, bf16, e8m0"),
        ({"key_format": "int2", "value_format": "int2", "scale_dtype": "e8m0"},
         "kv.scale_dtype: 'e8m0' is a power-of-two scale for symmetric formats; int2"),
        ({"key_format": "mxfp4", "value_format": "int4", "scale_dtype": "bf16"},
         "kv.scale_dtype: 'bf16' replaces float32 page/token scales; mxfp4 fixes its own"),
        ({"key_format": "fp8_e4m3", "key_axis": "tensor", "value_format": "fp8_e4m3",
          "value_axis": "tensor", "scale_dtype": "bf16"},
         "kv.scale_dtype: 'bf16' applies to page/token scales, and no quantized KV tensor"),
        ({"scale_dtype": "e8m0"}, "no quantized KV tensor has them"),
    ],
)  # fmt: skip
def test_bad_scale_dtypes_are_one_line_errors(kv, message):
    with pytest.raises(ValueError) as err:
        QuantPlan.from_dict({"kv": kv})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_layer_override_to_int2_refuses_e8m0_too():
    with pytest.raises(ValueError, match="int2 .asymmetric"):
        KVPlan("int4", "channel", "int4", "token", layer_formats=((0, "int2", "int4"),),
               scale_dtype="e8m0")  # fmt: skip


def test_static_axes_beside_a_scaled_tensor_are_allowed():
    # keys static per tensor (float32 static scale), values per token in bf16 scales
    kv = KVPlan("int8", "tensor", "int4", "token", scale_dtype="bf16")
    layer = kv_storage(get_model_config(LLAMA), QuantPlan(kv=kv), 16)[0]
    static = [a for a in layer.arrays(layer.kv.keys) if a.name == "static_scale"]
    assert [a.dtype for a in static] == ["float32"]


def test_default_scale_dtype_keeps_plan_json_and_fingerprints_unchanged():
    # Fingerprints computed with main at 277839c (before kv.scale_dtype existed): a plan that
    # does not set it must hash the same, so earlier studies' caches and records stay valid.
    plans = {
        "2d270eac479a8377": QuantPlan(),
        # QuantPlan.uniform("int4", "int4") before bf16 became int4's default scale dtype
        "1ed28a5bbf1385c2": QuantPlan(
            rules=(Rule(".*", "int4"),), kv=KVPlan("int4", "channel", "int4", "token")
        ),
        "473d019029a714e7": QuantPlan.uniform("fp8_e4m3", "fp8_e4m3"),
        "86ea1bb78a0e6fe8": QuantPlan(
            kv=KVPlan("int2", "channel", "int2", "token", sink_tokens=4, bf16_layers=(0, -1))
        ),
    }
    for fingerprint, plan in plans.items():
        assert plan.fingerprint() == fingerprint
        assert "scale_dtype" not in plan.to_dict()["kv"]
    # the uniform int4 plan now names bf16 scales: another plan, another fingerprint
    assert QuantPlan.uniform("int4", "int4").fingerprint() != "1ed28a5bbf1385c2"
    same = QuantPlan.uniform("int4", "int4", kv_scale_dtype="float32")
    assert same.fingerprint() == "1ed28a5bbf1385c2"


@pytest.mark.parametrize("scale_dtype", ["bf16", "e8m0"])
def test_scale_dtype_round_trips_through_json_and_toml(scale_dtype):
    plan = QuantPlan(kv=KVPlan("int4", "channel", "fp8_e4m3", "token", scale_dtype=scale_dtype))
    assert QuantPlan.from_json(plan.to_json()) == plan
    assert QuantPlan.from_toml(plan.to_toml()) == plan
    assert json.loads(plan.to_json())["kv"]["scale_dtype"] == scale_dtype


# ------------------------------------------------------------------ CLI
def test_cli_states_the_scale_lines_in_their_dtype(cli):
    rc, out, _ = cli(["--model", LLAMA, "--hardware", "tpu-v6e", "--context", "8192",
                      "--kv", "int2", "--kv-scale-dtype", "bf16"])  # fmt: skip
    assert rc == 0
    assert "V int2/token (bf16 scales)" in out
    # per page of 16 tokens in one layer: 1 x 8 x 128 key scales, 16 x 8 x 4 value scales
    assert "K scales: 1,024 x 2 B (bfloat16) = 2,048 B per page" in out
    assert "K zero points: 1,024 x 2 B (bfloat16) = 2,048 B per page" in out
    assert "V scales: 512 x 2 B (bfloat16) = 1,024 B per page" in out
    assert "28,672 B" in out  # KV per token (the arithmetic above)
    rc, out, _ = cli(["--model", LLAMA, "--hardware", "tpu-v6e", "--context", "8192",
                      "--kv", "int4", "--kv-scale-dtype", "e8m0", "--json"])  # fmt: skip
    assert rc == 0 and json.loads(out)["kv_bytes_per_token"] == 35_072


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kv", "int2", "--kv-scale-dtype", "e8m0"], "--kv-scale-dtype: kv.scale_dtype: 'e8m0'"),
        (["--kv-scale-dtype", "bf16"], "--kv-scale-dtype applies with --kv"),
    ],
)
def test_cli_refuses_a_scale_dtype_that_cannot_apply(cli, extra, message):
    rc, _, err = cli(["--model", LLAMA, "--hardware", "tpu-v6e", "--context", "8192", *extra])
    assert rc == 2 and message in err and err.count("\n") == 1


def test_uniform_plans_default_to_bf16_scales_for_int4_and_int2_only():
    # DEFAULT_KV_SCALE_DTYPES, chosen on the quick suite (README "KV scale storage"); a KV plan
    # that names no scale dtype stays float32 (its fingerprint unchanged, test above).
    for kv, wanted in (("int4", "bf16"), ("int2", "bf16"), ("fp8_e4m3", "float32"),
                       ("int8", "float32"), ("mxfp4", "float32"), ("bf16", "float32")):  # fmt: skip
        assert QuantPlan.uniform("bf16", kv).kv.scale_dtype == wanted, kv
    assert KVPlan("int4", "channel", "int4", "token").scale_dtype == "float32"
    assert QuantPlan.uniform("bf16", "int4", kv_scale_dtype="float32").kv.scale_dtype == "float32"


def test_cli_kv_int4_states_the_default_bf16_scales(cli):
    args = ["--model", LLAMA, "--hardware", "tpu-v6e", "--context", "8192", "--json"]
    rc, out, _ = cli([*args, "--kv", "int4"])
    assert rc == 0 and json.loads(out)["kv_bytes_per_token"] == 37_376  # the bf16 row above
    rc, out, _ = cli([*args, "--kv", "int4", "--kv-scale-dtype", "float32"])
    assert rc == 0 and json.loads(out)["kv_bytes_per_token"] == 41_984
