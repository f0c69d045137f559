"""The collectives inside a compiled program's while loops, read from its HLO text.

A decode loop that moves data between devices pays for it in every step: this is how the tests
(tests/rollout_layout_worker.py) and the compile tables (the device checks) count what a compiled
sampler's loop holds. `compiled.as_text()` (jax's `jit(f).lower(...).compile()`) is the input: its
computations, each opened by a line `%name (params) -> shape {` (ENTRY for the main one) and closed
by `}`, and its `while` instructions, which name a `condition=` and a `body=` computation. A loop
holds its body and condition and every computation they call, transitively (fusions, reductions'
`to_apply`, a `conditional`'s branches, nested loops).
"""

from __future__ import annotations

import dataclasses
import math
import re

# XLA's collective opcodes; an asynchronous one is counted at its -start (its -done carries it)
COLLECTIVE_OPS = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
    "ragged-all-to-all",
    "collective-broadcast",
)
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?\s*(?:->.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\(")
_CALLS = re.compile(
    r"\b(?:condition|body|calls|to_apply|true_computation|false_computation|branch_computations|"
    r"called_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)
_NAME = re.compile(r"%?([\w.\-]+)")
_NOISE = re.compile(r"\{[\d,]*\}|/\*[^*]*\*/\s*")  # an array's layout ({1,0}), /*index=5*/ comments
_ARRAY = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: its opcode (without -start), result shape as HLO prints it,
    elements of its largest array result, the computation holding it and the while instruction
    whose body or condition runs it (the innermost; None outside every loop)."""

    op: str
    shape: str
    elements: int
    computation: str
    loop: str | None

    @property
    def scalar(self) -> bool:
        """A scalar (or one-element) result: e.g. the "every row finished?" stop test."""
        return self.elements <= 1


def computations(hlo_text: str) -> dict[str, list[str]]:
    """Each computation's instruction lines, by name."""
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and not line.startswith((" ", "\t")):
                current = m.group(1)
                comps[current] = []
        elif line.strip() == "}" and not line.startswith((" ", "\t")):
            current = None
        else:
            comps[current].append(line)
    return comps


def _called(line: str) -> list[str]:
    return [n for group in _CALLS.findall(line) for n in _NAME.findall(group.strip("{}"))]


def _elements(shape: str) -> int:
    arrays = [math.prod(int(d) for d in dims.split(",") if d) for dims in _ARRAY.findall(shape)]
    return max(arrays, default=1)


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective instruction of the program, each once: inside a while loop (its body or
    condition, or any computation they call) under the innermost loop that reaches it, else with
    loop None (run once per call, e.g. before the loop)."""
    comps = computations(hlo_text)
    if not comps:
        raise ValueError(
            "no HLO computations found: expected compiled HLO text (jit(f).lower(...).compile().as_text())"
        )
    reach: dict[str, set[str]] = {}  # while instruction -> the computations it runs
    for comp_lines in comps.values():
        for line in comp_lines:
            m = _INSTRUCTION.match(line)
            if m and m.group(3) == "while":
                reach[m.group(1)] = _reachable(comps, [n for n in _called(line) if n in comps])
    found = []
    for name, comp_lines in comps.items():
        loops = [r for r in reach if name in reach[r]]
        loop = min(loops, key=lambda r: (len(reach[r]), r)) if loops else None
        for line in comp_lines:
            m = _INSTRUCTION.match(line)
            op = m.group(3).removesuffix("-start") if m else None
            if op in COLLECTIVE_OPS:
                found.append(Collective(op, m.group(2), _elements(m.group(2)), name, loop))
    return sorted(found, key=lambda c: (c.loop or "", c.computation, c.op, c.shape))


def while_body_collectives(hlo_text: str) -> list[Collective]:
    """The collectives a while loop of the program runs per iteration (collectives' loop is not
    None). Empty when the loops move nothing between devices."""
    return [c for c in collectives(hlo_text) if c.loop is not None]


def _reachable(comps: dict[str, list[str]], start: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(start)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(n for line in comps[name] for n in _called(line) if n in comps)
    return seen


def summary(collectives: list[Collective]) -> dict[str, int]:
    """Counts by opcode and result shape, e.g. {"all-gather s32[16,2]": 10}: a table's cell."""
    counts: dict[str, int] = {}
    for c in collectives:
        key = f"{c.op} {_NOISE.sub('', c.shape)}"
        counts[key] = counts.get(key, 0) + 1
    return counts
