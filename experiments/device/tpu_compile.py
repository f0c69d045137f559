"""The TPU compile table: the trainer's update, scoring and decode programs compiled by XLA:TPU
(libtpu, requirements-tpu.txt) for TPU topologies on this CPU, at the authors' configs' real
shapes, from abstract inputs: XLA's own memory plan per chip beside the dry run's, whether the
chip holds it, and what the compiled program holds (rows per chip, collectives).

  pip install -r requirements-tpu.txt
  python experiments/device/tpu_compile.py                                   # every row below
  python experiments/device/tpu_compile.py --configs qwen2.5-1.5b --programs update \\
      --topologies v5e:2x4 v5p:2x2x2 --attention xla splash --resume
  python experiments/device/tpu_compile.py --quick --out /tmp/tpu.json       # one toy row (tests)

Rows: --configs (the authors' experiments/configs/real/<name>.yaml with the --mesh overlay,
default 8gpu: fsdp over 8 devices; on a topology of another chip count fsdp takes its chips and
the rows of a micro-batch, a scoring chunk and a sampler call are scaled to keep each chip's) x
--topologies (jax.experimental.topologies' names, default v5e:2x4 and v5p:2x2x2: 8 chips each) x
--attention (model.attention values, each a config override; default the config's, auto
resolved for a TPU) x --programs (update: the learner's micro-batch gradient program; score: its
pi_old scoring pass; decode: one sampler call, prefill and the decode loop, on the rollout
layout). --micro-batch sets rl.update.micro_batch_size; key=value overrides apply to every row.
--refresh-dryrun compiles nothing: it recomputes the dry-run columns of every row of --out with
this checkout's sparserl_jax/dryrun.py (after its formulas change), XLA's columns as compiled.

Per row (tpu_table.py): XLA's compiled memory (compiled.memory_analysis()), what the trainer holds
on the chip beside the program's arguments (exact), their sum against the chip's HBM, or XLA's own
refusal of a program too large for the chip; the dry run's (sparserl_jax/dryrun.py) persistent +
phase bytes and the ratio; compile seconds; from the compiled HLO (tpu_hlo.py) the rows a chip's
activations carry, the collectives and those inside the while loops' bodies. Each row is written
to --out (JSON, with the markdown beside it) as soon as it is done; --resume keeps the rows already
there and skips them. Nothing allocates the model or runs on a TPU; a compile at the real shapes
takes minutes of CPU.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import resource
import sys
import time

from experiments.device import tpu_hlo, tpu_table, tpu_topology
from experiments.lib import figprov, workers

OUT = os.path.join(figprov.REPO, "experiments", "results", "tpu", "compile_table.json")
QUICK_OUT = os.path.join(figprov.REPO, "experiments", "results", "tpu", "quick.json")


def parse_args(argv=None) -> argparse.Namespace:
    from experiments.device.tpu_programs import CONFIGS, PROGRAMS, meshes  # imports JAX: after main's environment

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), help=f"some of {CONFIGS}")
    p.add_argument("--topologies", nargs="+", default=list(tpu_topology.DEFAULT_TOPOLOGIES))
    p.add_argument("--programs", nargs="+", default=list(PROGRAMS), help=f"some of {PROGRAMS}")
    p.add_argument("--attention", nargs="+", default=[None], help="model.attention values (default: the config's)")
    p.add_argument("--mesh", default="8gpu", help=f"the mesh overlay, one of {meshes()}")
    p.add_argument("--micro-batch", type=int, help="rl.update.micro_batch_size (rows of one micro-batch, all chips)")
    p.add_argument("--quick", action="store_true", help="the smoke config's toy model on v5e:2x2 (tests)")
    p.add_argument("--out", help=f"the JSON (markdown beside it); default {os.path.relpath(OUT, figprov.REPO)}")
    p.add_argument("--resume", action="store_true", help="keep --out's rows and skip those already there")
    p.add_argument("--hlo-dir", help="also write each compiled program's HLO text there (gzip), to read further")
    p.add_argument("--xla-dump", help="XLA's dumps there (--xla_dump_to); each row then reads its memory-usage report")
    p.add_argument(
        "--refresh-dryrun",
        action="store_true",
        help="compile nothing: recompute every row's dry-run columns of --out at this checkout's "
        "sparserl_jax/dryrun.py (after a change of its formulas)",
    )
    p.add_argument("overrides", nargs="*", help="key=value config overrides for every row")
    args = p.parse_args(argv)
    if args.quick:
        args.configs, args.topologies = ["toy"], ["v5e:2x2"]
    args.out = args.out or (QUICK_OUT if args.quick else OUT)
    if args.micro_batch is not None:
        args.overrides.append(f"rl.update.micro_batch_size={args.micro_batch}")
    return args


def provenance(seconds: float, tree_dirty: bool) -> dict:
    """The commit, tree, CPU, jax, jaxlib and libtpu that compiled a row, and how long it took.
    `tree_dirty`: whether the tree differs from the commit outside the table itself."""
    import jaxlib

    return {
        **figprov.provenance(workers.available_cores(), seconds),
        "uncommitted_changes": tree_dirty,
        "jaxlib": jaxlib.__version__,
        "libtpu": tpu_topology.libtpu_version(),
    }


def compile_row(program, setup, mesh, topology, report: dict, hlo_path=None, dump_dir=None) -> dict:
    """Lower and compile one program; its columns (tpu_table.py); its HLO text to `hlo_path`
    (gzip) when given; with XLA's dumps in `dump_dir`, the largest slices of its memory-usage
    report."""
    import jax

    from experiments.device.tpu_programs import hidden_widths

    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    row = {
        "rows": program.rows,
        "rows_per_chip": program.rows // dp if program.rows % dp == 0 else program.rows,
        "width": program.width,
        "facts": program.facts,
        "held_beside": program.held_beside,
    }
    t0 = time.perf_counter()
    try:
        lowered = program.fn.lower(*program.args, **program.kwargs)
        row["lower_s"] = round(time.perf_counter() - t0, 1)
        t1, started = time.perf_counter(), time.time()
        compiled = lowered.compile()
        row["compile_s"] = round(time.perf_counter() - t1, 1)
    except Exception as err:  # a refusal for memory is the table's answer; another error its message
        row["stage"] = "compile" if "lower_s" in row else "lower"
        row["compile_s"] = round(time.perf_counter() - t0 - row.get("lower_s", 0.0), 1)
        row.update(tpu_table.refused(f"{type(err).__name__}: {str(err).strip()}"))
        return {**row, **tpu_table.dry_run_columns(program.name, report, None)}
    text = compiled.as_text()
    if dump_dir:
        reports = glob.glob(os.path.join(dump_dir, "*after_optimizations-memory-usage-report.txt"))
        newest = max(reports, key=os.path.getmtime, default=None)
        if newest and os.path.getmtime(newest) >= started:  # this compile's
            with open(newest) as f:
                row["xla_memory_report"] = {"file": newest, **tpu_hlo.memory_report(f.read())}
    if hlo_path:
        os.makedirs(os.path.dirname(os.path.abspath(hlo_path)), exist_ok=True)
        with gzip.open(hlo_path, "wt") as f:
            f.write(text)
        row["hlo_text"] = hlo_path
    row.update(
        tpu_table.compiled_columns(
            compiled.memory_analysis(),
            text,
            program.held_beside,
            topology.hbm_gib,
            length=None if program.name == "decode" else program.width,  # a decode step's rows hold one token
            widths=sorted(hidden_widths(setup.model, mesh)),
        )
    )
    cost = compiled.cost_analysis()  # a list of one dict on older jax
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    # per chip, as XLA counts them (recomputation included); XLA counts a while loop's body once, so
    # under model.scan_layers it would count one layer of L: left out
    row["xla_flops"] = None if setup.model.scan_layers else cost.get("flops")
    del compiled, lowered
    jax.clear_caches()
    return {**row, **tpu_table.dry_run_columns(program.name, report, row["chip_bytes"])}


def run(args) -> dict:
    """Every row of args, each written to args.out when done; returns the table."""
    # the code's state: the table this command rewrites as it goes does not count
    args.tree_dirty = figprov.uncommitted_changes(ignoring=(args.out, os.path.splitext(args.out)[0] + ".md"))
    topologies = [tpu_topology.parse(t) for t in args.topologies]
    tpu_topology.set_environment(topologies[0])
    from experiments.device import tpu_programs as tp  # imports JAX: after the environment

    table = load(args.out) if args.resume else {"rows": []}
    table["commands"] = [*table.get("commands", []), figprov.command_line()]
    done = {tpu_table.key(r) for r in table["rows"]}
    for topology in topologies:
        devices = tp.devices(topology)
        for name in args.configs:
            for attention in args.attention:
                head = {"config": name, "topology": topology.name, "attention_requested": attention}
                head.update(mesh_overlay=args.mesh, overrides=list(args.overrides))
                head.update(accelerator_type=topology.accelerator_type)
                head.update(chips=topology.chips, hbm_gib=topology.hbm_gib)
                todo = [p for p in args.programs if tpu_table.key({**head, "program": p}) not in done]
                if todo:
                    _rows(tp, table, args, head, topology, devices, todo)
    return table


def refresh_dryrun(args) -> dict:
    """Every row of args.out with its dry-run columns recomputed by this checkout's dry run (the
    same setup the row was compiled with: config, mesh overlay, topology, attention, overrides);
    XLA's columns stay as compiled. The table records the refresh's provenance."""
    from experiments.device import tpu_programs as tp  # imports JAX

    t0 = time.perf_counter()
    dirty = figprov.uncommitted_changes(ignoring=(args.out, os.path.splitext(args.out)[0] + ".md"))
    table = load(args.out)
    for row in table["rows"]:
        if row.get("stage") == "config":  # the config refused the setting: nothing to estimate
            continue
        row.update(tp.row_dry_run(row))
    table["commands"] = [*table.get("commands", []), figprov.command_line()]
    table["dryrun_provenance"] = provenance(time.perf_counter() - t0, dirty)
    tmp = f"{os.path.splitext(args.out)[0]}.tmp{os.getpid()}.json"
    figprov.write_report(tmp, table, tpu_table.markdown(table))
    os.replace(os.path.splitext(tmp)[0] + ".md", os.path.splitext(args.out)[0] + ".md")
    os.replace(tmp, args.out)
    return table


def _remat(cfg) -> str:
    """The update's rematerialisation policy (model/remat.py; a bool at commits before it)."""
    value = cfg.rl.update.remat
    return {True: "full", False: "none"}.get(value, value) if isinstance(value, bool) else str(value)


