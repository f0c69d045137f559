"""Figure c: eviction-policy ablation. Each policy's sparse rollouts trained without corrections
(naive sparse) and with them (Sparse-RL), next to dense rollouts.

  python experiments/fig_c_policies.py                     # 6 policies x 2 modes, seed 0
  python experiments/fig_c_policies.py --policies streaming snapkv --smoke

Every run uses the same warm start, budget, buffer and seed. Each model is evaluated densely and
under sparse inference with the policy it was trained with.
"""

from __future__ import annotations

import numpy as np

import figlib
from figlib import fmt
from sparserl_jax.kvcache.policies import POLICIES

MODES = ("naive_sparse", "sparse_rl")


def main(argv=None) -> dict:
    p = figlib.parser(__doc__)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = p.parse_args(argv)
    study = figlib.study_from_args(args)
    out = args.out or figlib.default_out("fig_c_policies", args.config)

    cells = []  # (policy, mode) rows
    study.train_all([dict(name=f"{policy}/{mode}/seed{s}", mode=mode, policy=policy, seed=s)
                     for policy in args.policies
                     for mode in (("dense",) if policy == "none" else MODES) for s in args.seeds])
    for policy in args.policies:
        for mode in (("dense",) if policy == "none" else MODES):
            runs = [study.arm(f"{policy}/{mode}/seed{s}", mode=mode, policy=policy, seed=s)
                    for s in args.seeds]
            sparse_policy = policy if policy != "none" else study.base.kv.policy
            per_seed = [figlib.scores(r, sparse_policy) for r in runs]
            cells.append({"policy": policy, "mode": mode, "sparse_inference_policy": sparse_policy,
                          "per_seed": per_seed})

    kvc = study.base.kv
    lines = [
        f"Budget {kvc.budget} + buffer {kvc.buffer}, window {kvc.window}, selection {kvc.selection}; "
        f"{study.base.train.iterations} iterations; seeds {args.seeds}. Sparse inference uses the "
        f"policy the model was trained with (the dense arm: {kvc.policy}).",
        "",
        "| rollout policy | mode | acc. dense inf. | acc. sparse inf. | train reward (last 25%) | "
        "KV saving | mismatch KL (k3) | token reject | seq reject |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        col = lambda k: [r[k] for r in c["per_seed"]]  # noqa: E731
        lines.append(
            f"| {c['policy']} | {c['mode']} | {fmt(col('dense_acc'))} | {fmt(col('sparse_acc'))} | "
            f"{fmt(col('train_reward_last25'))} | {fmt(col('train_kv_saving'), '.1%')} | "
            f"{fmt(col('mismatch_kl_k3'), '.4f')} | {fmt(col('token_reject_rate'))} | "
            f"{fmt(col('seq_reject_rate'))} |"
        )

    fig, axes = figlib.plt.subplots(1, 3, figsize=(15, 3.6))
    labels = [f"{c['policy']}\n{c['mode'].replace('_', ' ')}" for c in cells]
    for ax, key, title in zip(axes, ("dense_acc", "sparse_acc", "mismatch_kl_k3"),
                              ("accuracy, dense inference", "accuracy, sparse inference",
                               "mismatch KL (k3) during training")):
        stats = [figlib.mean_std(r[key] for r in c["per_seed"]) for c in cells]
        colors = ["gray" if c["mode"] == "dense" else "C0" if c["mode"] == "naive_sparse" else "C1"
                  for c in cells]
        ax.bar(np.arange(len(cells)), [m for m, _ in stats], yerr=[s for _, s in stats],
               color=colors, capsize=3)
        ax.set_xticks(np.arange(len(cells)), labels, fontsize=7, rotation=60)
        ax.set_title(title)
    data = {"cells": cells, "seeds": args.seeds, "kv": dict(budget=kvc.budget, buffer=kvc.buffer)}
    figlib.write_outputs(out, "Figure c: eviction-policy ablation", "\n".join(lines), data, fig,
                         "policies", study)
    return data


if __name__ == "__main__":
    main()
