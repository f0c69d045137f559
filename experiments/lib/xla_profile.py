"""Where a JAX program's time goes on XLA:CPU, op by op: a jax.profiler trace joined with XLA's
dump of the optimised programs (the HLO XLA:CPU actually ran).

  with xla_profile.traced(trace_dir):       # XLA_FLAGS must carry dump_flags(dump_dir) before
      run_the_work()                        # jax is imported (the dump is written at compile)
  rows = xla_profile.op_rows(trace_dir, dump_dir)

The trace has one event per executed thunk (an HLO instruction of the entry computation or of a
loop body: a fusion, a dot, a copy, a sort...) named by its instruction and tagged with its
program's id; the dump, module_<id>.<name>.cpu_after_optimizations.txt, says what that instruction
is: its opcode, the dots inside it with their operand dtypes (bfloat16 operands reach the dot
kernel as bfloat16; float32 operands fed by a convert from bfloat16 were upcast by XLA), and the
source line of the JAX code that made it (the innermost frame in sparserl_jax). Control-flow thunks
(while, conditional, call) contain the others and are left out of every sum.

Used by experiments/bench/profile_cpu.py; reads no JAX state (only files), so a test can run it on
any small program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import math
import os
import re
from collections import defaultdict

CONTROL = ("while", "conditional", "call")  # thunks that run others: their time is their children's
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([\w\-]+)\((.*)$")
_COMP = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_SHAPE = re.compile(r"^(\w+)\[([\d,]*)\]")
_TABLE = re.compile(r"^(\d+)\s+(.*)$")


def dump_flags(dump_dir: str) -> str:
    """The XLA_FLAGS that write every compiled program's optimised HLO as text to `dump_dir`."""
    return f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text"


@contextlib.contextmanager
def traced(trace_dir: str):
    """A jax.profiler trace of the block, written under `trace_dir`."""
    import jax

    jax.profiler.start_trace(trace_dir)
    try:
        yield
    finally:
        jax.profiler.stop_trace()


@dataclasses.dataclass(frozen=True)
class Dot:
    lhs: str  # dtype[dims] of each operand as the dot reads it
    rhs: str
    out: str
    flops: int
    upcast: bool  # an operand is a float32 convert of a bfloat16 value (XLA widened it)


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    opcode: str
    type: str
    source: str  # "file.py:function:line" of the innermost sparserl_jax frame (< its caller's), else any
    op_name: str  # JAX's op path (metadata op_name; a fusion's: its root's)
    inner_op_names: str  # every op path inside a fusion, space-separated
    dots: tuple[Dot, ...]


def _shape(t: str) -> tuple[str, tuple[int, ...]] | None:
    m = _SHAPE.match(t)
    if not m:
        return None
    return m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)


def _dims(attrs: str, key: str) -> tuple[int, ...]:
    m = re.search(key + r"=\{([\d,]*)\}", attrs)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


