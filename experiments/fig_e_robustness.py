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

from sparserl_jax.experiments import fig_a_curves, figlib
from sparserl_jax.experiments.figlib import fmt
from sparserl_jax.kvcache.policies import POLICIES

SPARSE_POLICIES = [p for p in POLICIES if p != "none"]


def run(args, study) -> dict:
    train_policy = study.base.kv.policy
    n_eval = figlib.eval_prompts(args, study)
    extra = fig_a_curves.arm_extra(args.smoke)  # figure a's runs
    specs = {
        "dense-trained": lambda s: dict(name=f"dense/seed{s}", mode="dense", policy="none", seed=s, extra=extra),
        "sparse_rl-trained": lambda s: dict(
            name=f"sparse_rl/seed{s}", mode="sparse_rl", policy=train_policy, seed=s, extra=extra
        ),
    }
    study.train_all([spec(s) for spec in specs.values() for s in args.seeds])
    models = {
        "warm start": [study.warm_start()],
        **{name: [study.arm(**spec(s)) for s in args.seeds] for name, spec in specs.items()},
    }
    grid = {
        name: {
            "dense": figlib.accuracies(runs, {"policy": "none"}, n_eval),  # [accuracy per seed]
            **{
                f"{p}@{b}": figlib.accuracies(runs, {"policy": p, "budget": b}, n_eval)
                for p in args.policies
                for b in args.budgets
            },
        }
        for name, runs in models.items()
    }
    return {
        "grid": grid,
        "retained_sparse_over_dense": retained_ratios(grid, args.policies, args.budgets),
        "seeds": args.seeds,
        "policies": args.policies,
        "budgets": args.budgets,
        "eval_prompts": n_eval,
        "collapse_iteration": {
            name: [figlib.reward_collapse_iteration(r.history) for r in runs]
            for name, runs in models.items()
            if name != "warm start"
        },
    }


def retained_ratios(grid: dict, policies, budgets) -> dict:
    """Per model: mean accuracy over the sparse columns / its dense accuracy."""
    columns = [f"{p}@{b}" for p in policies for b in budgets]
    return {
        name: float(figlib.ratio_of_means([np.mean(row[c]) for c in columns], row["dense"]))
        for name, row in grid.items()
    }


def render(data: dict, base, command: str) -> figlib.Rendered:
    grid, seeds = data["grid"], data["seeds"]
    policies, budgets = data["policies"], data["budgets"]
    n_eval = data.get("eval_prompts", base.train.eval_prompts)
    columns = ["dense"] + [f"{p}@{b}" for p in policies for b in budgets]
    warm_dense = grid["warm start"]["dense"][0]
    its = data.get("collapse_iteration", {})
    retained = retained_ratios(grid, policies, budgets)
    body = []
    for name, row in grid.items():  # both collapse rules for the trained models, '-' for the warm start
        collapse = (
            ("-", "-") if name == "warm start" else figlib.seed_collapse_cells(row["dense"], its.get(name), warm_dense)
        )
        body.append([name, *(fmt(row[c]) for c in columns), f"{retained[name]:.0%}", *collapse])
    lines = [
        f"Accuracy (avg@1, {n_eval} held-out prompts) under dense inference "
        f"and under each policy@budget (buffer {base.kv.buffer}); Sparse-RL trained with "
        f"{base.kv.policy}@{base.kv.budget} from warm start 0; seeds {seeds}. Last columns: mean accuracy "
        "over the sparse columns divided by the model's dense accuracy, and both collapse rules.",
        "",
        *figlib.md_table(["model", *columns, "sparse / dense", *figlib.COLLAPSE_HEADERS], body),
    ]
    paired = "sparse_rl-trained" in grid and "dense-trained" in grid
    if paired:
        rows = {
            "Sparse-RL-trained": figlib.seed_rows(grid["sparse_rl-trained"]),
            "dense-trained": figlib.seed_rows(grid["dense-trained"]),
        }
        cs = figlib.compare_arms(rows, [("Sparse-RL-trained", "dense-trained")], {c: c for c in columns}, n_eval)
        signs = [c.sign for c in cs]
        lines += [
            "",
            figlib.COLLAPSE_NOTE,
            *figlib.comparison_lines(
                cs,
                f"Sparse-RL-trained minus dense-trained, per cell (by seed): Sparse-RL ahead in {signs.count(1)}, "
                f"dense-trained ahead in {signs.count(-1)}, tie in {signs.count(0)} of {len(cs)} cells.",
            ),
        ]

    vmax = max(1e-3, max(np.mean(v) for r in grid.values() for v in r.values()))
    fig, axes = figlib.panels(2, 2 * (1.1 + 0.38 * len(policies)) + 1.0, figlib.TWO_COLUMN_W, sharey=True)
    for ax, (name, row) in zip(axes, grid.items()):
        im = figlib.heatmap(
            ax, [[row[f"{p}@{b}"] for b in budgets] for p in policies], policies, budgets, 0.0, vmax, "viridis"
        )
        ax.set_title(f"{name} (n={len(row['dense'])})\ndense inference: {fmt(row['dense'], '.2f')}")
    fig.colorbar(im, ax=axes[1], label=f"accuracy (avg@1,\n{n_eval} prompts)", pad=0.02)
    if paired:
        a, b = grid["sparse_rl-trained"], grid["dense-trained"]
        diffs = [[np.subtract(a[f"{p}@{bb}"], b[f"{p}@{bb}"]) for bb in budgets] for p in policies]
        lim = max(0.05, max(abs(float(np.mean(d))) for r in diffs for d in r))
        im = figlib.heatmap(axes[3], diffs, policies, budgets, -lim, lim, "RdBu", "{:+.2f}")
        axes[3].set_title("Sparse-RL-trained minus dense-trained\n(paired by seed)")
        fig.colorbar(im, ax=axes[3], label="accuracy difference", shrink=0.8, pad=0.02)
    for ax in axes[2:]:
        ax.set_xlabel(f"inference KV budget (tokens, + buffer {base.kv.buffer})")
    for ax in axes[::2]:
        ax.set_ylabel("inference eviction policy")
    fig.suptitle(
        figlib.run_title(
            base,
            command,
            seeds,
            f"Figure e, sparse-inference robustness (Sparse-RL trained with {base.kv.policy}@{base.kv.budget})",
        )
    )
    caption = (
        f"Figure: held-out accuracy (avg@1 on {n_eval} prompts) of the warm start, a dense-trained "
        "and a Sparse-RL-trained model under sparse inference with each eviction policy (rows) and "
        "KV budget (columns); each cell gives the mean and, with more than one seed, ± one sample "
        "standard deviation over the trained models' seeds (the warm start is one model). Colour: "
        "the mean, on one scale for the three model panels; bottom right: the Sparse-RL-trained "
        "minus the dense-trained model's accuracy, mean (± std) of the per-seed differences, on a "
        f"diverging scale. Seeds {seeds}."
    )
    return figlib.Rendered("Figure e: sparse-inference robustness", "\n".join(lines), {"robustness": fig}, caption)


FIGURE = figlib.Figure(
    "fig_e_robustness", __doc__, run, render, seeds=(0,), choices={"--policies": SPARSE_POLICIES}, budgets=(16, 24, 48)
)

main = FIGURE.main


if __name__ == "__main__":
    main()
