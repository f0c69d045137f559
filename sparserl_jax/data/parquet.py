"""Parquet prompt files read as the rows data/datasets.py parses: one dict per row, nested structs
as dicts and lists of structs (verl's chat `prompt`) as lists of dicts.

verl's gsm8k / MATH preprocessors write `data_source`, `prompt` (chat messages), `ability`,
`reward_model` {style, ground_truth} and `extra_info`; other files have flat question / answer
columns. Only the top-level columns a row is parsed from are read (a file's `extra_info` or
solutions may be large), a batch of rows at a time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

BATCH_ROWS = 1024


def column_names(schema) -> list[str]:
    """Every column of a pyarrow schema, the fields of struct columns dotted (reward_model.ground_truth)."""
    import pyarrow as pa

    out = []

    def walk(name: str, dtype) -> None:
        out.append(name)
        if pa.types.is_struct(dtype):
            for i in range(dtype.num_fields):
                walk(f"{name}.{dtype.field(i).name}", dtype.field(i).type)

    for field in schema:
        walk(field.name, field.type)
    return out


def read_rows(
    path: str | os.PathLike, wanted: Sequence[str], named: Mapping[str, str] = {}
) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row index from 0, row) of a parquet file, each row holding the top-level columns of
    `wanted` (dotted names) that the file has. `named`: setting -> a column the file must have
    (an error names the file, the setting and the file's columns otherwise)."""
    import pyarrow as pa  # imported here: the data package is imported by every run, parquet or not
    import pyarrow.parquet as pq

    path = os.fspath(path)
    try:
        f = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"data.dataset={path!r} is not a readable parquet file ({e})") from None
    names = column_names(f.schema_arrow)
    for setting, column in named.items():
        if column not in names:
            raise ValueError(f"{path}: {setting}={column!r} is no column of the file; its columns: {', '.join(names)}")
    tops = [n for n in f.schema_arrow.names if n in {w.split(".")[0] for w in wanted}]
    i = 0
    for batch in f.iter_batches(batch_size=BATCH_ROWS, columns=tops):
        for row in batch.to_pylist():
            yield i, row
            i += 1
