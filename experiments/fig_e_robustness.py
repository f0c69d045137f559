"""Figure e: sparse-inference robustness (paper claim: models trained with Sparse-RL are more
robust when inference uses the same compression). The warm start, a dense-trained and a
Sparse-RL-trained model are evaluated under every eviction policy and budget.

  python experiments/fig_e_robustness.py                   # 5 policies x 3 budgets, seed 0
  python experiments/fig_e_robustness.py --policies snapkv --budgets 24 --smoke

The models are the runs of figure a (same configs, fig_a_curves.arm_extra included, reused from
the run cache when present); the Sparse-RL model was trained with the base config's policy and
budget. Accuracies are avg@1 on --eval-prompts held-out prompts (at least figlib.EVAL_PROMPTS).

  python experiments/fig_e_robustness.py --replot experiments/results/fig_e_robustness/walk_key
re-renders robustness.png and results.md from a committed results.json (no training).
"""

from __future__ import annotations

import numpy as np

import fig_a_curves
import figlib
from figlib import fmt
from sparserl_jax.kvcache.policies import POLICIES

SPARSE_POLICIES = [p for p in POLICIES if p != "none"]


def main(argv=None) -> dict:
    p = figlib.parser(__doc__, replot=True)
    p.add_argument("--policies", nargs="+", default=SPARSE_POLICIES, choices=SPARSE_POLICIES)
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 24, 48])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = p.parse_args(argv)
    if args.replot:
        data, base = figlib.load_results(args.replot)
        render(data, base, args.replot, replot=True)
        return data
    study = figlib.study_from_args(args)
    out = args.out or figlib.default_out("fig_e_robustness", args.config)
    train_policy = study.base.kv.policy
    n_eval = figlib.eval_prompts(args, study)
    extra = fig_a_curves.arm_extra(args.smoke)  # figure a's runs
    models = {
        "warm start": [study.warm_start()],
        "dense-trained": [study.arm(f"dense/seed{s}", mode="dense", policy="none", seed=s, extra=extra)
                          for s in args.seeds],
        "sparse_rl-trained": [study.arm(f"sparse_rl/seed{s}", mode="sparse_rl", policy=train_policy,
                                        seed=s, extra=extra) for s in args.seeds],
    }
    grid = {}  # model -> "dense" or "policy@budget" -> [accuracy per seed]
    for name, runs in models.items():
        grid[name] = {"dense": [r.evaluate({"policy": "none"}, n=n_eval)["accuracy"] for r in runs]}
        for policy in args.policies:
            for budget in args.budgets:
                kv = {"policy": policy, "budget": budget}
                grid[name][f"{policy}@{budget}"] = [r.evaluate(kv, n=n_eval)["accuracy"] for r in runs]
    data = {"grid": grid, "retained_sparse_over_dense": retained_ratios(grid, args.policies, args.budgets),
            "seeds": args.seeds, "policies": args.policies, "budgets": args.budgets,
            "eval_prompts": n_eval}
    render(data, study.base, out, study=study)
    return data


def retained_ratios(grid: dict, policies, budgets) -> dict:
    """Per model: mean accuracy over the sparse columns / its dense accuracy."""
    columns = [f"{p}@{b}" for p in policies for b in budgets]
    out = {}
    for name, row in grid.items():
        sparse_mean = np.mean([np.mean(row[c]) for c in columns])
        out[name] = float(sparse_mean / max(np.mean(row["dense"]), 1e-9))
    return out


def render(data: dict, base, out: str, study=None, replot: bool = False) -> None:
    """results.md and robustness.png of `data` (a fresh run's, or a committed results.json's)."""
    grid, seeds = data["grid"], data["seeds"]
    policies, budgets = data["policies"], data["budgets"]
    n_eval = data.get("eval_prompts", base.train.eval_prompts)
    command = data["command"] if replot else figlib.command_line()
    columns = ["dense"] + [f"{p}@{b}" for p in policies for b in budgets]
    lines = [
        f"Accuracy (avg@1, {n_eval} held-out prompts) under dense inference "
        f"and under each policy@budget (buffer {base.kv.buffer}); Sparse-RL trained with "
        f"{base.kv.policy}@{base.kv.budget}; seeds {seeds}. Last column: mean accuracy "
        "over the sparse columns divided by the model's dense accuracy.",
        "",
        "| model | " + " | ".join(columns) + " | sparse / dense |",
        "|---|" + "---|" * (len(columns) + 1),
    ]
    retained = retained_ratios(grid, policies, budgets)
    for name, row in grid.items():
        lines.append(f"| {name} | " + " | ".join(fmt(row[c]) for c in columns)
                     + f" | {retained[name]:.0%} |")

    vmax = max(1e-3, max(np.mean(v) for r in grid.values() for v in r.values()))
    fig, axes = figlib.plt.subplots(1, len(grid), figsize=(figlib.PANEL_W * len(grid) + 0.8,
                                                           0.9 + 0.42 * len(policies) + 0.5),
                                    sharey=True, layout="constrained")
    axes = np.atleast_1d(axes)
    for ax, (name, row) in zip(axes, grid.items()):
        stats = [[figlib.mean_std(row[f"{p}@{b}"]) for b in budgets] for p in policies]
        mat = np.array([[m for m, _ in r] for r in stats])
        im = ax.imshow(mat, vmin=0, vmax=vmax, cmap="viridis", aspect="auto")
        for i in range(mat.shape[0]):
            for j in range(mat.shape[1]):
                m, sd = stats[i][j]
                n = len(row[f"{policies[i]}@{budgets[j]}"])
                text = f"{m:.2f}" if n == 1 else f"{m:.2f}\n±{sd:.2f}"
                ax.text(j, i, text, ha="center", va="center", fontsize=8, linespacing=0.9,
                        color="k" if m > 0.6 * vmax else "w")
        ax.set_xticks(range(len(budgets)), [str(b) for b in budgets])
        ax.set_yticks(range(len(policies)), policies)
        ax.set_xlabel(f"inference KV budget (tokens, + buffer {base.kv.buffer})")
        d_m, d_s = figlib.mean_std(row["dense"])
        dense = f"{d_m:.2f}" if len(row["dense"]) == 1 else f"{d_m:.2f} ± {d_s:.2f}"
        ax.set_title(f"{name} (n={len(row['dense'])})\ndense inference: {dense}", fontsize=9)
    axes[0].set_ylabel("inference eviction policy")
    fig.colorbar(im, ax=axes, label=f"accuracy (avg@1, {n_eval} prompts)", shrink=0.9, pad=0.02)
    title = figlib.run_title(base, command, seeds, "Figure e, sparse-inference robustness "
                             f"(Sparse-RL trained with {base.kv.policy}@{base.kv.budget})")
    fig.suptitle(title)
    caption = (
        f"Figure: held-out accuracy (avg@1 on {n_eval} prompts) of the warm start, a dense-trained "
        "and a Sparse-RL-trained model under sparse inference with each eviction policy (rows) and "
        "KV budget (columns); each cell gives the mean and, with more than one seed, ± one sample "
        "standard deviation over the trained models' seeds (the warm start is one model). Colour: "
        f"the mean, on one scale for all panels. Seeds {seeds}.")
    figlib.write_outputs(out, "Figure e: sparse-inference robustness", "\n".join(lines), data, fig,
                         "robustness", study, caption=caption, replot=replot)


if __name__ == "__main__":
    main()
