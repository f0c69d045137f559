"""Figure b: KV saving against accuracy across budgets (paper claim: Sparse-RL keeps most of the
dense accuracy while keeping 35-53% fewer KV entries during rollouts).

  python experiments/fig_b_budget.py                       # budgets 16 24 32 48, seed 0
  python experiments/fig_b_budget.py --budgets 16 24 --smoke

For each budget a Sparse-RL run trains with that budget from the shared warm start; the warm
start, the dense-trained model and that run are then evaluated with the same budget (sparse
inference) and densely. The x axis is the KV saving measured on the evaluation rollouts: the
fraction of the entries a dense cache would hold that the sparse cache did not keep. Both collapse
rules apply to every trained model; the trained model and the dense-trained one are compared per
budget by the tie rule (figlib).
"""

from __future__ import annotations

from sparserl_jax.experiments import figlib
from sparserl_jax.experiments.figlib import fmt


def arguments(p) -> None:
    p.add_argument("--mode", default="sparse_rl", help="rl.mode of the budget-specific runs")


def run(args, study) -> dict:
    policy = study.base.kv.policy
    n_eval = figlib.eval_prompts(args, study)
    dense_spec = lambda s: dict(name=f"dense/seed{s}", mode="dense", policy="none", seed=s)  # noqa: E731
    spec = lambda b, s: dict(
        name=f"{args.mode}/budget{b}/seed{s}",
        mode=args.mode,
        policy=policy,  # noqa: E731
        seed=s,
        extra=[f"kv.budget={b}"],
    )
    study.train_all([dense_spec(s) for s in args.seeds] + [spec(b, s) for b in args.budgets for s in args.seeds])
    warm = study.warm_start()
    dense = [study.arm(**dense_spec(s)) for s in args.seeds]
    rows = []
    for budget in args.budgets:
        kv = {"policy": policy, "budget": budget}
        trained = [study.arm(**spec(budget, s)) for s in args.seeds]
        rows.append(
            {
                "budget": budget,
                "kv_saving": [r.evaluate(kv, n=n_eval)["kv_saving"] for r in trained],
                "train_kv_saving": [figlib.summarize(r)["train_kv_saving"] for r in trained],
                "warm_sparse_acc": figlib.accuracies([warm], kv, n_eval),
                "dense_trained_sparse_acc": figlib.accuracies(dense, kv, n_eval),
                "trained_sparse_acc": figlib.accuracies(trained, kv, n_eval),
                "trained_dense_acc": figlib.accuracies(trained, {"policy": "none"}, n_eval),
                "collapse_iteration": [figlib.reward_collapse_iteration(r.history) for r in trained],
            }
        )
    return {
        "rows": rows,
        "dense_trained_dense_acc": figlib.accuracies(dense, {"policy": "none"}, n_eval),
        "dense_collapse_iteration": [figlib.reward_collapse_iteration(r.history) for r in dense],
        "warm_dense_acc": figlib.accuracies([warm], {"policy": "none"}, n_eval)[0],
        "seeds": args.seeds,
        "policy": policy,
        "mode": args.mode,
        "eval_prompts": n_eval,
    }


COLUMNS = (  # (header, key of a budget's row: one value per seed, format); {mode}: the trained runs' mode
    ("KV saving (eval)", "kv_saving", ".1%"),
    ("KV saving (train)", "train_kv_saving", ".1%"),
    ("warm start, sparse inf.", "warm_sparse_acc", ".3f"),
    ("dense-trained, sparse inf.", "dense_trained_sparse_acc", ".3f"),
    ("{mode}, sparse inf.", "trained_sparse_acc", ".3f"),
    ("{mode}, dense inf.", "trained_dense_acc", ".3f"),
)


