"""Figure c: eviction-policy ablation. Each policy's sparse rollouts trained without corrections
(naive sparse) and with them (Sparse-RL), next to dense rollouts.

  python experiments/figures/fig_c_policies.py                     # 6 policies x 2 modes, seed 0
  python experiments/figures/fig_c_policies.py --policies streaming snapkv --smoke

Every run uses the same warm start, budget, buffer and seed. Each model is evaluated densely and
under sparse inference with the policy it was trained with.
"""

from __future__ import annotations

import numpy as np

from experiments.lib import figlib
from sparserl_jax.kvcache.policies import POLICIES

MODES = ("naive_sparse", "sparse_rl")


MODE_LABELS = {"dense": "dense", "naive_sparse": "naive sparse", "sparse_rl": "Sparse-RL"}
MODE_COLOURS = figlib.ARM_COLOURS  # one colour per arm, as in every figure


def modes_of(policy: str) -> tuple[str, ...]:
    return ("dense",) if policy == "none" else MODES


def run(args, study) -> dict:
    n_eval = figlib.eval_prompts(args, study)
    spec = lambda p, m, s: dict(name=f"{p}/{m}/seed{s}", mode=m, policy=p, seed=s)  # noqa: E731
    # sparse inference under the policy a model was trained with (the dense arm: the base config's)
    study.train_all(
        [spec(p, m, s) for p in args.policies for m in modes_of(p) for s in args.seeds],
        [({"policy": "none"}, n_eval), ({}, n_eval)],
    )
    cells = []
    for policy in args.policies:
        for mode in modes_of(policy):
            sparse_policy = policy if policy != "none" else study.base.kv.policy
            per_seed = [
                {**figlib.scores(study.arm(**spec(policy, mode, s)), sparse_policy, n_eval), "seed": s}
                for s in args.seeds
            ]
            cells.append(
                {"policy": policy, "mode": mode, "sparse_inference_policy": sparse_policy, "per_seed": per_seed}
            )
    kvc = study.base.kv
    warm = figlib.warm_rows(study, [0], n_eval)
    return {
        "cells": cells,
        "seeds": args.seeds,
        "kv": dict(budget=kvc.budget, buffer=kvc.buffer),
        "eval_prompts": n_eval,
        "warm_starts": {"0": warm[0]},
    }


COLUMNS = (  # (header, row key, format) of the table
    ("acc. dense inf.", "dense_acc", ".3f"),
    ("acc. sparse inf.", "sparse_acc", ".3f"),
    ("train reward (last 25%)", "train_reward_last25", ".3f"),
    ("KV saving", "train_kv_saving", ".1%"),
    ("mismatch KL (k3)", "mismatch_kl_k3", ".4f"),
    ("token reject (last 25%)", "token_reject_rate", ".3f"),
    ("seq reject (last 25%)", "seq_reject_rate", ".3f"),
)
COMPARED = {"sparse_rl": "Sparse-RL", "naive_sparse": "naive"}  # the modes compared per policy, as named there


def render(data: dict, base, command: str) -> figlib.Rendered:
    cells, seeds = data["cells"], data["seeds"]
    n_eval = data.get("eval_prompts", base.train.eval_prompts)
    warms = figlib.warm_starts_of(data)
    kvc = base.kv
    policies = list(dict.fromkeys(c["policy"] for c in cells))
    named = {f"{c['policy']} {COMPARED[c['mode']]}": c["per_seed"] for c in cells if c["mode"] in COMPARED}
    cs = figlib.compare_arms(named, [(f"{p} Sparse-RL", f"{p} naive") for p in policies], figlib.ACC_METRICS, n_eval)
    kept = "" if "collapse_iteration" in cells[0]["per_seed"][0] else " (These runs kept no histories: '-'.)"
    lines = [
        f"Budget {kvc.budget} + buffer {kvc.buffer}, window {kvc.window}, selection {kvc.selection}; "
        f"{base.train.iterations} iterations; seeds {seeds}. Sparse inference uses the "
        f"policy the model was trained with (the dense arm: {kvc.policy}).",
        "",
        *figlib.md_table(
            ["rollout policy", "mode", *figlib.headers(COLUMNS), *figlib.COLLAPSE_HEADERS],
            ([c["policy"], c["mode"], *figlib.arm_cells(c["per_seed"], COLUMNS, warms)] for c in cells),
        ),
        "",
        figlib.warm_note(warms) + figlib.COLLAPSE_NOTE + kept,
        *figlib.comparison_lines(cs, "Paired differences, Sparse-RL minus naive sparse per policy (by seed):"),
    ]

    # one group of bars per rollout policy, one bar per training mode (colour), centred per group
    groups = {p: [c["mode"] for c in cells if c["policy"] == p] for p in policies}
    width = 0.8 / max(len(modes) for modes in groups.values())
    fig, axes = figlib.panels(2, 5.6)
    acc = f"accuracy (avg@1, {n_eval} prompts)"
    for ax, key, ylabel, title in zip(
        axes,
        ("dense_acc", "sparse_acc", "mismatch_kl_k3", "token_reject_rate"),
        (acc, acc, "nats per token (run mean)", "fraction of response tokens (last 25%)"),
        (
            "dense inference",
            f"sparse inference (the training policy;\ndense arm: {kvc.policy}), budget {kvc.budget}",
            "mismatch KL (k3) during training",
            "tokens the update leaves out",
        ),
    ):
        for mode in dict.fromkeys(c["mode"] for c in cells):
            mine = [c for c in cells if c["mode"] == mode]
            group = [groups[c["policy"]] for c in mine]  # the modes beside each bar
            xs = [policies.index(c["policy"]) + (g.index(mode) - (len(g) - 1) / 2) * width for c, g in zip(mine, group)]
            ms, ss = np.array([figlib.mean_std(r[key] for r in c["per_seed"]) for c in mine]).T
            ax.bar(
                xs,
                ms,
                yerr=figlib.clipped_err(ms, ss),
                width=width,
                color=MODE_COLOURS.get(mode),
                capsize=2,
                label=MODE_LABELS.get(mode, mode),
            )
        ax.set_xticks(range(len(policies)), policies)
        ax.set(xlabel="rollout eviction policy", ylabel=ylabel, title=title)
    figlib.band_legend_below(fig, axes[0])
    fig.suptitle(
        figlib.run_title(
            base,
            command,
            seeds,
            "Figure c: eviction-policy ablation",
            setting=f"budget {kvc.budget} + buffer {kvc.buffer}",
            runs=f"{figlib.runs_phrase(seeds)}, {base.train.iterations} iterations",
        )
    )
    caption = (
        f"Figure: final held-out accuracy (avg@1 on {n_eval} prompts) under dense and under sparse "
        "inference, the mean mismatch KL during training (k3, nats per response token) and the "
        "fraction of response tokens the update leaves out (last 25% of iterations) of models "
        "trained with each rollout eviction policy, without corrections (naive sparse) and with "
        "them (Sparse-RL); 'none' is the dense-rollout arm. " + figlib.seeds_caption("Bars", seeds)
    )
    return figlib.Rendered("Figure c: eviction-policy ablation", "\n".join(lines), {"policies": fig}, caption)


FIGURE = figlib.Figure("fig_c_policies", __doc__, run, render, seeds=(0,), choices={"--policies": POLICIES})

main = FIGURE.main


if __name__ == "__main__":
    main()
