"""The one text-table renderer (tenantq.model.terminal.text_table)."""

from __future__ import annotations

from tenantq.model.terminal import text_table


def test_columns_take_their_widest_cell_and_trailing_spaces_go():
    lines = text_table(
        ["name", "bits"], [["int4", "4.25"], ["fp8_e4m3", "8"]], right={1}, rule=True
    )
    assert lines == ["name      bits", "--------------", "int4      4.25", "fp8_e4m3     8"]


def test_fixed_widths_pad_like_an_f_string_and_keep_a_wider_cell_whole():
    # The capacity compare table's contract: f"{x:>6}" never cuts x, so neither may the table.
    lines = text_table(None, [["a", "1234567"], ["bb", "1"]], widths=[3, 6], right=True, sep=" ")
    assert lines == [f"{'a':>3} {'1234567':>6}", f"{'bb':>3} {'1':>6}"]
    assert text_table(["x"], [["y"]], indent="  ") == ["  x", "  y"]


def test_a_table_without_head_or_rows_is_no_lines():
    # A caller with nothing to show (no head, no rows) gets no lines, not an IndexError; a
    # head alone is its own line (and its rule), as the old per-command renderers printed it.
    assert text_table(None, []) == []
    assert text_table(None, [], widths=[3]) == []
    assert text_table(["a", "bb"], [], rule=True) == ["a  bb", "-----"]


def test_a_left_aligned_last_column_leaves_no_trailing_spaces():
    # The front table's last column (kv) is left-aligned: padding a short cell to the column
    # width must not leave spaces at the end of its line (the old renderer's rstrip).
    assert text_table(["plan", "kv"], [["a", "int8"], ["bb", "-"]], indent="  ") == [
        "  plan  kv",
        "  a     int8",
        "  bb    -",
    ]