def render(data: dict, base, command: str) -> figlib.Rendered:
    rows, dense_acc, warm_dense = data["rows"], data["dense_trained_dense_acc"], data["warm_dense_acc"]
    seeds, policy, mode = data["seeds"], data["policy"], data["mode"]
    n_eval = data.get("eval_prompts", base.train.eval_prompts)
    d_acc, d_reward = figlib.seed_collapse_cells(dense_acc, data.get("dense_collapse_iteration"), warm_dense)
    body, cs = [], []
    for r in rows:
        ratio = [t / max(d, 1e-9) for t, d in zip(r["trained_sparse_acc"], dense_acc)]
        body.append(
            [
                str(r["budget"]),
                *(fmt(r[k], spec) for _, k, spec in COLUMNS),
                fmt(ratio, ".0%"),
                *figlib.seed_collapse_cells(r["trained_dense_acc"], r.get("collapse_iteration"), warm_dense),
            ]
        )
        trained = figlib.seed_rows({"acc": r["trained_sparse_acc"]})
        for other, other_rows in (
            ("dense-trained", figlib.seed_rows({"acc": r["dense_trained_sparse_acc"]})),
            ("warm start", {0: {"acc": r["warm_sparse_acc"][0]}}),
        ):  # one model
            cs += figlib.compare(
                f"{mode}@{r['budget']}",
                trained,
                other,
                other_rows,
                "acc",
                n_eval,
                metric=f"sparse inference at B = {r['budget']}",
            )
    lines = [
        f"Policy {policy}, buffer {base.kv.buffer}; {mode} trained at each budget for "
        f"{base.train.iterations} iterations from warm start 0; seeds {seeds}. Dense inference: warm start "
        f"{warm_dense:.3f}, dense-trained {fmt(dense_acc)} (collapsed: accuracy rule {d_acc}, reward rule "
        f"{d_reward}).",
        "",
        *figlib.md_table(
            [
                "budget",
                *(h.format(mode=mode) for h in figlib.headers(COLUMNS)),
                f"{mode} sparse / dense-trained dense",
                *figlib.COLLAPSE_HEADERS,
            ],
            body,
        ),
        "",
        figlib.COLLAPSE_NOTE,
        *figlib.comparison_lines(cs, "Paired differences (by seed; the warm start is one model):"),
    ]

    fig, ax = figlib.plt.subplots(figsize=(figlib.COLUMN_W, 4.2), layout="constrained")
    x = [100 * figlib.mean_std(r["kv_saving"])[0] for r in rows]
    colours = figlib.arm_colours(["dense", mode])
    for key, label, colour in (
        ("warm_sparse_acc", "warm start, sparse inf.", "black"),
        ("dense_trained_sparse_acc", "dense-trained, sparse inf.", colours["dense"]),
        ("trained_sparse_acc", f"{mode} trained at B, sparse inf.", colours[mode]),
    ):
        m, s = zip(*(figlib.mean_std(r[key]) for r in rows))
        ax.errorbar(x, m, yerr=figlib.clipped_err(m, s), marker="o", ms=4, capsize=3, label=label, color=colour)
    ax.axhline(figlib.mean_std(dense_acc)[0], color=colours["dense"], ls="--", label="dense-trained, dense inf.")
    top = ax.secondary_xaxis("top")
    top.set_xticks(x, [str(r["budget"]) for r in rows])
    top.set_xlabel(f"training and inference budget B (tokens, + buffer {base.kv.buffer})")
    ax.set(
        ylim=(0, None),
        xlabel="KV saving on the evaluation rollouts\n(% of the dense cache's entries not kept)",
        ylabel=f"accuracy (avg@1, {n_eval} prompts)",
    )
    figlib.band_legend_below(fig, ax, ncol=1)
    fig.suptitle(
        figlib.run_title(
            base,
            command,
            seeds,
            "Figure b: KV saving vs accuracy",
            setting=f"{policy} at budgets B",
            runs=f"{mode} trained at each B; {figlib.runs_phrase(seeds)}, {base.train.iterations} iterations",
        )
    )
    caption = (
        f"Figure: held-out accuracy (avg@1 on {n_eval} prompts) under sparse inference with {policy} "
        "at budget B (top axis) against the KV saving measured on the evaluation rollouts, "
        f"for the warm start (black), the dense-trained model (blue) and the {mode} model trained at that "
        "budget (its arm's colour); blue dashed: the dense-trained model under dense inference (the one "
        "dense-inference mark on this axis). " + figlib.seeds_caption("Points", seeds, "; the warm start is one model")
    )
    return figlib.Rendered("Figure b: KV saving vs accuracy across budgets", "\n".join(lines), {"budget": fig}, caption)


FIGURE = figlib.Figure("fig_b_budget", __doc__, run, render, arguments, seeds=(0,), budgets=(16, 24, 32, 48))

main = FIGURE.main


if __name__ == "__main__":
    main()
