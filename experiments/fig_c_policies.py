"""Figure c: eviction-policy ablation. Each policy's sparse rollouts trained without corrections
(naive sparse) and with them (Sparse-RL), next to dense rollouts.

  python experiments/fig_c_policies.py                     # 6 policies x 2 modes, seed 0
  python experiments/fig_c_policies.py --policies streaming snapkv --smoke

Every run uses the same warm start, budget, buffer and seed. Each model is evaluated densely and
under sparse inference with the policy it was trained with.
"""

from __future__ import annotations

import numpy as np

import figlib
from figlib import fmt
from sparserl_jax.kvcache.policies import POLICIES

MODES = ("naive_sparse", "sparse_rl")


MODE_LABELS = {"dense": "dense", "naive_sparse": "naive sparse", "sparse_rl": "Sparse-RL"}
MODE_COLOURS = {"dense": "0.5", "naive_sparse": "C0", "sparse_rl": "C1"}


def arguments(p) -> None:
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))


def modes_of(policy: str) -> tuple[str, ...]:
    return ("dense",) if policy == "none" else MODES


def run(args, study) -> dict:
    n_eval = figlib.eval_prompts(args, study)
    spec = lambda p, m, s: dict(name=f"{p}/{m}/seed{s}", mode=m, policy=p, seed=s)  # noqa: E731
    # sparse inference under the policy a model was trained with (the dense arm: the base config's)
    study.train_all([spec(p, m, s) for p in args.policies for m in modes_of(p) for s in args.seeds],
                    [({"policy": "none"}, n_eval), ({}, n_eval)])
    cells = []
    for policy in args.policies:
        for mode in modes_of(policy):
            sparse_policy = policy if policy != "none" else study.base.kv.policy
            per_seed = [{**figlib.scores(study.arm(**spec(policy, mode, s)), sparse_policy, n_eval), "seed": s}
                        for s in args.seeds]
            cells.append({"policy": policy, "mode": mode, "sparse_inference_policy": sparse_policy,
                          "per_seed": per_seed})
    kvc = study.base.kv
    warm = figlib.warm_rows(study, [0], n_eval)
    return {"cells": cells, "seeds": args.seeds, "kv": dict(budget=kvc.budget, buffer=kvc.buffer),
            "eval_prompts": n_eval, "warm_starts": {"0": warm[0]}}


def render(data: dict, base, command: str) -> figlib.Rendered:
    cells, seeds = data["cells"], data["seeds"]
    n_eval = data.get("eval_prompts", base.train.eval_prompts)
    warms = figlib.warm_starts_of(data)
    kvc = base.kv
    lines = [
        f"Budget {kvc.budget} + buffer {kvc.buffer}, window {kvc.window}, selection {kvc.selection}; "
        f"{base.train.iterations} iterations; seeds {seeds}. Sparse inference uses the "
        f"policy the model was trained with (the dense arm: {kvc.policy}).",
        "",
        "| rollout policy | mode | acc. dense inf. | acc. sparse inf. | train reward (last 25%) | "
        "KV saving | mismatch KL (k3) | token reject | seq reject | collapsed (accuracy rule) | "
        "collapsed (reward rule) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        col = lambda k: [r[k] for r in c["per_seed"]]  # noqa: E731
        acc, reward = figlib.collapse_cells(c["per_seed"], figlib.warm_dense_of(c["per_seed"], warms))
        lines.append(
            f"| {c['policy']} | {c['mode']} | {fmt(col('dense_acc'))} | {fmt(col('sparse_acc'))} | "
            f"{fmt(col('train_reward_last25'))} | {fmt(col('train_kv_saving'), '.1%')} | "
            f"{fmt(col('mismatch_kl_k3'), '.4f')} | {fmt(col('token_reject_rate'))} | "
            f"{fmt(col('seq_reject_rate'))} | {acc} | {reward} |"
        )
    by = {(c["policy"], c["mode"]): c["per_seed"] for c in cells}
    cs = []
    for policy in dict.fromkeys(c["policy"] for c in cells):
        if (policy, "sparse_rl") in by and (policy, "naive_sparse") in by:
            for key, what in (("dense_acc", "dense inference"), ("sparse_acc", "sparse inference")):
                cs += figlib.compare(f"{policy} Sparse-RL", by[policy, "sparse_rl"], f"{policy} naive",
                                     by[policy, "naive_sparse"], key, n_eval, metric=what)
    kept = "" if "collapse_iteration" in cells[0]["per_seed"][0] else " (These runs kept no histories: '-'.)"
    lines += ["", figlib.warm_note(warms) + figlib.COLLAPSE_NOTE + kept, "",
              "Paired differences, Sparse-RL minus naive sparse per policy (by seed):", "",
              *figlib.comparison_table(cs), "", figlib.TIE_NOTE]

    # one group of bars per rollout policy, one bar per training mode (colour)
    policies = list(dict.fromkeys(c["policy"] for c in cells))
    modes = list(dict.fromkeys(c["mode"] for c in cells))
    width = 0.8 / max(sum(c['policy'] == p for c in cells) for p in policies)
    fig, axes = figlib.plt.subplots(2, 2, figsize=(2 * figlib.PANEL_W, 5.6), layout="constrained")
    axes = axes.ravel()
    acc = f"accuracy (avg@1, {n_eval} prompts)"
    for ax, key, ylabel, title in zip(
            axes, ("dense_acc", "sparse_acc", "mismatch_kl_k3", "token_reject_rate"),
            (acc, acc, "nats per token (run mean)", "fraction of response tokens (last 25%)"),
            ("dense inference", "sparse inference (the training policy;\n"
             f"dense arm: {kvc.policy}), budget {kvc.budget}", "mismatch KL (k3) during training",
             "tokens the update leaves out")):
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
            ax.bar(xs, ms, yerr=[np.minimum(ss, np.maximum(ms, 0.0)), ss], width=width, color=MODE_COLOURS.get(mode), capsize=2,
                   label=MODE_LABELS.get(mode, mode))
        ax.set_xticks(range(len(policies)), policies)
        ax.set_xlabel("rollout eviction policy")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
    figlib.band_legend_below(fig, axes[0])
    fig.suptitle(f"Figure c: eviction-policy ablation\n{figlib.config_name(command)} (task "
                 f"{base.data.task}), budget {kvc.budget} + buffer {kvc.buffer}\n{len(seeds)} "
                 f"seed{'s' if len(seeds) != 1 else ''}, {base.train.iterations} iterations")
    caption = (
        f"Figure: final held-out accuracy (avg@1 on {n_eval} prompts) under dense and under sparse "
        "inference, the mean mismatch KL during training (k3, nats per response token) and the "
        "fraction of response tokens the update leaves out (last 25% of iterations) of models "
        "trained with each rollout eviction policy, without corrections (naive sparse) and with "
        "them (Sparse-RL); 'none' is the dense-rollout arm. Bars: mean over seeds; error bars: ± one "
        f"sample standard deviation over seeds, clipped at 0 (none with one seed). Seeds {seeds}.")
    return figlib.Rendered("Figure c: eviction-policy ablation", "\n".join(lines), {"policies": fig}, caption)


FIGURE = figlib.Figure("fig_c_policies", __doc__, run, render, arguments, seeds=(0,))

main = FIGURE.main


if __name__ == "__main__":
    main()
