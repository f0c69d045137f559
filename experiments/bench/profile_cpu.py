"""Where a SmolLM2-135M GRPO iteration's time goes on this CPU, op by op, in float32 and in
bfloat16 compute: the sampler's decode steps, the scoring and the update, each executed XLA
instruction with its kind (dots by operand dtype, random numbers, sort / top-k, copies, ...) and
the source line that made it.

  taskset -c 1 python experiments/bench/profile_cpu.py    # experiments/results/profile_cpu_<cpu>.{json,md}
  python experiments/bench/profile_cpu.py --smoke --checkpoint <tiny HF checkpoint> --out /tmp/p.json

Workload: bench_precision.py's (experiments/real/precision_workload.py: SmolLM2 chat arithmetic, dense
rollouts, 4 prompts x 4 samples of exactly --tokens new tokens, one optimizer step), per arm
(model.dtype float32, then bfloat16 over float32 masters) --warmup untimed iterations, then one
iteration inside a jax.profiler trace. The trace's thunk events are joined with XLA's dump of the
optimised programs (experiments/lib/xla_profile.py): a dot reads bfloat16 operands only where the
compiled program gives them to it; "upcast" marks a float32 dot whose operand XLA converted from
bfloat16. Seconds are the thunks' own (loops and conditionals left out: they hold the others), so
the sum is below the iteration's wall time by the host's share (Python, transfers, the profiler).

The host's own numerics by default, as bench_precision (--portable: the project's portable CPU
settings, which cap the ISA at AVX2 and turn YNNPACK off, as the studies run). Not a test.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from experiments.lib import figprov, workers, xla_profile  # import no JAX
from experiments.real import precision_workload as workload

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/
TOP_OPS = 12  # non-dot instructions listed per arm
TOP_DOTS = 14  # dots listed per arm
KEPT_ROWS = 150  # instructions per arm in the JSON (the most time first)
KEPT_DOTS = 60  # dot rows per arm in the JSON's summary


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations per arm before the traced one")
    p.add_argument("--tokens", type=int, default=128, help="every response's length (decode steps)")
    p.add_argument("--arms", nargs="+", default=list(workload.ARMS), choices=workload.ARMS)
    p.add_argument("--checkpoint", default=None, help="an HF checkpoint in place of the config's")
    p.add_argument("--portable", action="store_true", help="the portable CPU settings (AVX2, no YNNPACK)")
    p.add_argument("--smoke", action="store_true", help="tiny workload, no warm-up")
    p.add_argument("--keep", default=None, help="keep the traces and the HLO dump in this folder")
    p.add_argument("--out", default=None, help="default: experiments/results/profile_cpu_<cpu>.json")
    p.add_argument("overrides", nargs="*", help="key=value settings for both arms (e.g. rollout.prompts=2)")
    args = p.parse_args(argv)
    if args.smoke:
        args.warmup, args.tokens = 0, 8
    return args


def traced_arm(args, dtype: str, trace_dir: str) -> dict:
    """--warmup untimed trainer iterations at model.dtype=`dtype`, then one traced."""
    from sparserl_jax.train import Trainer

    with tempfile.TemporaryDirectory() as out_dir:
        trainer = Trainer(workload.train_config(args, dtype, out_dir), log=lambda *a, **k: None)
        trainer.start()
        for _ in range(args.warmup):
            trainer.step()
            trainer.iteration += 1
        t0 = time.perf_counter()
        with xla_profile.traced(trace_dir):
            m = trainer.step()
        wall = time.perf_counter() - t0
    phases = {p: m[f"time/{p}_s"] for p in ("rollout", "score", "update")}
    return {
        "dtype": dtype,
        "wall_s": wall,
        "phases_s": phases,
        "response_tokens": m["update/tokens"],
        "host_memory": trainer.host_memory,
    }


def summarise(rows: list[dict]) -> dict:
    """Seconds by program and by kind; the dots and the other instructions that took most."""
    dots = [r for r in rows if r["dots"]]
    return {
        "seconds": sum(r["seconds"] for r in rows),
        "programs": xla_profile.by(rows, "program"),
        "categories": xla_profile.by(rows, "category"),
        "dots": [
            {**xla_profile.by([r], "program", "source", "category")[0], "dot": r["dots"][0], "ops": len(r["dots"])}
            for r in dots[:KEPT_DOTS]
        ],
        "top_ops": [r for r in rows if not r["dots"]][:TOP_OPS],
    }


def to_markdown(data: dict) -> str:
    arms = data["arms"]
    flags = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in data["cpu_flags"].items())
    lines = [
        *figprov.report_head("Where a SmolLM2-135M GRPO iteration's time goes on this CPU, op by op", data),
        f"CPU flags: {flags}. Numerics: {data['numerics']}. Workload: {data['workload']}; one traced "
        f"iteration per arm after {data['warmup']} untimed. Seconds: the XLA thunks' own, summed over "
        "the iteration (loops and conditionals left out: they hold the others); the iteration's wall "
        "time and the trainer's phase clocks beside them.",
        "",
        "| | " + " | ".join(arms) + " |",
        "|---|" + "---:|" * len(arms),
        "| iteration wall s (traced) | " + " | ".join(f"{a['wall_s']:.2f}" for a in arms.values()) + " |",
    ]
    for p in ("rollout", "score", "update"):
        lines.append(
            f"| {p} s (trainer's clock) | " + " | ".join(f"{a['phases_s'][p]:.2f}" for a in arms.values()) + " |"
        )
    lines.append("| XLA thunks s | " + " | ".join(f"{a['profile']['seconds']:.2f}" for a in arms.values()) + " |")
    lines += _table(arms, "Seconds by program (XLA thunks):", "programs", "program")
    lines += _table(arms, "Seconds by kind of instruction:", "categories", "category")
    for dtype, arm in arms.items():
        lines += [
            "",
            f"The {TOP_DOTS} dots that took most, {dtype} (operands as the compiled program gives them; upcast: a "
            "float32 operand converted from bfloat16 by XLA):",
            "",
            "| program | source | lhs | rhs | out | upcast | calls | s | GFLOP/s |",
            "|---|---|---|---|---|---|---:|---:|---:|",
        ]
        for d in arm["profile"]["dots"][:TOP_DOTS]:
            x = d["dot"]
            gflops = d["flops"] / d["seconds"] / 1e9 if d["seconds"] else 0.0
            lines.append(
                f"| {d['program']} | {d['source']} | {x['lhs']} | {x['rhs']} | {x['out']} | "
                f"{'yes' if x['upcast'] else 'no'} | {d['calls']} | {d['seconds']:.3f} | {gflops:.0f} |"
            )
        lines += [
            "",
            f"The {TOP_OPS} other instructions that took most, {dtype}:",
            "",
            "| program | instruction | kind | source | calls | s |",
            "|---|---|---|---|---:|---:|",
        ]
        for r in arm["profile"]["top_ops"]:
            lines.append(
                f"| {r['program']} | {r['op']} | {r['category']} | {r['source']} | {r['calls']} | {r['seconds']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def _table(arms: dict, title: str, part: str, key: str) -> list[str]:
    """A titled table: one row per `key` of the arms' profile[part], its seconds in each arm."""
    seconds = {d: {r[key]: r["seconds"] for r in a["profile"][part]} for d, a in arms.items()}
    names = sorted(
        {n for s in seconds.values() for n in s}, key=lambda n: -max(s.get(n, 0.0) for s in seconds.values())
    )
    head = ["", title, "", f"| {key} | " + " | ".join(arms) + " |", "|---|" + "---:|" * len(arms)]
    return head + [f"| {n} | " + " | ".join(f"{seconds[d].get(n, 0.0):.3f}" for d in arms) + " |" for n in names]


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.portable:
        workers.set_portable_cpu_env()
    work = args.keep or tempfile.mkdtemp(prefix="profile_cpu_")
    dump_dir = os.path.join(work, "hlo")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_profile.dump_flags(dump_dir)}".strip()
    out = args.out or os.path.join(HERE, "results", f"profile_cpu_{figprov.cpu_slug()}.json")
    t0, cores = time.perf_counter(), workers.available_cores()
    provenance = {**figprov.provenance(cores, None), "portable_cpu": args.portable or "host"}
    arms = {}
    try:
        for dtype in args.arms:
            trace_dir = os.path.join(work, f"trace_{dtype}")
            arm = traced_arm(args, dtype, trace_dir)
            rows = xla_profile.op_rows(trace_dir, dump_dir)
            arms[dtype] = {**arm, "profile": summarise(rows), "rows": rows[:KEPT_ROWS]}
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    cfg = workload.train_config(args, "float32", tempfile.gettempdir())
    data = {
        "command": figprov.command_line(cores),
        "provenance": {**provenance, "wall_s": round(time.perf_counter() - t0, 1)},
        "cpu_flags": figprov.cpu_flags(workload.BF16_FLAGS),
        "numerics": "portable (AVX2, no YNNPACK)" if args.portable else "the host's own",
        "workload": f"{cfg.rollout.prompts} prompts x {cfg.rollout.samples} samples, {args.tokens} new tokens "
        "each, dense rollouts",
        "warmup": args.warmup,
        "arms": arms,
    }
    figprov.write_report(out, data, to_markdown(data))
    print(to_markdown(data))
    return data


if __name__ == "__main__":
    main()
