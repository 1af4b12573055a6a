"""The sensitivity profile's table on disk: reading it back and the one check every reader runs.

`tenantq sensitivity` (evals.sensitivity) writes the table: one row per tensor (or KV layer,
`kv/{i}`) and format with its mean KL. The search's sensitivity space and the study report
both read it here, so a damaged or foreign profile fails the same way for each.
"""

from __future__ import annotations

from pathlib import Path


def read_profile_table(path: str | Path, num_layers: int | None = None):
    """The table `tenantq sensitivity` writes (Parquet, or Arrow IPC for any other suffix),
    checked by `check_profile_table` (the one check every reader of a profile calls)."""
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.is_file():
        what = "is a folder" if p.is_dir() else "does not exist"
        raise ValueError(f"sensitivity profile {p} {what}; give a file `tenantq "
                         "sensitivity --out` wrote")  # fmt: skip
    import pyarrow as pa

    kind = "Parquet" if p.suffix == ".parquet" else "Arrow IPC (Feather)"
    try:
        table = pq.read_table(p) if p.suffix == ".parquet" else feather.read_table(p)
    except (pa.ArrowException, OSError) as err:  # ArrowInvalid on a damaged or foreign file
        raise ValueError(
            f"sensitivity profile {p}: cannot read it as {kind} ({err}); give the table "
            "`tenantq sensitivity --out` wrote (.parquet, or Arrow IPC for other suffixes)"
        ) from None
    check_profile_table(table, p, num_layers)
    return table


def check_profile_table(table, path: str | Path, num_layers: int | None = None) -> None:
    """A profile's columns (tensor, format, kl_mean), its KL values (finite and >= 0: a NaN
    would rank a tensor least sensitive and quantize it first), its KV rows (`kv/{i}` as
    `tenantq sensitivity` writes them, with 0 <= i < num_layers when the model is known) and
    one row per tensor and format (two KLs for one unit contradict each other, and `kv/01`
    beside `kv/1` would rank one layer twice); with a `tensor_class` column, one row per
    tensor, class and format (`tenantq sensitivity --kv` writes a KV layer's keys and values
    as two rows of `kv/{i}`). One ValueError line naming the row."""
    import math

    seen: dict[tuple[str, str, object], float] = {}

    need = {"tensor", "format", "kl_mean"}
    if not need <= set(table.column_names):
        raise ValueError(
            f"sensitivity profile {path}: needs columns {sorted(need)}, has {table.column_names}"
        )
    tensors = table.column("tensor").to_pylist()
    # A class that is no string (a foreign column) counts as none: its rows stay one per
    # tensor and format.
    classes = [
        c if isinstance(c, str) else None
        for c in (
            table.column("tensor_class").to_pylist()
            if "tensor_class" in table.column_names
            else [None] * len(tensors)
        )
    ]
    for tensor, fmt, kl, cls in zip(
        tensors, table.column("format").to_pylist(), table.column("kl_mean").to_pylist(),
        classes, strict=True,
    ):  # fmt: skip
        if not isinstance(tensor, str) or not tensor:
            raise ValueError(f"sensitivity profile {path}: a row has tensor {tensor!r}; "
                             "expected a tensor path or kv/LAYER")  # fmt: skip
        if not isinstance(fmt, str) or not fmt:
            raise ValueError(
                f"sensitivity profile {path}: row {tensor!r} has format {fmt!r}; "
                "expected the format it was measured at (int4, mxfp4, ...)"
            )
        # bool is an int to Python: a true/false column is no KL (it would read as 1 and 0)
        if (
            not isinstance(kl, int | float)
            or isinstance(kl, bool)
            or not math.isfinite(kl)
            or kl < 0
        ):
            raise ValueError(
                f"sensitivity profile {path}: kl_mean of {tensor} ({fmt}) is {kl!r}; a KL "
                "is a finite number >= 0 (re-measure it with `tenantq sensitivity`)"
            )
        if tensor.startswith("kv/"):
            index = tensor[3:]
            # ASCII digits without a leading zero: str.isdigit() also takes '²' and '٣'. No
            # int() of an index longer than the layer count: past 4,300 digits int() raises
            # its own ValueError, which names neither the profile nor the row.
            canonical = index.isascii() and index.isdigit() and (index == "0" or index[0] != "0")
            if not canonical or (
                num_layers is not None
                and (len(index) > len(str(num_layers)) or int(index) >= num_layers)
            ):
                valid = f"kv/0..kv/{num_layers - 1}" if num_layers else "kv/LAYER (0, 1, ...)"
                raise ValueError(
                    f"sensitivity profile {path}: row {tensor!r} names no KV layer of the "
                    f"model ({num_layers} layers); valid rows: {valid} (was it measured on "
                    "another model?)"
                )
        if (tensor, fmt, cls) in seen:
            unit = tensor if cls is None else f"{tensor} {cls}"
            raise ValueError(
                f"sensitivity profile {path}: {unit} ({fmt}) has two rows (kl_mean "
                f"{seen[tensor, fmt, cls]!r} and {kl!r}); a profile has one row per tensor "
                "and format"
            )
        seen[tensor, fmt, cls] = kl
