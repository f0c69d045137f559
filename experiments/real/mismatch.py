"""The three mismatches on a real model (SmolLM2-135M-Instruct on CPU), one command each:

  python experiments/real/mismatch.py eviction       # Sparse-RL: 4 policies x budgets vs dense
  python experiments/real/mismatch.py quantization   # QuRL: int8/fp8 W8A8/W8A16, +- invariant scaling,
                                                     #   and the update-masking code changes
  python experiments/real/mismatch.py lengths        # SortedRL: length tail, engine vs static
  python experiments/real/mismatch.py --replot experiments/results/real/eviction   # re-render, no measuring

Each writes experiments/results/real/<name>/ (results.md with this command and the tables,
results.json, <name>.png). Arms run in single-core worker processes, one per available core
(experiments/lib/workers.py). The checkpoint comes from
`python -m sparserl_jax.fetch smollm2-135m-instruct --out checkpoints/smollm2-135m`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from experiments.lib import figprov, workers  # import no JAX
from experiments.real import report
from sparserl_jax.kvcache.policies import POLICIES as REGISTRY  # starts no backend

HERE = os.path.dirname(os.path.abspath(__file__))

REPO = os.path.dirname(os.path.dirname(HERE))
DEFAULT_CHECKPOINT = os.path.join(REPO, "checkpoints", "smollm2-135m")
# the registry's eviction policies but random (a control, not a policy the papers measure)
POLICIES = tuple(p for p in REGISTRY if p not in ("none", "random"))
QUANT_ARMS = tuple((fmt, mode, s) for s in (0.0, 1.5) for fmt in ("int8", "fp8") for mode in ("w8a8", "w8a16"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("measurement", choices=("eviction", "quantization", "lengths"))
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT, help="HF directory of the model")
    p.add_argument("--prompts", type=int, default=64, help="chat prompts (experiments/real/prompts.py)")
    p.add_argument("--max-new", type=int, default=128, help="response cap in tokens (temperature 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--buffer", type=int, default=16, help="kv.buffer (and the dense decode chunk)")
    p.add_argument("--budgets", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--rows-per-call", type=int, default=64, help="prompts per sampler call")
    p.add_argument("--invariant-s", type=float, default=1.5)
    p.add_argument("--update-rows", type=int, default=8, help="rollouts in the update-masking step")
    p.add_argument("--slots", type=int, default=16, help="lengths: Q, slots = static batch rows")
    p.add_argument("--repeats", type=int, default=1, help="lengths: timed calls per engine")
    p.add_argument("--out", help="default experiments/results/real/<measurement>")
    args = p.parse_args(argv)
    if not os.path.isdir(args.checkpoint):
        p.error(
            f"--checkpoint={args.checkpoint} is not a directory; fetch it with "
            "python -m sparserl_jax.fetch smollm2-135m-instruct --out checkpoints/smollm2-135m"
        )
    for name in ("prompts", "max_new", "buffer", "rows_per_call", "update_rows", "slots", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    args.out = args.out or os.path.join(REPO, "experiments", "results", "real", args.measurement)
    return args


def _arm(args, name: str, **kw):
    from experiments.real import measure

    return measure.arm_from_args(args, name, **kw)


def _run_mismatch(arm):
    from experiments.real import measure

    return measure.mismatch_arm(arm)


def _run_job(job):
    """Worker entry: ("mismatch", arm) or ("update", arm)."""
    kind, arm = job
    if kind == "update":
        from experiments.real import update_mask

        return update_mask.update_arm(arm)
    return _run_mismatch(arm)


def eviction(args) -> dict:
    arms = [_arm(args, "dense")] + [
        _arm(args, f"{pol}@{b}", policy=pol, budget=b) for b in args.budgets for pol in args.policies
    ]
    rows = workers.parallel_map(_run_job, [("mismatch", a) for a in arms])
    return {"rows": rows}


def quantization(args) -> dict:
    s = args.invariant_s
    arms = [_arm(args, "full precision")] + [
        _arm(
            args,
            f"{fmt} {mode}" + (f" s={inv:g}" if inv else ""),
            quant=fmt,
            quant_mode=mode,
            invariant_s=s if inv else 0.0,
        )
        for fmt, mode, inv in QUANT_ARMS
    ]
    upd = [
        dataclasses.replace(_arm(args, f"update s={inv:g}", invariant_s=inv), prompts=args.update_rows)
        for inv in (0.0, s)
    ]
    jobs = [("update", a) for a in upd] + [("mismatch", a) for a in arms]
    out = workers.parallel_map(_run_job, jobs)
    return {"updates": out[:2], "rows": out[2:]}


def lengths(args) -> dict:
    arm = _arm(args, "dense")
    return {"run": workers.parallel_map(_lengths_job, [(arm, args.slots, args.repeats)])[0]}


def _lengths_job(job):
    from experiments.real import lengths as lengths_mod

    arm, slots, repeats = job
    return lengths_mod.lengths_arm(arm, slots=slots, repeats=repeats)


def main(argv=None) -> dict | None:
    given = sys.argv[1:] if argv is None else list(argv)
    if given[:1] == ["--replot"]:  # re-render results.md and the PNG from results.json, no measurement
        for directory in given[1:]:
            report.rerender(directory)
        return None
    args = parse_args(argv)
    t0 = time.perf_counter()
    start = figprov.provenance(workers.available_cores(), None)  # the commit at the run's start
    data = {"eviction": eviction, "quantization": quantization, "lengths": lengths}[args.measurement](args)
    data["wall_s"] = time.perf_counter() - t0
    data["cores"] = len(workers.available_cores())
    data["provenance"] = {**start, "wall_s": round(data["wall_s"], 1)}
    data["settings"] = {k: v for k, v in vars(args).items() if k != "out"}
    report.write(args.measurement, args.out, data, argv)
    return data


if __name__ == "__main__":
    main()
