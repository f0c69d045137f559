"""The TPU compile table's rows and their markdown: one compiled program's record (XLA's memory
plan, what the trainer holds beside it, the chip's total against its HBM, the dry run's phase
beside it, what its HLO holds) and the tables tpu_compile.py writes. Imports no JAX: a row is built
from a compiled program's memory analysis and HLO text.
"""

from __future__ import annotations

import re

from experiments.device import tpu_hlo
from experiments.lib import figprov, hlo_loops

GIB = 1024**3
MEMORY = ("argument", "output", "alias", "temp", "generated_code")  # compiled.memory_analysis()'s, in bytes
PHASE = {"update": "update", "score": "score", "decode": "rollout"}  # the dry run's phase of each program
# XLA:TPU's refusals of a program larger than the chip: (what it needed, what the chip has), in its G
_OOM = (
    re.compile(r"HLO temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)"),
    re.compile(r"Used ([\d.]+)G of ([\d.]+)G hbm"),
)


def oom(message: str) -> dict | None:
    """XLA's refusal of a program too large for the chip, as {"needed_g", "available_g"}."""
    for pattern in _OOM:
        m = pattern.search(message)
        if m:
            return {"needed_g": float(m.group(1)), "available_g": float(m.group(2))}
    return None


def refused(message: str) -> dict:
    """A row's columns for a program XLA did not compile: the message, and whether it was the chip's
    memory (fits False) or another error (fits None)."""
    found = oom(message)
    return {"ok": False, "error": message[:2000], "oom": found, "fits": False if found else None}


def compiled_columns(stats, hlo_text: str, held_beside: dict, hbm_gib: float, *, length, widths) -> dict:
    """A row's columns for a compiled program: XLA's memory (`stats`, compiled.memory_analysis()),
    the program's total (arguments + outputs - aliased + temporaries), the chip's (that + what the
    trainer holds beside its arguments) and whether it fits the chip's HBM, and the HLO's columns
    (tpu_hlo.read; `length` and `widths` its token width and hidden widths)."""
    xla = {k: int(getattr(stats, f"{k}_size_in_bytes")) for k in MEMORY}
    xla["peak"] = getattr(stats, "peak_memory_in_bytes", None)
    total = xla["argument"] + xla["output"] - xla["alias"] + xla["temp"]
    chip = total + sum(held_beside.values())
    return {
        "ok": True,
        "xla": xla,
        "program_bytes": total,
        "chip_bytes": chip,
        "fits": chip <= hbm_gib * GIB,
        "hlo": tpu_hlo.read(hlo_text, length=length, widths=widths),
    }


def dry_run_columns(program: str, report: dict, chip: int | None) -> dict:
    """The dry run's per-chip bytes for the program's phase (persistent + phase; its items) beside
    the chip's total from XLA, and their ratio (None where XLA refused the program)."""
    phase = PHASE[program]
    phases = report["phase_bytes"]
    per_chip = phases["persistent"] + phases[phase]
    items = {i["name"]: i["bytes"] for i in report["items"] if phase in i["phase"].split("+") or i["phase"] == "all"}
    return {
        "dryrun": {
            "phase": phase,
            "persistent": phases["persistent"],
            "phase_bytes": phases[phase],
            "per_chip": per_chip,
            "items": items,
            "peak": report["peak_bytes"],
            "peak_phase": report["peak_phase"],
        },
        "ratio": None if chip is None else chip / per_chip,
    }


def key(row: dict) -> tuple:
    """What identifies a row: config, mesh overlay, topology, program, the --attention asked for,
    overrides."""
    fields = (row["config"], row.get("mesh_overlay", "8gpu"), row["topology"], row["program"])
    return (*fields, row["attention_requested"], tuple(row["overrides"]))


# ----------------------------------------------------------------------------- markdown


def gib(n) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _num(x, fmt: str = "g") -> str:
    return "-" if x is None else format(x, fmt)


def summary(row: dict) -> str:
    """One line for the log."""
    if not row.get("ok"):
        return f"{'refused' if row.get('oom') else 'failed'} ({row.get('stage')}): {row['error'][:300]}"
    return (
        f"chip {gib(row['chip_bytes'])} GiB (XLA temp {gib(row['xla']['temp'])}), dry run "
        f"{gib(row['dryrun']['per_chip'])} GiB, ratio {row['ratio']:.2f}, compile {row['compile_s']} s"
    )


