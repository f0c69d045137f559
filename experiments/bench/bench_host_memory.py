"""The learner's micro-batch program under train.host_memory=system vs reuse, processes alternating.

  taskset -c 1 python experiments/bench/bench_host_memory.py --processes 3 --rounds 5
  python experiments/bench/bench_host_memory.py --smoke --out /tmp/hm.json     # seconds (tests)

The setting is the process's (malloc's arenas are taken when JAX's backend starts), so the arms
cannot share one: each process runs one arm (experiments/lib/micro_step_bench.py's program at the
real-model iteration's shape, compiled, one untimed step, --rounds timed ones), and the processes
alternate system, reuse, system, ... on the same core, --processes of each. Per arm: the median of
every timed step, the median step's minor page faults (the kernel's count), the largest resident
set. The setting changes no number (the arms' log-probs are compared bit for bit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from experiments.lib import figprov, micro_step_bench  # import no JAX

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/
REPO = os.path.dirname(HERE)
ARMS = ("system", "reuse")  # train.host_memory
DEFAULT_OVERRIDES = ["model.head_backward=compute", "model.attention_backward=compute"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    micro_step_bench.add_shape_args(p)
    p.add_argument("--processes", type=int, default=3, help="processes of each arm, alternating")
    p.add_argument("--overrides", nargs="*", default=DEFAULT_OVERRIDES, help="model.key=value, both arms")
    p.add_argument("--head-window", default="response", help="rl.update.head_window, both arms")
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_host_memory.json"))
    p.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)  # one process's arm: JSON on stdout
    args = micro_step_bench.check_shape_args(p, p.parse_args(argv))
    if args.smoke:
        args.processes = 1
    return args


def child(args) -> dict:
    """One process: train.host_memory=args.child before JAX's backend starts, then the program."""
    import resource

    import numpy as np

    from sparserl_jax import host_memory

    note = host_memory.configure(args.child)
    arms = {
        args.child: (
            micro_step_bench.model_config(args, args.overrides),
            micro_step_bench.rl_config(args, head_window=args.head_window),
        )
    }
    records, outs, mask = micro_step_bench.run_arms(args, arms)
    logp = np.asarray(outs[args.child][3])[mask]
    return {
        **records[args.child],
        "note": note,
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "logp_sum": float(logp.astype(np.float64).sum()),
        "logp_bits": logp.astype(np.float32).tobytes().hex()[:64],
    }


def _child_argv(args, arm: str) -> list[str]:
    shape = ["--smoke"] if args.smoke else []
    shape += ["--dtype", args.dtype, "--rows", str(args.rows), "--prompt-tokens", str(args.prompt_tokens)]
    shape += ["--response-tokens", str(args.response_tokens), "--width", str(args.width)]
    shape += ["--rounds", str(args.rounds), "--head-window", args.head_window, "--overrides", *args.overrides]
    return [sys.executable, os.path.abspath(__file__), *shape, "--child", arm]


def run(args) -> dict:
    per_arm = {arm: [] for arm in ARMS}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    for _ in range(args.processes):
        for arm in ARMS:
            out = subprocess.run(_child_argv(args, arm), env=env, capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(f"the {arm} process failed:\n{out.stderr[-3000:]}")
            per_arm[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
    arms = {}
    for arm, procs in per_arm.items():
        steps = [s for p in procs for s in p["steps_s"]]
        arms[arm] = {
            "step_s": round(statistics.median(steps), 3),
            "process_medians_s": [p["step_s"] for p in procs],
            "step_faults": int(statistics.median(p["step_faults"] for p in procs)),
            "maxrss_mib": max(p["maxrss_mib"] for p in procs),
            "note": procs[0]["note"],
            "processes": procs,
        }
    bits = {p["logp_bits"] for procs in per_arm.values() for p in procs}
    return {
        "arms": arms,
        "same_logp_bits": len(bits) == 1,
        "shape": micro_step_bench.shape_line(args, [*args.overrides, f"rl.update.head_window={args.head_window}"]),
        "processes": args.processes,
    }


def to_markdown(data: dict) -> str:
    s, r = data["arms"]["system"], data["arms"]["reuse"]
    lines = [
        *figprov.report_head(
            "The learner's micro-batch program: malloc's defaults vs freed buffers kept mapped (train.host_memory)",
            data,
        ),
        f"Shape: {data['shape']}. Processes of each arm: {data['processes']}, alternating system, reuse, ... "
        f"on the same core; each compiles the program, takes one untimed step, then {data['rounds']} timed "
        f"ones. Response log-probs bit for bit the same in every process: {data['same_logp_bits']}.",
        "",
        "| train.host_memory | system | reuse | reuse / system |",
        "|---|---:|---:|---:|",
        f"| step, median wall s (every timed step) | {s['step_s']} | {r['step_s']} | {r['step_s'] / s['step_s']:.2f}x |",
        f"| each process's median s | {', '.join(map(str, s['process_medians_s']))} | "
        f"{', '.join(map(str, r['process_medians_s']))} | |",
        f"| minor page faults a step (median) | {s['step_faults']:,} | {r['step_faults']:,} | |",
        f"| largest resident set, MiB | {s['maxrss_mib']:,} | {r['maxrss_mib']:,} | "
        f"{r['maxrss_mib'] / s['maxrss_mib']:.2f}x |",
        "",
        f"What the setting did in each arm's processes: {s['note']}; {r['note']}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return {}
    return micro_step_bench.main(lambda _: args, run, to_markdown)


if __name__ == "__main__":
    main()
