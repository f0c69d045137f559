"""What the TPU compile table reads from a compiled program's HLO text (`compiled.as_text()`): the
rows a chip's activations and attention scores carry (experiments/lib/hlo_layout.py), the
program's collectives and those inside its while loops' bodies (experiments/lib/hlo_loops.py), and
its largest results; and from XLA's memory-usage report (written with --xla_dump_to), the largest
slices of its buffers and the arrays that share each: what its temporaries are made of. Imports
no JAX: the text is all it reads.
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Iterable

from experiments.lib import hlo_layout, hlo_loops

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4}
DTYPE_BYTES.update({"s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1})
_RESULT = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+[a-z][\w\-]*\(")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z\d]*)\[([\d,]*)\]")


def largest_arrays(hlo_text: str, n: int = 3) -> list[dict]:
    """The `n` largest instruction results of the program by bytes (one chip's arrays), largest
    first: {"array": "f32[6,16,2,5120,5120]", "bytes": ...}."""
    sizes = {}
    for line in hlo_text.splitlines():
        m = _RESULT.match(line)
        for dtype, dims in _ARRAY.findall(m.group(1)) if m else ():
            if dtype in DTYPE_BYTES:
                shape = tuple(int(d) for d in dims.split(",") if d)
                sizes[f"{dtype}[{dims}]"] = math.prod(shape) * DTYPE_BYTES[dtype]
    return [{"array": a, "bytes": b} for a, b in sorted(sizes.items(), key=lambda kv: -kv[1])[:n]]


_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}
_SLICE = re.compile(r"^\s*[\d.]+\w+\(\s*\d+%\);\s*([\d.]+)(\w+);\s*\d+;\s*(\d+);\s*(.*)$")


def memory_report(report_text: str, n: int = 8) -> dict:
    """The default memory space of XLA's memory-usage report (`*after_optimizations-memory-usage-
    report.txt`, written with --xla_dump_to): its total bytes and the `n` largest slices of its
    largest buffer, each with the arrays that share it over the program ({"bytes", "values",
    "shapes"}; a slice's arrays are live at different times)."""
    section = report_text.split("Memory Space:", 2)[1] if "Memory Space:" in report_text else ""
    total = re.search(r"Total bytes: (\d+)", section)
    slices = []
    for line in section.split("\n\n", 1)[0].splitlines():
        m = _SLICE.match(line)
        if m:
            size, unit, values, shapes = m.groups()
            slices.append({"bytes": int(float(size) * _UNITS[unit]), "values": int(values), "shapes": shapes[:300]})
    slices.sort(key=lambda x: -x["bytes"])
    return {"total_bytes": int(total.group(1)) if total else None, "largest": slices[:n]}


def loop_collectives(hlo_text: str) -> dict:
    """The collectives the program's while loops run every iteration: counts by opcode, how many
    move more than a scalar (a stop test's "every row finished?" is one element), and each
    (opcode, shape) with its count (hlo_loops.summary)."""
    found = hlo_loops.while_body_collectives(hlo_text)
    return {
        "by_op": dict(collections.Counter(c.op for c in found)),
        "non_scalar": sum(not c.scalar for c in found),
        "shapes": hlo_loops.summary(found),
    }


def read(hlo_text: str, *, length: int | None, widths: Iterable[int]) -> dict:
    """The table's HLO columns of one program; `length` the rows' token width T for the activation
    and attention rows (None: not read, e.g. the decode loop, whose rows hold one token a step)."""
    out = {
        "collectives": hlo_layout.collective_counts(hlo_text),
        "while_body_collectives": loop_collectives(hlo_text),
        "largest_arrays": largest_arrays(hlo_text),
    }
    if length is not None:
        acts = hlo_layout.activations(hlo_text, length, widths)
        out["activation_rows"] = {
            "rows": acts[0].rows if acts else 0,
            "array": list(acts[0].dims) if acts else None,
            "arrays": len(acts),
            "most_rows": [{"dims": list(a.dims), "rows": a.rows} for a in acts[:8]],  # which arrays hold them
            "arrays_by_rows": dict(collections.Counter(str(a.rows) for a in acts)),
        }
        out["attention_rows"] = hlo_layout.attention_rows_per_device(hlo_text, length)
    return out
