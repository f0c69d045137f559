"""Figure b: KV saving against accuracy across budgets (paper claim: Sparse-RL keeps most of the
dense accuracy while keeping 35-53% fewer KV entries during rollouts).

  python experiments/fig_b_budget.py                       # budgets 16 24 32 48, seed 0
  python experiments/fig_b_budget.py --budgets 16 24 --smoke

For each budget a Sparse-RL run trains with that budget from the shared warm start; the warm
start, the dense-trained model and that run are then evaluated with the same budget (sparse
inference) and densely. The x axis is the KV saving measured on the evaluation rollouts: the
fraction of the entries a dense cache would hold that the sparse cache did not keep.
"""

from __future__ import annotations

import figlib
from figlib import fmt


def main(argv=None) -> dict:
    p = figlib.parser(__doc__, replot=True)
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 24, 32, 48])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--mode", default="sparse_rl", help="rl.mode of the budget-specific runs")
    args = p.parse_args(argv)
    if args.replot:
        data, base = figlib.load_results(args.replot)
        render(data, base, args.replot, replot=True)
        return data
    study = figlib.study_from_args(args)
    out = args.out or figlib.default_out("fig_b_budget", args.config)
    policy = study.base.kv.policy
    n_eval = figlib.eval_prompts(args, study)
    warm = study.warm_start()
    study.train_all([dict(name=f"dense/seed{s}", mode="dense", policy="none", seed=s) for s in args.seeds]
                    + [dict(name=f"{args.mode}/budget{b}/seed{s}", mode=args.mode, policy=policy, seed=s,
                            extra=[f"kv.budget={b}"]) for b in args.budgets for s in args.seeds])
    dense = [study.arm(f"dense/seed{s}", mode="dense", policy="none", seed=s) for s in args.seeds]

    rows = []
    for budget in args.budgets:
        kv = {"policy": policy, "budget": budget}
        trained = [study.arm(f"{args.mode}/budget{budget}/seed{s}", mode=args.mode, policy=policy,
                             seed=s, extra=[f"kv.budget={budget}"]) for s in args.seeds]
        row = {
            "budget": budget,
            "kv_saving": [r.evaluate(kv, n=n_eval)["kv_saving"] for r in trained],
            "train_kv_saving": [figlib.summarize(r)["train_kv_saving"] for r in trained],
            "warm_sparse_acc": [warm.evaluate(kv, n=n_eval)["accuracy"]],
            "dense_trained_sparse_acc": [r.evaluate(kv, n=n_eval)["accuracy"] for r in dense],
            "trained_sparse_acc": [r.evaluate(kv, n=n_eval)["accuracy"] for r in trained],
            "trained_dense_acc": [r.evaluate({"policy": "none"}, n=n_eval)["accuracy"] for r in trained],
        }
        rows.append(row)
    dense_acc = [r.evaluate({"policy": "none"}, n=n_eval)["accuracy"] for r in dense]
    warm_dense = warm.evaluate({"policy": "none"}, n=n_eval)["accuracy"]
    data = {"rows": rows, "dense_trained_dense_acc": dense_acc, "warm_dense_acc": warm_dense,
            "seeds": args.seeds, "policy": policy, "mode": args.mode, "eval_prompts": n_eval}
    render(data, study.base, out, study=study)
    return data


def render(data: dict, base, out: str, study=None, replot: bool = False) -> None:
    """results.md and budget.png of `data` (a fresh run's, or a committed results.json's)."""
    rows, dense_acc, warm_dense = data["rows"], data["dense_trained_dense_acc"], data["warm_dense_acc"]
    seeds, policy, mode = data["seeds"], data["policy"], data["mode"]
    n_eval = data.get("eval_prompts", base.train.eval_prompts)
    command = data["command"] if replot else figlib.command_line()
    lines = [
        f"Policy {policy}, buffer {base.kv.buffer}; {mode} trained at each budget for "
        f"{base.train.iterations} iterations; seeds {seeds}. Dense inference: warm start "
        f"{warm_dense:.3f}, dense-trained {fmt(dense_acc)}.",
        "",
        f"| budget | KV saving (eval) | KV saving (train) | warm start, sparse inf. | dense-trained, "
        f"sparse inf. | {mode}, sparse inf. | {mode}, dense inf. | "
        f"{mode} sparse / dense-trained dense |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = [t / max(d, 1e-9) for t, d in zip(r["trained_sparse_acc"], dense_acc)]
        r["retained_vs_dense"] = ratio
        lines.append(
            f"| {r['budget']} | {fmt(r['kv_saving'], '.1%')} | {fmt(r['train_kv_saving'], '.1%')} | "
            f"{fmt(r['warm_sparse_acc'])} | {fmt(r['dense_trained_sparse_acc'])} | "
            f"{fmt(r['trained_sparse_acc'])} | {fmt(r['trained_dense_acc'])} | {fmt(ratio, '.0%')} |"
        )

    fig, ax = figlib.plt.subplots(figsize=(figlib.PANEL_W + 1.5, 3.6), layout="constrained")
    x = [100 * figlib.mean_std(r["kv_saving"])[0] for r in rows]
    for key, label in (("warm_sparse_acc", "warm start"),
                       ("dense_trained_sparse_acc", "dense-trained"),
                       ("trained_sparse_acc", f"{mode} trained at that budget")):
        m = [figlib.mean_std(r[key]) for r in rows]
        ax.errorbar(x, [a for a, _ in m], yerr=[s for _, s in m], marker="o", ms=4, capsize=3,
                    label=label)
    ax.axhline(figlib.mean_std(dense_acc)[0], color="gray", ls="--", label="dense-trained, dense inf.")
    top = ax.secondary_xaxis("top")
    top.set_xticks(x, [str(r["budget"]) for r in rows])
    top.set_xlabel(f"training and inference budget B (tokens, + buffer {base.kv.buffer})")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("KV saving on the evaluation rollouts\n(% of the dense cache's entries not kept)")
    ax.set_ylabel(f"accuracy under sparse inference\n(avg@1, {n_eval} prompts)")
    figlib.band_legend_below(fig, ax, ncol=2)
    fig.suptitle(f"Figure b: KV saving vs accuracy\n{figlib.config_name(command)} (task "
                 f"{base.data.task}), {policy} at budgets B\n{mode} trained at each B; {len(seeds)} "
                 f"seed{'s' if len(seeds) != 1 else ''}, {base.train.iterations} iterations", fontsize=9)
    caption = (
        f"Figure: held-out accuracy (avg@1 on {n_eval} prompts) under sparse inference with {policy} "
        "at budget B (top axis) against the KV saving measured on the evaluation rollouts, "
        f"for the warm start, the dense-trained model and the {mode} model trained at that budget; "
        "grey dashed: the dense-trained model under dense inference. Points: mean over seeds; error "
        "bars: ± one sample standard deviation over seeds (none with one seed; the warm start is one "
        f"model). Seeds {seeds}.")
    figlib.write_outputs(out, "Figure b: KV saving vs accuracy across budgets", "\n".join(lines),
                         data, fig, "budget", study, caption=caption, replot=replot)


if __name__ == "__main__":
    main()
