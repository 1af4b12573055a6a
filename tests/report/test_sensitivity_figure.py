"""The sensitivity heatmap places each profile row in its (layer, tensor class) cell, per format,
with a KV layer's keys and values in cells of their own (fast: no study, no browser)."""

from __future__ import annotations

import pyarrow as pa

from tenantq.report.figures import sensitivity_figure


def _profile(rows):
    names = ("tensor", "format", "kl_mean", "tensor_class")
    return pa.table({n: [r[i] for r in rows] for i, n in enumerate(names)})


def test_each_row_lands_in_its_layer_and_class_cell():
    table = _profile(
        [
            ("layers/0/attn/q_proj", "int4", 0.5, "q_proj"),
            ("layers/1/attn/q_proj", "int4", 0.25, "q_proj"),
            ("layers/1/mlp/down_proj", "int4", 2.0, "down_proj"),
            ("kv/0", "int4", 7.0, "keys"),
            ("kv/0", "int4", 3.0, "values"),
            ("embed", "int4", 9.0, "embed"),  # not a layer cell: not drawn in the grid
            ("layers/0/attn/q_proj", "fp8_e4m3", 0.125, "q_proj"),
        ]
    )
    fig = sensitivity_figure(table)
    assert fig is not None
    panels = {t.hovertemplate.split(" ")[0]: t for t in fig.data}
    assert set(panels) == {"fp8_e4m3", "int4"}
    int4 = panels["int4"]
    cell = {
        (int(y), x): z
        for y, row in zip(int4.y, int4.z, strict=True)
        for x, z in zip(int4.x, row, strict=True)
    }
    assert cell[(0, "attn/q_proj")] == 0.5 and cell[(1, "attn/q_proj")] == 0.25
    assert cell[(1, "mlp/down_proj")] == 2.0
    assert cell[(0, "kv/keys")] == 7.0 and cell[(0, "kv/values")] == 3.0
    assert cell[(0, "mlp/down_proj")] is None and cell[(1, "kv/keys")] is None
    assert 9.0 not in [z for row in int4.z for z in row]


def test_no_profile_or_no_layer_rows_draws_nothing():
    assert sensitivity_figure(None) is None
    assert sensitivity_figure(_profile([("embed", "int4", 1.0, "embed")])) is None
