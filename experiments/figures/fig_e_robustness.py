"""Figure e: sparse-inference robustness (paper claim: models trained with Sparse-RL are more
robust when inference uses the same compression). The warm start, a dense-trained and a
Sparse-RL-trained model are evaluated under every eviction policy and budget.

  python experiments/figures/fig_e_robustness.py                   # 5 policies x 3 budgets, seed 0
  python experiments/figures/fig_e_robustness.py --policies snapkv --budgets 24 --smoke
  python experiments/figures/fig_e_robustness.py --config experiments/configs/walk_key_rkv.yaml \
      --budgets 32 48 64 96 --warm-starts 0 1 2 --seeds 0 1 --eval-every 0 \
      --runs-dir runs/figures train.iterations=40      # the default experiment's models

The models are the runs of figure a (same configs, fig_a_curves.arm_extra included, reused from
the run cache when present), or with --eval-every 0 the default experiment's (no held-out
evaluation during training: the same configs as its runs); the Sparse-RL model was trained with
the base config's policy and budget, from each warm start (--warm-starts, SFT seeds) with each
seed. Accuracies are avg@1 on --eval-prompts held-out prompts (at least figlib.EVAL_PROMPTS). The
claim (the paper's: a model trained with Sparse-RL is more robust under sparse inference), read at
every run pair of each cell by the tie rule: Sparse-RL-trained ahead of dense-trained.

  python experiments/figures/fig_e_robustness.py --replot experiments/results/fig_e_robustness/walk_key
re-renders robustness.png and results.md from a committed results.json (no training).
"""

from __future__ import annotations

import numpy as np

from experiments.lib import curves as fig_a_curves
from experiments.lib import figlib
from experiments.lib.figlib import fmt
from sparserl_jax.kvcache.policies import POLICIES

SPARSE_POLICIES = [p for p in POLICIES if p != "none"]


def arguments(p) -> None:
    p.add_argument(
        "--eval-every",
        type=int,
        help="the models' held-out evaluation interval during training: figure a's runs (default "
        f"{fig_a_curves.EVAL_EVERY}; 1 with --smoke), or 0: none, the default experiment's runs",
    )


MODELS = {  # the trained models: name -> (rl.mode, trained with sparse rollouts)
    "dense-trained": ("dense", False),
    "sparse_rl-trained": ("sparse_rl", True),
}


def run(args, study) -> dict:
    train_policy = study.base.kv.policy
    n_eval = figlib.eval_prompts(args, study)
    warms = figlib.warms_of(args)
    extra = [] if args.eval_every == 0 else fig_a_curves.arm_extra(args.smoke, args.eval_every)
    columns = {
        "dense": {"policy": "none"},
        **{f"{p}@{b}": {"policy": p, "budget": b} for p in args.policies for b in args.budgets},
    }
    evals = [(kv, n_eval) for kv in columns.values()]
    specs = [
        dict(
            name=f"{mode}/seed{s}" if w == 0 else f"{mode}/w{w}/seed{s}",
            mode=mode,
            policy=train_policy if sparse else "none",
            seed=s,
            extra=extra,
            warm=w,
        )
        for mode, sparse in MODELS.values()
        for w in warms
        for s in args.seeds
    ]
    study.train_all([*({"warm_start": w} for w in warms), *specs], evals)  # the workers evaluate every cell
    models = {
        "warm start": [(w, 0, study.warm_start(warm=w)) for w in warms],
        **{
            name: [(sp["warm"], sp["seed"], study.arm(**sp)) for sp in specs if sp["mode"] == mode]
            for name, (mode, _) in MODELS.items()
        },
    }
    grid = {
        name: {c: figlib.accuracies([r for _, _, r in runs], kv, n_eval) for c, kv in columns.items()}
        for name, runs in models.items()
    }
    return {
        "grid": grid,  # model -> column -> [accuracy per run, in the order of "units"]
        "units": {name: [[w, s] for w, s, _ in runs] for name, runs in models.items()},
        "retained_sparse_over_dense": retained_ratios(grid, args.policies, args.budgets),
        "seeds": args.seeds,
        "policies": args.policies,
        "budgets": args.budgets,
        "eval_prompts": n_eval,
        "collapse_iteration": {
            name: [figlib.reward_collapse_iteration(r.history) for _, _, r in runs]
            for name, runs in models.items()
            if name != "warm start"
        },
    }


def _inference(column: str) -> str:
    return "dense inference" if column == "dense" else f"sparse inference {column}"


def rows_of(data: dict, name: str) -> list[dict]:
    """The model's runs as rows {warm_start, seed, column: accuracy, collapse_iteration} (results
    of one warm start before "units": warm start 0, the seed its index)."""
    row = data["grid"][name]
    units = data.get("units", {}).get(name) or [[0, i] for i in range(len(row["dense"]))]
    its = data.get("collapse_iteration", {}).get(name)
    return [
        {
            "warm_start": w,
            "seed": s,
            **{c: v[i] for c, v in row.items()},
            **({} if its is None else {"collapse_iteration": its[i]}),
        }
        for i, (w, s) in enumerate(units)
    ]


