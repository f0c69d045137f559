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


def arguments(p) -> None:
    p.add_argument("--policies", nargs="+", default=SPARSE_POLICIES, choices=SPARSE_POLICIES)
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 24, 48])


def run(args, study) -> dict:
    train_policy = study.base.kv.policy
    n_eval = figlib.eval_prompts(args, study)
    extra = fig_a_curves.arm_extra(args.smoke)  # figure a's runs
    specs = {"dense-trained": lambda s: dict(name=f"dense/seed{s}", mode="dense", policy="none", seed=s, extra=extra),
             "sparse_rl-trained": lambda s: dict(name=f"sparse_rl/seed{s}", mode="sparse_rl",
                                                 policy=train_policy, seed=s, extra=extra)}
    study.train_all([spec(s) for spec in specs.values() for s in args.seeds])
    models = {"warm start": [study.warm_start()],
              **{name: [study.arm(**spec(s)) for s in args.seeds] for name, spec in specs.items()}}
    grid = {}  # model -> "dense" or "policy@budget" -> [accuracy per seed]
    for name, runs in models.items():
        grid[name] = {"dense": [r.evaluate({"policy": "none"}, n=n_eval)["accuracy"] for r in runs]}
        for policy in args.policies:
            for budget in args.budgets:
                kv = {"policy": policy, "budget": budget}
                grid[name][f"{policy}@{budget}"] = [r.evaluate(kv, n=n_eval)["accuracy"] for r in runs]
    return {"grid": grid, "retained_sparse_over_dense": retained_ratios(grid, args.policies, args.budgets),
            "seeds": args.seeds, "policies": args.policies, "budgets": args.budgets, "eval_prompts": n_eval,
            "collapse_iteration": {name: [figlib.reward_collapse_iteration(r.history) for r in runs]
                                   for name, runs in models.items() if name != "warm start"}}


def retained_ratios(grid: dict, policies, budgets) -> dict:
    """Per model: mean accuracy over the sparse columns / its dense accuracy."""
    columns = [f"{p}@{b}" for p in policies for b in budgets]
    out = {}
    for name, row in grid.items():
        sparse_mean = np.mean([np.mean(row[c]) for c in columns])
        out[name] = float(sparse_mean / max(np.mean(row["dense"]), 1e-9))
    return out


def _heatmap(ax, stats, policies, budgets, vmin, vmax, cmap, spec="{:.2f}"):
    """One model's (or difference's) grid: mean per cell, ± std with several seeds."""
    mat = np.array([[m for m, _ in r] for r in stats])
    im = ax.imshow(mat, vmin=vmin, vmax=vmax, cmap=cmap, aspect="auto")
    for i in range(mat.shape[0]):
        for j in range(mat.shape[1]):
            m, sd = stats[i][j]
            text = spec.format(m) + ("" if sd is None else f"\n±{sd:.2f}")
            level = (m - vmin) / max(vmax - vmin, 1e-9)  # where the colour sits on its scale
            light = level >= 0.6 if vmin == 0 else 0.2 < level < 0.8  # viridis: light above; RdBu: mid
            ax.text(j, i, text, ha="center", va="center", fontsize=7, linespacing=0.9,
                    color="k" if light else "w")
    ax.set_xticks(range(len(budgets)), [str(b) for b in budgets])
    ax.set_yticks(range(len(policies)), policies)
    return im


