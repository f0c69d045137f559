"""How a compiled program lays its activations out per device, and what it moves between devices,
read from its HLO text (`jax.jit(f).lower(...).compile().as_text()`, any backend: CPU, GPU, TPU).

A data-parallel (FSDP) program gives each device B / (data x fsdp) rows: every token activation it
holds, [rows, T, D] or [rows, T, F] in any dim order or flattened ([rows * T, D]), has that many
rows, and the weights reach it through all-gathers. A program that split the model dim instead
holds every row ([B, T, D / fsdp]) and reduces with all-reduces. The tests
(tests/fsdp_layout_worker.py) and the TPU compile table (experiments/device/tpu_hlo.py) read these
numbers the same way.

Reading rule: every array shape printed in the text (results and operands, tuple elements
included), its size-1 dims dropped, is looked at; a token activation is [rows, T, width] in any
dim order, or [rows * T, width], with width one of `widths` (D, F). Arrays of more dims (heads
[B, T, N, H], XLA's merged gate and up [B, T, 2, F]) are not read: their extra dim is no row.
Pick T so that it divides no weight dim and equals no width (the toy models' T = 48; Qwen's
5120), else a weight reads as rows.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Iterable

from experiments.lib.hlo_loops import COLLECTIVE_OPS

_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")  # f32[2,48,64] (its layout {2,1,0} follows)
# a collective instruction: its result type, then the opcode (async ones counted at their -start)
_COLLECTIVE = re.compile(r"=\s*(.+?)\s+(" + "|".join(COLLECTIVE_OPS) + r")(?:-start)?\(")


def arrays(text: str) -> list[tuple[int, ...]]:
    """The dims of every array shape printed in `text` (scalars as ())."""
    return [tuple(int(d) for d in dims.split(",") if d) for _, dims in _ARRAY.findall(text)]


@dataclasses.dataclass(frozen=True)
class Activation:
    """A token activation a device holds: its dims and its rows (elements / (T x width))."""

    dims: tuple[int, ...]
    rows: int


def activations(hlo_text: str, length: int, widths: Iterable[int]) -> list[Activation]:
    """Every distinct token activation of the program (module doc's rule), most rows first."""
    widths = set(widths)
    found = set()
    for dims in set(arrays(hlo_text)):
        rows = _rows(tuple(d for d in dims if d != 1), length, widths)
        if rows:
            found.add(Activation(dims, rows))
    return sorted(found, key=lambda a: (-a.rows, a.dims))


def _rows(dims: tuple[int, ...], length: int, widths: set[int]) -> int:
    """The rows of a token activation [rows, T, width] (any order) or [rows * T, width]; 0 if not one."""
    for i, w in enumerate(dims):
        if w not in widths:
            continue
        rest = dims[:i] + dims[i + 1 :]
        if len(rest) == 1 and rest[0] % length == 0:
            return rest[0] // length
        if len(rest) == 2 and length in rest:
            return rest[1] if rest[0] == length else rest[0]
    return 0


def activation_rows_per_device(hlo_text: str, length: int, widths: Iterable[int]) -> int:
    """The most rows any token activation of the program holds on one device (0 if none): B / (data
    x fsdp) for a data-parallel program, B where every device holds the whole batch."""
    found = activations(hlo_text, length, widths)
    return found[0].rows if found else 0


def attention_rows_per_device(hlo_text: str, length: int) -> int:
    """The most (row, head) pairs of [T, T] attention scores one array holds (0 if none: a fused or
    blockwise attention keeps them in blocks): B / (data x fsdp) x N / tensor when both are split."""
    pairs = [math.prod(d) // length**2 for d in arrays(hlo_text) if sum(x == length for x in d) >= 2]
    return max(pairs, default=0)


def collective_counts(hlo_text: str) -> dict[str, int]:
    """Collective instructions by opcode, e.g. {"all-gather": 14, "all-reduce": 5}; every opcode
    of hlo_loops.COLLECTIVE_OPS is a key (0 where absent). A combined collective (XLA's combiners
    merge several into one tuple-shaped instruction) counts once."""
    counts = collections.Counter(op for _, op in _COLLECTIVE.findall(hlo_text))
    return {op: counts.get(op, 0) for op in COLLECTIVE_OPS}


def gathered_arrays(hlo_text: str) -> list[tuple[int, ...]]:
    """The dims of every array the program's all-gathers produce (each element of a combined one;
    an asynchronous all-gather-start's result lists its operand, the local shard, too)."""
    return [dims for result, op in _COLLECTIVE.findall(hlo_text) if op == "all-gather" for dims in arrays(result)]
