"""Figure e: sparse-inference robustness (paper claim: models trained with Sparse-RL are more
robust when inference uses the same compression). The warm start, a dense-trained and a
Sparse-RL-trained model are evaluated under every eviction policy and budget.

  python experiments/fig_e_robustness.py                   # 5 policies x 3 budgets, seed 0
  python experiments/fig_e_robustness.py --policies snapkv --budgets 24 --smoke

The models are the runs of figure a (same configs, reused from the run cache when present); the
Sparse-RL model was trained with the base config's policy and budget.
"""

from __future__ import annotations

import numpy as np

import figlib
from figlib import fmt
from sparserl_jax.kvcache.policies import POLICIES

SPARSE_POLICIES = [p for p in POLICIES if p != "none"]


def main(argv=None) -> dict:
    p = figlib.parser(__doc__)
    p.add_argument("--policies", nargs="+", default=SPARSE_POLICIES, choices=SPARSE_POLICIES)
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 24, 48])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = p.parse_args(argv)
    study = figlib.study_from_args(args)
    out = args.out or figlib.default_out("fig_e_robustness", args.config)
    train_policy = study.base.kv.policy
    models = {
        "warm start": [study.warm_start()],
        "dense-trained": [study.arm(f"dense/seed{s}", mode="dense", policy="none", seed=s)
                          for s in args.seeds],
        "sparse_rl-trained": [study.arm(f"sparse_rl/seed{s}", mode="sparse_rl",
                                        policy=train_policy, seed=s) for s in args.seeds],
    }
    grid = {}  # model -> "dense" or "policy@budget" -> [accuracy per seed]
    for name, runs in models.items():
        grid[name] = {"dense": [r.evaluate({"policy": "none"})["accuracy"] for r in runs]}
        for policy in args.policies:
            for budget in args.budgets:
                kv = {"policy": policy, "budget": budget}
                grid[name][f"{policy}@{budget}"] = [r.evaluate(kv)["accuracy"] for r in runs]
    columns = ["dense"] + [f"{p}@{b}" for p in args.policies for b in args.budgets]

    lines = [
        f"Accuracy (avg@1, {study.base.train.eval_prompts} held-out prompts) under dense inference "
        f"and under each policy@budget (buffer {study.base.kv.buffer}); Sparse-RL trained with "
        f"{train_policy}@{study.base.kv.budget}; seeds {args.seeds}. Last column: mean accuracy "
        "over the sparse columns divided by the model's dense accuracy.",
        "",
        "| model | " + " | ".join(columns) + " | sparse / dense |",
        "|---|" + "---|" * (len(columns) + 1),
    ]
    retained = {}
    for name, row in grid.items():
        sparse_mean = np.mean([np.mean(row[c]) for c in columns[1:]])
        retained[name] = float(sparse_mean / max(np.mean(row["dense"]), 1e-9))
        lines.append(f"| {name} | " + " | ".join(fmt(row[c]) for c in columns)
                     + f" | {retained[name]:.0%} |")

    fig, axes = figlib.plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.6), sharey=True)
    for ax, (name, row) in zip(np.atleast_1d(axes), grid.items()):
        mat = np.array([[np.mean(row[f"{p}@{b}"]) for b in args.budgets] for p in args.policies])
        im = ax.imshow(mat, vmin=0, vmax=max(1e-3, max(np.mean(v) for r in grid.values()
                                                      for v in r.values())), cmap="viridis")
        for i in range(mat.shape[0]):
            for j in range(mat.shape[1]):
                ax.text(j, i, f"{mat[i, j]:.2f}", ha="center", va="center", color="w", fontsize=8)
        ax.set_xticks(range(len(args.budgets)), [f"B={b}" for b in args.budgets])
        ax.set_yticks(range(len(args.policies)), args.policies)
        ax.set_title(f"{name} (dense {np.mean(row['dense']):.2f})")
    fig.colorbar(im, ax=axes, shrink=0.8)
    data = {"grid": grid, "retained_sparse_over_dense": retained, "seeds": args.seeds,
            "policies": args.policies, "budgets": args.budgets}
    figlib.write_outputs(out, "Figure e: sparse-inference robustness", "\n".join(lines), data, fig,
                         "robustness", study)
    return data


if __name__ == "__main__":
    main()
