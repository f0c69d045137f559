"""How much does the warm start's robustness to eviction vary with the SFT draw?

  python experiments/warm_start_spread.py                      # seeds 0-3, R-KV budgets 48 and 64
  python experiments/warm_start_spread.py --seeds 0 1 --budgets 48 --smoke

The default experiment's RL arms all start from one warm start (SFT with train.seed). Its dense
accuracy is stable, but how often R-KV keeps the far-back key (its sparse-inference accuracy) is
a property of the SFT'd weights: this trains one warm start per seed (parallel single-core
processes with the portable CPU settings of workers.py), evaluates each under dense inference and
under the config's policy at each budget, and writes the spread to
experiments/results/warm_start_spread/ (results.md, results.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import workers  # noqa: E402  (imports no JAX)
from figlib import command_line, fmt, smoke_overrides  # noqa: E402
from sparserl_jax.config import load_config  # noqa: E402
from sparserl_jax.train import Trainer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _warm_start(job) -> dict:
    """Worker: one warm start (SFT only) with train.seed=seed, evaluated dense and sparse."""
    config, overrides, out_dir, seed, budgets = job
    cfg = load_config([config], overrides + [f"train.out_dir={out_dir}", "train.iterations=0",
                                             f"train.seed={seed}"])
    trainer = Trainer(cfg)
    trainer.run()
    n = cfg.train.eval_prompts
    row = {"seed": seed, "dense_acc": trainer.evaluate(
        kv_cfg=dataclasses.replace(cfg.kv, policy="none"), n=n)["accuracy"]}
    for b in budgets:
        ev = trainer.evaluate(kv_cfg=dataclasses.replace(cfg.kv, budget=b), n=n)
        row[f"sparse_acc@{b}"] = ev["accuracy"]
        row[f"kv_saving@{b}"] = ev["kv_saving"]
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(HERE, "configs", "walk_key_rkv.yaml"))
    p.add_argument("--out", default=os.path.join(HERE, "results", "warm_start_spread"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--budgets", type=int, nargs="+", default=[48, 64])
    p.add_argument("--smoke", action="store_true", help="a seconds-long run (tests)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    overrides = list(args.overrides) + ["train.progress=false"]
    if args.smoke:
        overrides += smoke_overrides(args.config, overrides)
    t0 = time.perf_counter()
    jobs = [(args.config, overrides, os.path.join(args.out, "runs", f"seed{s}"), s, args.budgets)
            for s in args.seeds]
    rows = workers.parallel_map(_warm_start, jobs)
    base = load_config([args.config], overrides)
    cols = ["dense_acc"] + [f"sparse_acc@{b}" for b in args.budgets]
    lines = [f"Warm starts of `{os.path.relpath(args.config, os.path.dirname(HERE))}` (task "
             f"{base.data.task}), one per train.seed; sparse inference with {base.kv.policy} "
             f"(buffer {base.kv.buffer}); avg@1 on {base.train.eval_prompts} held-out prompts.", "",
             "| train.seed | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {r['seed']} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |" for r in rows]
    lines.append("| mean ± std | " + " | ".join(fmt([r[c] for r in rows], ".3f") for c in cols) + " |")
    lines += ["", f"KV saving: " + ", ".join(f"budget {b}: {rows[0][f'kv_saving@{b}']:.1%}"
                                             for b in args.budgets)
              + f". Wall time {time.perf_counter() - t0:.0f} s on {len(workers.available_cores())} core(s)."]
    md = "\n".join(lines)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(f"# Warm-start spread\n\nCommand: `{command_line()}`\n\n{md}\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"command": command_line(), "rows": rows}, f, indent=1)
    print(md)
    return {"rows": rows}


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