def render(data: dict, base, command: str) -> figlib.Rendered:
    grid, seeds = data["grid"], data["seeds"]
    policies, budgets = data["policies"], data["budgets"]
    n_eval = data.get("eval_prompts", base.train.eval_prompts)
    columns = ["dense"] + [f"{p}@{b}" for p in policies for b in budgets]
    warm_dense = grid["warm start"]["dense"][0]
    its = data.get("collapse_iteration", {})
    lines = [
        f"Accuracy (avg@1, {n_eval} held-out prompts) under dense inference "
        f"and under each policy@budget (buffer {base.kv.buffer}); Sparse-RL trained with "
        f"{base.kv.policy}@{base.kv.budget} from warm start 0; seeds {seeds}. Last columns: mean accuracy "
        "over the sparse columns divided by the model's dense accuracy, and both collapse rules.",
        "",
        "| model | " + " | ".join(columns) + " | sparse / dense | collapsed (accuracy rule) | collapsed (reward rule) |",
        "|---|" + "---|" * (len(columns) + 3),
    ]
    retained = retained_ratios(grid, policies, budgets)
    for name, row in grid.items():
        if name == "warm start":
            acc = reward = "-"
        else:
            rows = [{"dense_acc": a, **({"collapse_iteration": its[name][i]} if name in its else {})}
                    for i, a in enumerate(row["dense"])]
            acc, reward = figlib.collapse_cells(rows, [warm_dense] * len(rows))
        lines.append(f"| {name} | " + " | ".join(fmt(row[c]) for c in columns)
                     + f" | {retained[name]:.0%} | {acc} | {reward} |")
    cs = []
    if "sparse_rl-trained" in grid and "dense-trained" in grid:
        a, b = grid["sparse_rl-trained"], grid["dense-trained"]
        for c in columns:
            cs += figlib.compare("Sparse-RL-trained", [{"acc": x, "seed": i} for i, x in enumerate(a[c])],
                                 "dense-trained", [{"acc": x, "seed": i} for i, x in enumerate(b[c])],
                                 "acc", n_eval, metric=c)
        verdicts = [c.verdict for c in cs]
        lines += ["", figlib.COLLAPSE_NOTE, "",
                  f"Sparse-RL-trained minus dense-trained, per cell (by seed): Sparse-RL ahead in "
                  f"{sum('Sparse-RL' in v for v in verdicts)}, dense-trained ahead in "
                  f"{sum('dense-trained' in v for v in verdicts)}, tie in {verdicts.count('tie')} of "
                  f"{len(cs)} cells.", "", *figlib.comparison_table(cs), "", figlib.TIE_NOTE]

    vmax = max(1e-3, max(np.mean(v) for r in grid.values() for v in r.values()))
    fig, axes = figlib.plt.subplots(2, 2, figsize=(2 * figlib.PANEL_W + 0.6, 2 * (1.1 + 0.38 * len(policies)) + 1.0),
                                    sharey=True, layout="constrained")
    axes = axes.ravel()
    sd = lambda v: figlib.mean_std(v)[1] if len(v) > 1 else None  # noqa: E731
    for ax, (name, row) in zip(axes, grid.items()):
        stats = [[(float(np.mean(row[f"{p}@{b}"])), sd(row[f"{p}@{b}"])) for b in budgets] for p in policies]
        im = _heatmap(ax, stats, policies, budgets, 0.0, vmax, "viridis")
        d_m, d_s = figlib.mean_std(row["dense"])
        dense = f"{d_m:.2f}" if len(row["dense"]) == 1 else f"{d_m:.2f} ± {d_s:.2f}"
        ax.set_title(f"{name} (n={len(row['dense'])})\ndense inference: {dense}", fontsize=9)
    fig.colorbar(im, ax=axes[1], label=f"accuracy (avg@1,\n{n_eval} prompts)", pad=0.02)
    if "sparse_rl-trained" in grid and "dense-trained" in grid:
        a, b = grid["sparse_rl-trained"], grid["dense-trained"]
        diffs = [[np.subtract(a[f"{p}@{bb}"], b[f"{p}@{bb}"]) for bb in budgets] for p in policies]
        stats = [[(float(np.mean(d)), sd(list(d))) for d in r] for r in diffs]
        lim = max(0.05, max(abs(m) for r in stats for m, _ in r))
        im = _heatmap(axes[3], stats, policies, budgets, -lim, lim, "RdBu", "{:+.2f}")
        axes[3].set_title("Sparse-RL-trained minus dense-trained\n(paired by seed)", fontsize=9)
        fig.colorbar(im, ax=axes[3], label="accuracy difference", shrink=0.8, pad=0.02)
    for ax in axes[2:]:
        ax.set_xlabel(f"inference KV budget (tokens, + buffer {base.kv.buffer})")
    for ax in axes[::2]:
        ax.set_ylabel("inference eviction policy")
    fig.suptitle(figlib.run_title(base, command, seeds, "Figure e, sparse-inference robustness "
                                  f"(Sparse-RL trained with {base.kv.policy}@{base.kv.budget})"))
    caption = (
        f"Figure: held-out accuracy (avg@1 on {n_eval} prompts) of the warm start, a dense-trained "
        "and a Sparse-RL-trained model under sparse inference with each eviction policy (rows) and "
        "KV budget (columns); each cell gives the mean and, with more than one seed, ± one sample "
        "standard deviation over the trained models' seeds (the warm start is one model). Colour: "
        "the mean, on one scale for the three model panels; bottom right: the Sparse-RL-trained "
        "minus the dense-trained model's accuracy, mean (± std) of the per-seed differences, on a "
        f"diverging scale. Seeds {seeds}.")
    return figlib.Rendered("Figure e: sparse-inference robustness", "\n".join(lines), {"robustness": fig}, caption)


FIGURE = figlib.Figure("fig_e_robustness", __doc__, run, render, arguments, seeds=(0,))

main = FIGURE.main


if __name__ == "__main__":
    main()
