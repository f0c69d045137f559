"""Figure d: correction ablation on sparse rollouts: none (naive sparse), SARS only, IBR only, both
(Sparse-RL), and Sparse-RL with the SARS ratio taken per token, per sequence and as a geometric
mean (methods.md 1.2).

  python experiments/fig_d_corrections.py                  # 6 variants x 3 seeds
  python experiments/fig_d_corrections.py --seeds 0 --variants none both --smoke

Every variant uses the same warm start, sparse rollouts (the base config's policy and budget) and
seeds; the table gives the mean ± standard deviation over seeds.
"""

from __future__ import annotations

import numpy as np

import figlib
from figlib import fmt

VARIANTS = {  # name -> (rl.mode, extra overrides)
    "none": ("naive_sparse", ()),
    "sars_only": ("sars_only", ()),
    "ibr_only": ("ibr_only", ()),
    "both": ("sparse_rl", ()),
    "both_sequence_level": ("sparse_rl", ("rl.sars.token_level=sequence", "rl.sars.veto_level=sequence")),
    "both_geometric_level": ("sparse_rl", ("rl.sars.token_level=geometric", "rl.sars.veto_level=geometric")),
}


def main(argv=None) -> dict:
    p = figlib.parser(__doc__)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = p.parse_args(argv)
    study = figlib.study_from_args(args)
    out = args.out or figlib.default_out("fig_d_corrections")
    policy = study.base.kv.policy

    results, histories = {}, {}
    study.train_all([dict(name=f"{n}/seed{s}", mode=VARIANTS[n][0], policy=policy, seed=s,
                          extra=VARIANTS[n][1]) for n in args.variants for s in args.seeds])
    for name in args.variants:
        mode, extra = VARIANTS[name]
        runs = [study.arm(f"{name}/seed{s}", mode=mode, policy=policy, seed=s, extra=extra)
                for s in args.seeds]
        histories[name] = [r.history for r in runs]
        results[name] = [figlib.scores(r, policy) for r in runs]

    kvc = study.base.kv
    lines = [
        f"Sparse rollouts with {policy}, budget {kvc.budget} + buffer {kvc.buffer}; "
        f"{study.base.train.iterations} iterations; seeds {args.seeds} (mean ± std).",
        "",
        "| corrections | mode | acc. dense inf. | acc. sparse inf. | train reward (last 25%) | "
        "token reject | seq reject | mismatch KL (k3) | entropy (last 25%) | skipped steps |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        col = lambda k: [r[k] for r in rows]  # noqa: E731
        lines.append(
            f"| {name} | {VARIANTS[name][0]} | {fmt(col('dense_acc'))} | {fmt(col('sparse_acc'))} | "
            f"{fmt(col('train_reward_last25'))} | {fmt(col('token_reject_rate'))} | "
            f"{fmt(col('seq_reject_rate'))} | {fmt(col('mismatch_kl_k3'), '.4f')} | "
            f"{fmt(col('entropy_last25'))} | {fmt(col('skipped_steps'), '.0f')} |"
        )

    fig, axes = figlib.plt.subplots(1, 3, figsize=(14, 3.6))
    names = list(results)
    for ax, key, title in zip(axes[:2], ("dense_acc", "sparse_acc"),
                              ("accuracy, dense inference", "accuracy, sparse inference")):
        stats = [figlib.mean_std(r[key] for r in results[n]) for n in names]
        ax.bar(np.arange(len(names)), [m for m, _ in stats], yerr=[s for _, s in stats], capsize=3)
        ax.set_xticks(np.arange(len(names)), names, fontsize=7, rotation=30)
        ax.set_title(title)
    for name in names:
        x, m, s = figlib.curve(histories[name], "reward/mean")
        axes[2].plot(x, m, label=name)
    axes[2].set_title("train reward (mean over seeds)")
    axes[2].set_xlabel("iteration")
    axes[2].legend(fontsize=7)
    data = {"results": results, "seeds": args.seeds, "histories": histories,
            "variants": {n: list(VARIANTS[n][1]) + [f"rl.mode={VARIANTS[n][0]}"] for n in names}}
    figlib.write_outputs(out, "Figure d: correction ablation", "\n".join(lines), data, fig,
                         "corrections", study)
    return data


if __name__ == "__main__":
    main()