class Module:
    """One dumped program: its instructions by name (every computation), with their dots and
    source lines resolved."""

    def __init__(self, text: str):
        self.name = text.split()[1].rstrip(",") if text.startswith("HloModule") else "?"
        tables, section = defaultdict(dict), None
        comps: dict[str, list[tuple]] = {}
        current = None
        for line in text.splitlines():
            if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
                section = line
                continue
            if section and (m := _TABLE.match(line)):
                tables[section][int(m.group(1))] = m.group(2)
                continue
            section = None
            if m := _COMP.match(line):
                current = comps.setdefault(m.group(1), [])
                continue
            if current is not None and (m := _INSTR.match(line)):
                current.append(m.groups())
        self._files = {k: v.strip('"') for k, v in tables["FileNames"].items()}
        self._funcs = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
        self._locs = {k: dict(re.findall(r"(\w+)=(\d+)", v)) for k, v in tables["FileLocations"].items()}
        self._frames = {k: dict(re.findall(r"(\w+)=(\d+)", v)) for k, v in tables["StackFrames"].items()}
        self.instrs: dict[str, Instr] = {}
        self._by_comp = comps
        types = {}  # instruction name -> type (names are unique in a module)
        for instrs in comps.values():
            for name, typ, _, _ in instrs:
                types[name] = typ
        self._types = types
        self._opcodes = {name: op for instrs in comps.values() for name, _, op, _ in instrs}
        self._args = {name: rest for instrs in comps.values() for name, _, _, rest in instrs}
        for instrs in comps.values():
            for name, typ, opcode, rest in instrs:
                called = re.findall(r"calls=%([\w.\-]+)", rest)
                inner = [i for c in called for i in comps.get(c, [])]
                outer = _operands(rest)  # a fusion's parameter(i) reads its i-th operand
                dots = [self._dot(i, outer) for i in ([(name, typ, opcode, rest)] + inner) if i[2] == "dot"]
                meta = rest if not inner else next((i[3] for i in inner if i[2] == "dot"), rest)
                if not dots and inner:  # a fusion's source: its root's (the last instruction)
                    meta = inner[-1][3]
                every = " ".join(_op_name(i[3]) for i in inner)
                self.instrs[name] = Instr(name, opcode, typ, self._source(meta), _op_name(meta), every, tuple(dots))

    def _dot(self, instr: tuple, outer: list[str]) -> Dot:
        """A dot's operand and result types, FLOPs, and whether XLA widened a bfloat16 operand
        (the operand, or the fusion operand its parameter reads, is a convert from bf16)."""
        name, typ, _, rest = instr
        ops = _operands(rest)[:2]
        lhs, rhs = (self._types.get(o, "?") for o in ops)
        out, l_shape = _shape(typ), _shape(lhs)
        contract = _dims(rest, "lhs_contracting_dims")
        k = math.prod(l_shape[1][d] for d in contract) if l_shape else 0
        flops = 2 * math.prod(out[1]) * k if out else 0
        upcast = False
        for o, t in zip(ops, (lhs, rhs)):
            if self._opcodes.get(o) == "parameter" and outer:
                i = int(re.match(r"(\d+)", self._args[o]).group(1))
                o = outer[i] if i < len(outer) else o
            upcast |= t.startswith("f32") and self._widened_from_bf16(o)
        return Dot(_strip_layout(lhs), _strip_layout(rhs), _strip_layout(typ), flops, upcast)

    def _widened_from_bf16(self, name: str) -> bool:
        """Whether `name` is a convert of a bfloat16 value (itself, or a fusion rooted at one)."""
        if self._opcodes.get(name) == "convert":
            src = _operands(self._args[name])
            return bool(src) and self._types.get(src[0], "").startswith("bf16")
        called = re.findall(r"calls=%([\w.\-]+)", self._args.get(name, ""))
        if self._opcodes.get(name) == "fusion" and called and self._by_comp.get(called[0]):
            root = self._by_comp[called[0]][-1]
            if root[2] == "convert":
                return self._widened_from_bf16(root[0])
        return False

    def _source(self, meta: str) -> str:
        """The innermost sparserl_jax frame, with its caller's in another sparserl_jax file after
        " < " (a shared helper's line says little alone); else the innermost frame."""
        m = re.search(r"stack_frame_id=(\d+)", meta)
        frame_id, first, ours, seen = (int(m.group(1)) if m else 0), None, [], set()
        while frame_id and frame_id not in seen and len(ours) < 2:
            seen.add(frame_id)
            frame = self._frames.get(frame_id, {})
            loc = self._locs.get(int(frame.get("file_location_id", 0)), {})
            path = self._files.get(int(loc.get("file_name_id", 0)), "")
            where = f"{_short(path)}:{self._funcs.get(int(loc.get('function_name_id', 0)), '?')}:{loc.get('line', '?')}"
            if "sparserl_jax" in path and (not ours or not ours[0].startswith(_short(path) + ":")):
                ours.append(where)
            first = first or (where if path else None)
            frame_id = int(frame.get("parent_frame_id", 0))
        return " < ".join(ours) if ours else (first or "?")


def _operands(rest: str) -> list[str]:
    """The instruction names an instruction reads (its argument list, before the attributes)."""
    return re.findall(r"%([\w.\-]+)", rest.split(")")[0])


def _op_name(meta: str) -> str:
    m = re.search(r'op_name="([^"]*)"', meta)
    return m.group(1) if m else ""


def _strip_layout(t: str) -> str:
    return re.sub(r"\{[^}]*\}", "", t)


