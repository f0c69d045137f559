"""The default experiment: dense vs naive sparse vs Sparse-RL rollouts from one warm start.

  python experiments/default.py            # about 10 minutes on 2 CPU cores
  python experiments/default.py --smoke    # seconds, for tests

1. Warm-start (SFT) a tiny model on a synthetic long-range task (key-value recall: the answer
   sits in one of the first lines of a long prompt).
2. From that start, with the same seed and KV budget, train three arms: dense rollouts, naive
   sparse rollouts (compressed KV, trained as if on-policy) and Sparse-RL (compressed KV with
   rejection sampling and importance reweighting).
3. Evaluate every model under dense and under sparse inference, and write a markdown table,
   JSON and a PNG of the training curves to experiments/results/default/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from figlib import SMOKE_OVERRIDES  # noqa: E402
from sparserl_jax import kvcache as kv  # noqa: E402
from sparserl_jax.config import dump_config, load_config  # noqa: E402
from sparserl_jax.train import Trainer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ARMS = {  # arm name -> (rl.mode, sparse rollouts?)
    "dense": ("dense", False),
    "naive_sparse": ("naive_sparse", True),
    "sparse_rl": ("sparse_rl", True),
}
CURVES = ("reward/mean", "response/length_mean", "loss/entropy", "mismatch/kl_k3",
          "sars/token_reject_rate")


def evaluate_both(trainer: Trainer, sparse_kv: kv.KVConfig, n: int) -> dict:
    dense_kv = dataclasses.replace(sparse_kv, policy="none")
    dense = trainer.evaluate(kv_cfg=dense_kv, n=n)
    sparse = trainer.evaluate(kv_cfg=sparse_kv, n=n)
    return {"dense_acc": dense["accuracy"], "sparse_acc": sparse["accuracy"],
            "sparse_kv_saving": sparse["kv_saving"]}


def run(config: str, overrides: list[str], out_dir: str, log=print) -> dict:
    base = load_config([config], overrides)
    work = os.path.join(out_dir, "runs")
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.perf_counter()

    # 1. the shared warm start (SFT only, no RL iterations)
    warm_dir = os.path.join(work, "warm_start")
    warm = Trainer(load_config([config], overrides + [f"train.out_dir={warm_dir}", "train.iterations=0"]),
                   log=log)
    warm.run()
    n_eval = base.train.eval_prompts
    results = {"warm_start": evaluate_both(warm, base.kv, n_eval)}
    log(f"warm start: {results['warm_start']}  ({time.perf_counter() - t0:.0f}s)")

    # 2. three arms from the same start, seed and budget
    histories = {}
    for arm, (mode, sparse) in ARMS.items():
        policy = base.kv.policy if sparse else "none"
        arm_overrides = overrides + [
            f"train.out_dir={os.path.join(work, arm)}", f"model.init_from={warm_dir}",
            "sft.steps=0", f"rl.mode={mode}", f"kv.policy={policy}",
        ]
        trainer = Trainer(load_config([config], arm_overrides), log=log)
        histories[arm] = trainer.run()
        last = histories[arm][-max(len(histories[arm]) // 4, 1):]
        results[arm] = {
            **evaluate_both(trainer, base.kv, n_eval),
            "train_kv_saving": float(np.mean([h["kv/saving"] for h in histories[arm]])),
            "token_reject_rate": float(np.mean([h.get("sars/token_reject_rate", 0) for h in last])),
            "seq_reject_rate": float(np.mean([h.get("sars/seq_reject_rate", 0) for h in last])),
            "mismatch_kl_k3": float(np.mean([h["mismatch/kl_k3"] for h in histories[arm]])),
            "final_train_reward": float(np.mean([h["reward/mean"] for h in last])),
        }
        log(f"{arm}: {results[arm]}  ({time.perf_counter() - t0:.0f}s)")
    results["seconds"] = time.perf_counter() - t0
    dump_config(base, os.path.join(out_dir, "config.yaml"))
    write_outputs(results, histories, base, out_dir)
    return results


def table(results: dict, base) -> str:
    kvc = base.kv
    lines = [
        f"KV policy for sparse rollouts and sparse inference: {kvc.policy}, budget {kvc.budget}, "
        f"buffer {kvc.buffer}, compress_prompt={kvc.compress_prompt}; task {base.data.task}; "
        f"{base.train.iterations} iterations of {base.rollout.prompts}x{base.rollout.samples} rollouts; "
        f"accuracy is avg@1 on {base.train.eval_prompts} held-out prompts (temperature "
        f"{base.rollout.temperature}).",
        "",
        "| model | acc. dense inference | acc. sparse inference | KV saving (train rollouts) "
        "| token reject | seq reject | mismatch KL (k3) | train reward (last 25%) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    w = results["warm_start"]
    lines.append(f"| warm start | {w['dense_acc']:.3f} | {w['sparse_acc']:.3f} | - | - | - | - | - |")
    for arm in ARMS:
        r = results[arm]
        lines.append(
            f"| {arm} | {r['dense_acc']:.3f} | {r['sparse_acc']:.3f} | {r['train_kv_saving']:.1%} "
            f"| {r['token_reject_rate']:.3f} | {r['seq_reject_rate']:.3f} | {r['mismatch_kl_k3']:.4f} "
            f"| {r['final_train_reward']:.3f} |"
        )
    lines.append("")
    lines.append(f"Sparse inference KV saving: {results['sparse_rl']['sparse_kv_saving']:.1%} of the "
                 f"entries a dense cache holds. Wall time: {results['seconds']:.0f} s.")
    return "\n".join(lines)


def write_outputs(results: dict, histories: dict, base, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    md = table(results, base)
    command = "python " + " ".join(sys.argv)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(f"# Default experiment\n\nCommand: `{command}`\n\n{md}\n")
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"command": command, "results": results, "histories": histories}, f, indent=1)
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3.2))
    for ax, key in zip(axes, CURVES):
        for arm, hist in histories.items():
            ax.plot([h["step"] if "step" in h else i + 1 for i, h in enumerate(hist)],
                    [h.get(key, np.nan) for h in hist], label=arm)
        ax.set_title(key)
        ax.set_xlabel("iteration")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "curves.png"), dpi=110)
    plt.close(fig)
    print(md)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(HERE, "configs", "default.yaml"))
    p.add_argument("--out", default=os.path.join(HERE, "results", "default"))
    p.add_argument("--smoke", action="store_true", help="a seconds-long run (tests)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    overrides = list(args.overrides)
    if args.smoke:
        overrides += [*SMOKE_OVERRIDES, "train.progress=false"]
    return run(args.config, overrides, args.out)


if __name__ == "__main__":
    main()
