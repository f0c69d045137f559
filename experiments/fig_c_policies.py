"""Figure c: eviction-policy ablation. Each policy's sparse rollouts trained without corrections
(naive sparse) and with them (Sparse-RL), next to dense rollouts.

  python experiments/fig_c_policies.py                     # 6 policies x 2 modes, seed 0
  python experiments/fig_c_policies.py --policies streaming snapkv --smoke

Every run uses the same warm start, budget, buffer and seed. Each model is evaluated densely and
under sparse inference with the policy it was trained with.
"""

from __future__ import annotations

import figlib
from figlib import fmt
from sparserl_jax.kvcache.policies import POLICIES

MODES = ("naive_sparse", "sparse_rl")


MODE_LABELS = {"dense": "dense", "naive_sparse": "naive sparse", "sparse_rl": "Sparse-RL"}
MODE_COLOURS = {"dense": "0.5", "naive_sparse": "C0", "sparse_rl": "C1"}


def main(argv=None) -> dict:
    p = figlib.parser(__doc__, replot=True)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = p.parse_args(argv)
    if args.replot:
        data, base = figlib.load_results(args.replot)
        render(data, base, args.replot, replot=True)
        return data
    study = figlib.study_from_args(args)
    out = args.out or figlib.default_out("fig_c_policies", args.config)
    n_eval = figlib.eval_prompts(args, study)

    cells = []  # (policy, mode) rows
    study.train_all([dict(name=f"{policy}/{mode}/seed{s}", mode=mode, policy=policy, seed=s)
                     for policy in args.policies
                     for mode in (("dense",) if policy == "none" else MODES) for s in args.seeds])
    for policy in args.policies:
        for mode in (("dense",) if policy == "none" else MODES):
            runs = [study.arm(f"{policy}/{mode}/seed{s}", mode=mode, policy=policy, seed=s)
                    for s in args.seeds]
            sparse_policy = policy if policy != "none" else study.base.kv.policy
            per_seed = [figlib.scores(r, sparse_policy, n_eval) for r in runs]
            cells.append({"policy": policy, "mode": mode, "sparse_inference_policy": sparse_policy,
                          "per_seed": per_seed})
    kvc = study.base.kv
    data = {"cells": cells, "seeds": args.seeds, "kv": dict(budget=kvc.budget, buffer=kvc.buffer),
            "eval_prompts": n_eval}
    render(data, study.base, out, study=study)
    return data


def render(data: dict, base, out: str, study=None, replot: bool = False) -> None:
    """results.md and policies.png of `data` (a fresh run's, or a committed results.json's)."""
    cells, seeds = data["cells"], data["seeds"]
    n_eval = data.get("eval_prompts", base.train.eval_prompts)
    command = data["command"] if replot else figlib.command_line()
    kvc = base.kv
    lines = [
        f"Budget {kvc.budget} + buffer {kvc.buffer}, window {kvc.window}, selection {kvc.selection}; "
        f"{base.train.iterations} iterations; seeds {seeds}. Sparse inference uses the "
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

    # one group of bars per rollout policy, one bar per training mode (colour)
    policies = list(dict.fromkeys(c["policy"] for c in cells))
    modes = list(dict.fromkeys(c["mode"] for c in cells))
    width = 0.8 / max(sum(c['policy'] == p for c in cells) for p in policies)
    fig, axes = figlib.plt.subplots(1, 3, figsize=(3 * figlib.PANEL_W, 3.0), layout="constrained")
    acc = f"accuracy (avg@1, {n_eval} prompts)"
    for ax, key, ylabel, title in zip(
            axes, ("dense_acc", "sparse_acc", "mismatch_kl_k3"),
            (acc, acc, "nats per token (run mean)"),
            ("dense inference", "sparse inference (the training policy;\n"
             f"dense arm: {kvc.policy}), budget {kvc.budget}", "mismatch KL (k3) during training")):
        for mode in modes:
            xs, ms, ss = [], [], []
            for i, policy in enumerate(policies):
                here = [c["mode"] for c in cells if c["policy"] == policy]  # bars centred per group
                for c in cells:
                    if c["policy"] == policy and c["mode"] == mode:
                        m, s = figlib.mean_std(r[key] for r in c["per_seed"])
                        xs.append(i + (here.index(mode) - (len(here) - 1) / 2) * width)
                        ms.append(m)
                        ss.append(s)
            ax.bar(xs, ms, yerr=ss, width=width, color=MODE_COLOURS.get(mode), capsize=2,
                   label=MODE_LABELS.get(mode, mode))
        ax.set_xticks(range(len(policies)), policies)
        ax.set_xlabel("rollout eviction policy")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
    figlib.band_legend_below(fig, axes[0])
    fig.suptitle(f"Figure c: eviction-policy ablation, {figlib.config_name(command)} (task "
                 f"{base.data.task}), budget {kvc.budget} + buffer {kvc.buffer}, {len(seeds)} "
                 f"seed{'s' if len(seeds) != 1 else ''}, {base.train.iterations} iterations")
    caption = (
        f"Figure: final held-out accuracy (avg@1 on {n_eval} prompts) under dense and under sparse "
        "inference and the mean mismatch KL during training (k3, nats per response token) of models "
        "trained with each rollout eviction policy, without corrections (naive sparse) and with "
        "them (Sparse-RL); 'none' is the dense-rollout arm. Bars: mean over seeds; error bars: ± one "
        f"sample standard deviation over seeds (none with one seed). Seeds {seeds}.")
    figlib.write_outputs(out, "Figure c: eviction-policy ablation", "\n".join(lines), data, fig,
                         "policies", study, caption=caption, replot=replot)


if __name__ == "__main__":
    main()