def _tflop(flops) -> str:
    return "-" if flops is None else f"{flops / 1e12:.1f}"


def _fits(row: dict) -> str:
    if row.get("oom"):
        return f"no (XLA: {row['oom']['available_g']:g}G available)"
    return {True: "yes", False: "no", None: "error"}[row.get("fits")]


def _temp(row: dict) -> str:
    """XLA's temporaries, or what it needed where it refused the program (its G)."""
    if row.get("oom"):
        return f"needs {row['oom']['needed_g']:g}G"
    return gib((row.get("xla") or {}).get("temp"))


def _attention(row: dict) -> str:
    setting, compiled = row.get("attention_setting"), row.get("attention")
    if compiled is None:
        return str(row.get("attention_requested") or setting or "-")
    return compiled if setting in (None, compiled) else f"{setting} -> {compiled}"


def _model(row: dict) -> str:
    """The config, with the row's key=value overrides beside it (tpu_compile.py's trailing arguments)."""
    over = row.get("overrides") or []
    return row["config"] + (f" ({', '.join(over)})" if over else "")


def _remat(row: dict) -> str:
    """The update's remat policy, and whether the layers ran under one scan (model.scan_layers)."""
    return f"{row.get('remat', '-')}{', scanned' if row.get('scan_layers') else ''}"


def _mesh(row: dict) -> str:
    """The mesh's data, fsdp, tensor sizes, and the overlay where it is not 8gpu's."""
    sizes = ",".join(str(v) for v in row.get("mesh", {}).values()) or "-"
    overlay = row.get("mesh_overlay", "8gpu")
    return sizes if overlay == "8gpu" else f"{sizes} ({overlay})"