def retained_ratios(grid: dict, policies, budgets) -> dict:
    """Per model: mean accuracy over the sparse columns / its dense accuracy."""
    columns = [f"{p}@{b}" for p in policies for b in budgets]
    return {
        name: float(figlib.ratio_of_means([np.mean(row[c]) for c in columns], row["dense"]))
        for name, row in grid.items()
    }


def cell_comparisons(data: dict, columns, n_eval: int) -> list[figlib.Comparison]:
    """Sparse-RL-trained against dense-trained in each column, paired by warm start and seed."""
    a, b = rows_of(data, "sparse_rl-trained"), rows_of(data, "dense-trained")
    return [figlib.compare("Sparse-RL-trained", a, "dense-trained", b, c, n_eval, metric=c)[-1] for c in columns]


def claims(data: dict, columns, n_eval: int) -> list[figlib.Claim]:
    """The module doc's claim in each column, read at every run pair."""
    return [
        figlib.comparison_claim(f"Sparse-RL-trained ahead of dense-trained, {_inference(c.metric)}", c)
        for c in cell_comparisons(data, columns, n_eval)
    ]


def render(data: dict, base, command: str) -> figlib.Rendered:
    grid, seeds = data["grid"], data["seeds"]
    policies, budgets = data["policies"], data["budgets"]
    n_eval = data.get("eval_prompts", base.train.eval_prompts)
    columns = ["dense"] + [f"{p}@{b}" for p in policies for b in budgets]
    warms = {r["warm_start"]: {"dense_acc": r["dense"]} for r in rows_of(data, "warm start")}
    warm_ids = sorted(warms)
    retained = retained_ratios(grid, policies, budgets)
    body = []
    for name, row in grid.items():  # both collapse rules for the trained models, '-' for the warm start
        rows = [{**r, "dense_acc": r["dense"]} for r in rows_of(data, name)]
        collapse = ("-", "-") if name == "warm start" else figlib.arm_cells(rows, (), warms)
        body.append([name, *(fmt(row[c]) for c in columns), f"{retained[name]:.0%}", *collapse])
    lines = [
        f"Accuracy (avg@1, {n_eval} held-out prompts) under dense inference "
        f"and under each policy@budget (buffer {base.kv.buffer}); Sparse-RL trained with "
        f"{base.kv.policy}@{base.kv.budget} from warm start(s) {warm_ids} with seeds {seeds} on each "
        "(mean ± std over runs; the warm starts are one model each). Last columns: mean accuracy "
        "over the sparse columns divided by the model's dense accuracy, and both collapse rules.",
        "",
        *figlib.md_table(["model", *columns, "sparse / dense", *figlib.COLLAPSE_HEADERS], body),
    ]
    paired = "sparse_rl-trained" in grid and "dense-trained" in grid
    if paired:
        cs = cell_comparisons(data, columns, n_eval)
        signs = [c.sign for c in cs]
        lines += [
            "",
            figlib.COLLAPSE_NOTE,
            *figlib.comparison_lines(
                cs,
                f"Sparse-RL-trained minus dense-trained, per cell (paired by warm start and seed; the tie rule over "
                f"every pair): Sparse-RL ahead in {signs.count(1)}, dense-trained ahead in {signs.count(-1)}, tie in "
                f"{signs.count(0)} of {len(cs)} cells.",
            ),
            *figlib.claims_table(claims(data, columns, n_eval)),
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
        axes[3].set_title("Sparse-RL-trained minus dense-trained\n(paired by warm start and seed)")
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
            warm_ids,
        )
    )
    caption = (
        f"Figure: held-out accuracy (avg@1 on {n_eval} prompts) of the warm start, a dense-trained "
        "and a Sparse-RL-trained model under sparse inference with each eviction policy (rows) and "
        "KV budget (columns); each cell gives the mean and, with more than one run, ± one sample "
        "standard deviation over the runs (warm starts x seeds; the warm start panel: over its warm "
        "starts, one model each). Colour: the mean, on one scale for the three model panels; bottom "
        "right: the Sparse-RL-trained minus the dense-trained model's accuracy, mean (± std) of the "
        "differences paired by warm start and seed, on a "
        f"diverging scale. Warm starts {warm_ids}, seeds {seeds} on each."
    )
    return figlib.Rendered("Figure e: sparse-inference robustness", "\n".join(lines), {"robustness": fig}, caption)


FIGURE = figlib.Figure(
    "fig_e_robustness",
    __doc__,
    run,
    render,
    arguments,
    seeds=(0,),
    warm_starts=(0,),
    choices={"--policies": SPARSE_POLICIES},
    budgets=(16, 24, 48),
)

main = FIGURE.main


if __name__ == "__main__":
    main()