def _rows(tp, table: dict, args, head: dict, topology, devices, todo: list[str]) -> None:
    """The rows of one config, topology and attention: each program in `todo` compiled."""
    t0 = time.perf_counter()
    try:
        s = tp.setup(
            head["config"], topology, mesh=args.mesh, attention=head["attention_requested"], overrides=args.overrides
        )
        mesh = tp.make_mesh(s, devices)
        report = tp.dry_run(s, topology)
        builders = tp.programs(s, mesh, todo)
    except Exception as err:  # a setting the config refuses: every program's row says so
        for p in todo:
            row = {**head, "program": p, "stage": "config", **tpu_table.refused(f"{type(err).__name__}: {err}")}
            _record(table, args, {**row, "provenance": provenance(time.perf_counter() - t0, args.tree_dirty)})
        return
    for p in todo:
        t0 = time.perf_counter()
        print(f"{topology.name} {head['config']} {p} attention={s.model.attention}: compiling", flush=True)
        row = {**head, "program": p, "attention_setting": s.attention_setting, "attention": s.model.attention}
        row.update(mesh=dict(mesh.shape), setting_overrides=list(s.overrides), remat=_remat(s.cfg))
        row["scan_layers"] = s.model.scan_layers  # the learner's passes' layers under one lax.scan
        try:
            hlo = args.hlo_dir and os.path.join(args.hlo_dir, "_".join(map(str, tpu_table.key(row)[:5])) + ".hlo.gz")
            row.update(compile_row(builders[p](), s, mesh, topology, report, hlo, args.xla_dump))
        except Exception as err:  # building the program: recorded, the next one runs
            row.update(stage="build", **tpu_table.refused(f"{type(err).__name__}: {err}"))
        row["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / tpu_table.GIB
        row["provenance"] = provenance(time.perf_counter() - t0, args.tree_dirty)
        _record(table, args, row)
        print(f"  {tpu_table.summary(row)}", flush=True)


def _record(table: dict, args, row: dict) -> None:
    """`row` into this run's table, and the table to args.out (JSON and markdown, each replaced at
    once); with --resume the rows another run wrote there meanwhile stay (two runs may fill one
    table, each skipping the rows done when it started)."""
    table["rows"] = [r for r in table["rows"] if tpu_table.key(r) != tpu_table.key(row)] + [row]
    table["provenance"] = row["provenance"]
    mine = {tpu_table.key(r) for r in table["rows"]}
    disk = load(args.out) if args.resume else {"rows": []}
    out = {
        **table,
        "commands": list(dict.fromkeys([*disk.get("commands", []), *table["commands"]])),
        "rows": [r for r in disk["rows"] if tpu_table.key(r) not in mine] + table["rows"],
    }
    tmp = f"{os.path.splitext(args.out)[0]}.tmp{os.getpid()}.json"
    figprov.write_report(tmp, out, tpu_table.markdown(out))
    os.replace(os.path.splitext(tmp)[0] + ".md", os.path.splitext(args.out)[0] + ".md")
    os.replace(tmp, args.out)


def load(path: str) -> dict:
    """A table written before (--resume), or an empty one."""
    if not os.path.exists(path):
        return {"rows": []}
    with open(path) as f:
        return json.load(f)


def main(argv=None) -> dict:
    # before JAX starts: its own backend is this CPU's; the TPU devices come from libtpu's topology
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    args = parse_args(argv)
    if args.xla_dump:  # read when libtpu starts (run's first topology)
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={args.xla_dump}".strip()
    table = refresh_dryrun(args) if args.refresh_dryrun else run(args)
    print(tpu_table.markdown(table))
    return table


if __name__ == "__main__":
    table = main()
    sys.exit(0 if all(r.get("fits") is not None for r in table["rows"]) else 1)
