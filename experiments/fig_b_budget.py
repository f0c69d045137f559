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
    p = figlib.parser(__doc__)
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 24, 32, 48])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--mode", default="sparse_rl", help="rl.mode of the budget-specific runs")
    args = p.parse_args(argv)
    study = figlib.study_from_args(args)
    out = args.out or figlib.default_out("fig_b_budget", args.config)
    policy = study.base.kv.policy
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
            "kv_saving": [r.evaluate(kv)["kv_saving"] for r in trained],
            "train_kv_saving": [figlib.summarize(r)["train_kv_saving"] for r in trained],
            "warm_sparse_acc": [warm.evaluate(kv)["accuracy"]],
            "dense_trained_sparse_acc": [r.evaluate(kv)["accuracy"] for r in dense],
            "trained_sparse_acc": [r.evaluate(kv)["accuracy"] for r in trained],
            "trained_dense_acc": [r.evaluate({"policy": "none"})["accuracy"] for r in trained],
        }
        rows.append(row)
    dense_acc = [r.evaluate({"policy": "none"})["accuracy"] for r in dense]
    warm_dense = warm.evaluate({"policy": "none"})["accuracy"]

    lines = [
        f"Policy {policy}, buffer {study.base.kv.buffer}; {args.mode} trained at each budget for "
        f"{study.base.train.iterations} iterations; seeds {args.seeds}. Dense inference: warm start "
        f"{warm_dense:.3f}, dense-trained {fmt(dense_acc)}.",
        "",
        f"| budget | KV saving (eval) | KV saving (train) | warm start, sparse inf. | dense-trained, "
        f"sparse inf. | {args.mode}, sparse inf. | {args.mode}, dense inf. | "
        f"{args.mode} sparse / dense-trained dense |",
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

    fig, ax = figlib.plt.subplots(figsize=(5.5, 4))
    x = [figlib.mean_std(r["kv_saving"])[0] for r in rows]
    for key, label in (("warm_sparse_acc", "warm start"),
                       ("dense_trained_sparse_acc", "dense-trained"),
                       ("trained_sparse_acc", f"{args.mode} at that budget")):
        m = [figlib.mean_std(r[key]) for r in rows]
        ax.errorbar(x, [a for a, _ in m], yerr=[s for _, s in m], marker="o", capsize=3, label=label)
    ax.axhline(figlib.mean_std(dense_acc)[0], color="gray", ls="--", label="dense-trained, dense inf.")
    for xi, r in zip(x, rows):
        ax.annotate(f"B={r['budget']}", (xi, 0), textcoords="offset points", xytext=(0, 4),
                    ha="center", fontsize=8)
    ax.set_xlabel("KV saving (fraction of dense entries not kept)")
    ax.set_ylabel("accuracy under sparse inference")
    ax.legend(fontsize=8)
    data = {"rows": rows, "dense_trained_dense_acc": dense_acc, "warm_dense_acc": warm_dense,
            "seeds": args.seeds, "policy": policy, "mode": args.mode}
    figlib.write_outputs(out, "Figure b: KV saving vs accuracy across budgets", "\n".join(lines),
                         data, fig, "budget", study)
    return data


if __name__ == "__main__":
    main()