def _short(path: str) -> str:
    i = path.rfind("sparserl_jax/")
    return path[i:] if i >= 0 else os.path.basename(path)


def load_modules(dump_dir: str) -> dict[int, Module]:
    """Every dumped program's optimised HLO, by its program id (the trace's program_id)."""
    out = {}
    for path in glob.glob(os.path.join(dump_dir, "module_*.cpu_after_optimizations.txt")):
        ident = int(os.path.basename(path).split(".")[0].split("_")[1])
        with open(path) as f:
            out[ident] = Module(f.read())
    return out


def thunk_events(trace_dir: str) -> list[tuple[int, str, str, float]]:
    """(program id, module name, instruction, seconds) for every executed thunk in the trace(s)."""
    from jax.profiler import ProfileData

    events = []
    for path in sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)):
        for plane in ProfileData.from_file(path).planes:
            for line in plane.lines:
                for e in line.events:
                    stats = dict(e.stats)
                    if "hlo_op" in stats and "program_id" in stats:
                        events.append(
                            (int(stats["program_id"]), stats["hlo_module"], stats["hlo_op"], e.duration_ns * 1e-9)
                        )
    return events


def category(instr: Instr | None) -> str:
    """What kind of work an executed instruction is (the profile's rows group by it)."""
    if instr is None:
        return "unresolved"
    if instr.dots:
        d = instr.dots[0]
        kind = f"dot {d.lhs.split('[')[0]} x {d.rhs.split('[')[0]} -> {d.out.split('[')[0]}"
        return kind + (" (upcast from bf16)" if any(x.upcast for x in instr.dots) else "")
    op = instr.op_name
    if re.search(r"threefry|random_bits|_gumbel|_uniform|_randint|_bernoulli", f"{op} {instr.inner_op_names}"):
        return "random numbers"
    if instr.opcode in ("sort", "custom-call") or re.search(r"top_k|sort|argsort", op):
        return "sort / top-k"
    if instr.opcode in ("copy", "transpose", "copy-start", "copy-done") or op.endswith(("transpose", "copy")):
        return "copy / layout"
    if re.search(r"dynamic_update_slice|dynamic_slice|scatter|gather|concatenate|pad", op + instr.opcode):
        return "slice / gather / scatter"
    if re.search(r"reduce|argmax|max|sum|cumsum|logsumexp", op + instr.opcode):
        return "reduction"
    return "elementwise"


def op_rows(trace_dir: str, dump_dir: str) -> list[dict]:
    """One row per (program, instruction) that ran: calls, seconds, category, source, dots (with
    FLOPs per call); control-flow thunks left out. Sorted by seconds, largest first."""
    modules = load_modules(dump_dir)
    acc: dict[tuple[int, str], list] = {}
    names = {}
    for pid, module, op, seconds in thunk_events(trace_dir):
        names[pid] = module
        row = acc.setdefault((pid, op), [0, 0.0])
        row[0] += 1
        row[1] += seconds
    rows = []
    for (pid, op), (calls, seconds) in acc.items():
        instr = modules[pid].instrs.get(op) if pid in modules else None
        if instr is not None and instr.opcode in CONTROL:
            continue
        rows.append(
            dict(
                program=names[pid],
                program_id=pid,
                op=op,
                opcode=instr.opcode if instr else "?",
                category=category(instr),
                source=instr.source if instr else "?",
                calls=calls,
                seconds=seconds,
                dots=[dataclasses.asdict(d) for d in instr.dots] if instr else [],
            )
        )
    return sorted(rows, key=lambda r: -r["seconds"])


def by(rows: list[dict], *keys: str) -> list[dict]:
    """Rows summed over everything but `keys` (seconds, calls, FLOPs), largest first."""
    acc: dict[tuple, dict] = {}
    for r in rows:
        k = tuple(r[key] for key in keys)
        a = acc.setdefault(k, {**dict(zip(keys, k)), "seconds": 0.0, "calls": 0, "flops": 0})
        a["seconds"] += r["seconds"]
        a["calls"] += r["calls"]
        a["flops"] += r["calls"] * sum(d["flops"] for d in r["dots"])
    return sorted(acc.values(), key=lambda a: -a["seconds"])