def memory_table(rows: list[dict]) -> list[str]:
    lines = [
        "| model | topology | mesh d,f,t | program | attention | remat (layers) | rows (/chip) | args | temp | XLA | beside | "
        "chip | HBM | fits | dry run | chip / dry run | TFLOP / chip | compile s |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        x = r.get("xla") or {}
        held = r.get("held_beside")
        lines.append(
            f"| {_model(r)} | {r['topology']} ({r['chips']}) | {_mesh(r)} | {r['program']} | {_attention(r)} | "
            f"{_remat(r)} | {r.get('rows', '-')} ({_num(r.get('rows_per_chip'))}) | {gib(x.get('argument'))} | {_temp(r)} | "
            f"{gib(r.get('program_bytes'))} | {gib(sum(held.values()) if held else None)} | {gib(r.get('chip_bytes'))} | "
            f"{r['hbm_gib']:g} | {_fits(r)} | {gib((r.get('dryrun') or {}).get('per_chip'))} | "
            f"{_num(r.get('ratio'), '.2f')} | {_tflop(r.get('xla_flops'))} | {r.get('compile_s', '-')} |"
        )
    return lines


def _rows_text(mesh_rows, act: dict) -> str:
    """The rows the mesh leaves a chip / the most an activation holds (its array), and how many of
    the distinct activation arrays hold the mesh's rows."""
    text = f"{_num(mesh_rows)} / {act['rows']} ({act['array']})"
    by_rows = act.get("arrays_by_rows")
    if by_rows:
        text += f"; {by_rows.get(str(mesh_rows), 0)} of {act['arrays']} arrays at {_num(mesh_rows)}"
    return text


def hlo_table(rows: list[dict]) -> list[str]:
    lines = [
        "| model | topology | program | attention | rows/chip: mesh / HLO (array) | [T,T] score rows | "
        "collectives (ag, ar, rs, cp, a2a) | in while bodies (non-scalar) | largest array |",
        "|---|---|---|---|---|---:|---|---|---|",
    ]
    for r in rows:
        h = r.get("hlo")
        if not h:
            continue
        act = h.get("activation_rows")
        act_text = "-" if act is None else _rows_text(r["rows_per_chip"], act)
        coll = ", ".join(str(h["collectives"].get(k, 0)) for k in hlo_loops.COLLECTIVE_OPS[:5])
        loops = h["while_body_collectives"]
        body = ", ".join(f"{v} {k}" for k, v in loops["by_op"].items()) or "none"
        big = (h["largest_arrays"] or [None])[0]
        big_text = "-" if big is None else f"{big['array']} ({gib(big['bytes'])} GiB)"
        lines.append(
            f"| {_model(r)} | {r['topology']} | {r['program']} | {_attention(r)} | {act_text} | "
            f"{_num(h.get('attention_rows'))} | {coll} | {body} ({loops['non_scalar']}) | {big_text} |"
        )
    return lines


def dryrun_line(table: dict) -> list[str]:
    """Where the dry-run columns were recomputed after the rows were compiled (--refresh-dryrun)."""
    prov = table.get("dryrun_provenance")
    if not prov:
        return []
    tree = "uncommitted changes" if prov.get("uncommitted_changes") else "tree clean"
    return [
        "",
        f"Dry-run columns recomputed for every row at commit {prov.get('commit')} ({tree}; "
        "`tpu_compile.py --refresh-dryrun`); each row's XLA columns are from the commit in its JSON.",
    ]


def markdown(table: dict) -> str:
    """The table's markdown: commands, provenance, memory per chip, the HLO's columns, refusals."""
    order = lambda r: (r["config"], r["program"], r["topology"], _attention(r), str(r["overrides"]))  # noqa: E731
    rows = sorted(table["rows"], key=order)
    prov = table.get("provenance") or {}
    lines = [
        "# The trainer's programs compiled by XLA:TPU (libtpu) on a CPU: memory per chip",
        "",
        *[f"Command: `{c}`" for c in dict.fromkeys(table.get("commands", []))],
        "",
        figprov.provenance_line({"provenance": prov})
        + f" jaxlib {prov.get('jaxlib')}, libtpu {prov.get('libtpu')}; compiled only, nothing ran on a TPU.",
        *dryrun_line(table),
        *[line for note in table.get("notes", []) for line in ("", note)],
        "",
        "Programs at the configs' real shapes from abstract inputs (experiments/device/tpu_programs.py): "
        "update = the learner's micro-batch gradient program at the widest width; score = its pi_old "
        "scoring pass; decode = one sampler call (prefill and the decode loop) on the rollout layout. "
        "args, temp = XLA's arguments and temporaries (compiled.memory_analysis()); XLA = arguments + "
        "outputs - aliased + temporaries; beside = what the trainer holds on the chip that is not an "
        "argument (master, pi_ref, optimizer state, exact); chip = XLA + beside, against the chip's HBM "
        "(data sheet); a program larger than the chip is refused by XLA itself (its G). dry run = "
        "sparserl_jax/dryrun.py's persistent + phase bytes per chip (update, score, rollout). Attention: "
        "the config's setting -> what a TPU compiles (auto is splash there). GiB throughout.",
        "",
        *memory_table(rows),
        "",
        "What the compiled programs hold (their HLO; experiments/lib/hlo_layout.py and hlo_loops.py): the "
        "most rows a token activation carries on a chip ([rows, T, D or F] in any order, D and F whole or "
        "split by the mesh) beside the rows the mesh leaves a chip; the most (row, head) pairs of [T, T] "
        "attention scores one array holds (0: none materialised); the program's collectives; those its "
        "while loops run every iteration (how many move more than a scalar); its largest result. XLA:TPU "
        "runs an FSDP weight all-gather as a ring: a while loop of collective-permutes, one loop a weight; "
        "so the update's and scoring's loop collectives are mostly those gathers, and the decode loop's count (decode rows) "
        "includes them only where its weights are gathered inside it.",
        "",
        *hlo_table(rows),
    ]
    reported = [r for r in rows if r.get("xla_memory_report")]
    if reported:
        lines += [
            "",
            "What the temporaries are made of (XLA's memory-usage report, tpu_compile.py --xla-dump): the "
            "largest slices of the program's largest buffer, each with the arrays that share it over the "
            "program (live at different times):",
            "",
        ]
        for r in reported:
            slices = "; ".join(
                f"{gib(x['bytes'])} GiB: {x['shapes'][:120]}" for x in r["xla_memory_report"]["largest"][:3]
            )
            lines.append(f"- {_model(r)} {r['topology']} {r['program']} {_attention(r)}: {slices}")
    failed = [r for r in rows if not r.get("ok")]
    if failed:
        lines += ["", "Refused or failed (XLA's or the config's message):", ""]
        lines += [
            f"- {_model(r)} {r['topology']} {r['program']} {_attention(r)} ({r.get('stage')}): "
            f"`{r['error'].splitlines()[0][:400]}`"
            for r in failed
        ]
    return "\n".join(lines) + "\n"
