"""Sparrow's tail on a real model: a KV budget schedule that holds the 5th percentile of the
per-token sparse-dense agreement through the generation, against fixed budgets (SmolLM2-135M on
CPU, R-KV rollouts, no training).

  python -m sparserl_jax.fetch smollm2-135m-instruct --out checkpoints/smollm2-135m
  python experiments/real/tail_study.py                 # calibrate fixed budgets, then run the schedule
  python experiments/real/tail_study.py --calibration sequential --out experiments/results/real/tail_sequential
  python experiments/real/tail_study.py --replot experiments/results/real/tail

Plan, fixed before the run. Sparrow (Zhou et al. 2026) finds sparse-rollout RL stable while the
5th percentile of the per-token agreement sum_v min(p_sparse(v), p_dense(v)) stays above a
threshold through the trajectory, and schedules the sparsity to hold it there. Phase 1 samples
every prompt with each fixed budget (--budgets) and measures that percentile in bins of
--every tokens seen (prompt included), as Sparrow pools each 2K-token bin over its batch. The
threshold tau is the pooled percentile of the reference budget (--reference). Phase 2 builds the
schedule: per bin, the smallest calibrated budget whose percentile in that bin reaches tau (the
largest where none does), and samples the same prompts with it. Hypothesis (Sparrow's, on this
model): the schedule holds the tail at tau or above in every bin, and saves more KV than the
reference budget at no larger mean mismatch (k3). One seed: the numbers are measured values, not
a verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from experiments.lib import figprov, workers  # import no JAX
from experiments.real import report
from experiments.real.schedule import schedule_for, sequential_schedule

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/
DEFAULT_CHECKPOINT = os.path.join(os.path.dirname(HERE), "checkpoints", "smollm2-135m")
DEFAULT_OUT = os.path.join(HERE, "results", "real", "tail")
CALIBRATIONS = ("per_bin", "sequential")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT, help="HF directory of the model")
    p.add_argument("--prompts", type=int, default=64, help="chat prompts (experiments/real/prompts.py)")
    p.add_argument("--max-new", type=int, default=128, help="response cap in tokens (temperature 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default="rkv", help="kv.policy")
    p.add_argument("--buffer", type=int, default=16, help="kv.buffer")
    p.add_argument("--budgets", type=int, nargs="+", default=[24, 32, 48, 64, 96], help="fixed budgets calibrated")
    p.add_argument("--reference", type=int, default=48, help="the fixed budget whose pooled tail sets tau")
    p.add_argument("--every", type=int, default=32, help="tokens seen per bin and per schedule entry")
    p.add_argument("--rows-per-call", type=int, default=64, help="prompts per sampler call")
    p.add_argument(
        "--calibration",
        choices=CALIBRATIONS,
        default="per_bin",
        help="per_bin: each bin's budget from the fixed budgets' percentile there (Sparrow's way); sequential: "
        "bin by bin, the candidates sampled with the earlier bins' chosen budgets in force, each kept only if "
        "its bin and every later bin hold their target",
    )
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if not os.path.isdir(args.checkpoint):
        p.error(
            f"--checkpoint={args.checkpoint} is not a directory; fetch it with "
            "python -m sparserl_jax.fetch smollm2-135m-instruct --out checkpoints/smollm2-135m"
        )
    if args.reference not in args.budgets:
        p.error(f"--reference={args.reference} must be one of --budgets={args.budgets}")
    for name in ("prompts", "max_new", "buffer", "every", "rows_per_call"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    return args


def _arm(args, name: str, budget: int, schedule: tuple[int, ...] = ()):
    """An arm of the measurement: real/mismatch.py's arm with this policy, budget and schedule."""
    from experiments.real import measure

    return measure.arm_from_args(args, name, policy=args.policy, budget=budget, schedule=schedule, every=args.every)


def _tail_job(job):
    from experiments.real import tail

    arm, every = job
    return tail.tail_arm(arm, every)


def run(args) -> dict:
    fixed = [_arm(args, f"{args.policy}@{b}", b) for b in args.budgets]
    rows = workers.parallel_map(_tail_job, [(a, args.every) for a in fixed])
    ref = next(r for r in rows if r["arm"]["budget"] == args.reference)
    tau = ref["agreement_p5"]
    name = f"{args.policy} schedule"
    trials = 0
    if args.calibration == "per_bin":
        schedule, final = schedule_for(rows, args.budgets, tau), None
    else:
        reached = {int(b) for r in rows for b in r["bins"]}

        def measure(schedules):
            arms = [_arm(args, name, max(s), s) for s in schedules]
            return workers.parallel_map(_tail_job, [(a, args.every) for a in arms])

        top = next(r for r in rows if r["arm"]["budget"] == max(args.budgets))
        ceiling = {int(b): v["p5"] for b, v in top["bins"].items()}
        schedule, sampled, final = sequential_schedule(max(reached) + 1, args.budgets, tau, reached, measure, ceiling)
        trials = len(sampled)
    if final is None:
        final = workers.parallel_map(_tail_job, [(_arm(args, name, max(schedule), schedule), args.every)])[0]
    rows.append(final)
    return {"rows": rows, "tau": tau, "schedule": list(schedule), "calibration": args.calibration, "trials": trials}


def main(argv=None) -> dict | None:
    given = sys.argv[1:] if argv is None else list(argv)
    if given[:1] == ["--replot"]:
        for directory in given[1:]:
            with open(os.path.join(directory, "results.json")) as f:
                data = json.load(f)
            report.write("tail", directory, data, cmd=data.pop("command"))
        return None
    args = parse_args(argv)
    t0 = time.perf_counter()
    start = figprov.provenance(workers.available_cores(), None)
    data = run(args)
    data["wall_s"] = time.perf_counter() - t0
    data["cores"] = len(workers.available_cores())
    data["provenance"] = {**start, "wall_s": round(data["wall_s"], 1)}
    data["settings"] = {k: v for k, v in vars(args).items() if k != "out"}
    cmd = report.command(argv) if argv is None else "python experiments/real/tail_study.py " + " ".join(given)
    report.write("tail", args.out, data, cmd=cmd)
    return data


if __name__ == "__main__":
    main()
