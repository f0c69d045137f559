"""Figure SortedRL: length-aware scheduling of rollouts (methods.md 3) at tiny scale: the static
baseline (one big rollout of n update batches, then n off-policy update batches), SortedRL
on-policy and partial on the slot engine, and one run stacking all three methods (sparse KV +
int8 weights + sorted partial rollouts), beside the paper's bubble and throughput numbers.

  python experiments/fig_sortedrl.py                                   # 4 variants x 3 seeds
  python experiments/fig_sortedrl.py --config experiments/configs/default.yaml --seeds 0
  python experiments/fig_sortedrl.py --seeds 0 --variants baseline sorted_partial --smoke

The default workload is experiments/configs/long_tail.yaml: cycle_walk with long-tailed lengths
(most responses ~30 tokens, ~9% at the 124-token cap), where a static batch waits for its longest
row. Every variant starts from the same warm start and sees the same number of samples: the baseline
runs iterations / n iterations of n x rollout.prompts prompts (its update batch is split into
n x the minibatches), the sorted arms `iterations` harvests of rollout.prompts prompts with groups
of n = sorted.group_batches update batches. The partial and stacked arms use rl.mode=sparse_rl,
whose xi = pi_old / pi_sampler covers the staleness of resumed tokens (and the sparse KV and int8
weights in the stacked arm); baseline and on-policy use rl.mode=dense with dense KV. Rollout
throughput and bubble ratios are measured on this machine (CPU; the first iterations include
compilation: bubbles and throughput are last-quarter means). Curves: train reward vs samples and vs wall time (rollout + score + update).
"""

from __future__ import annotations

import os

import figlib
import numpy as np
from figlib import fmt
from matplotlib import pyplot as plt

N_GROUP = 4  # the paper's n
LONG_TAIL_CONFIG = os.path.join(figlib.HERE, "configs", "long_tail.yaml")
SORTED = ("rollout.scheduler=sorted", f"sorted.group_batches={N_GROUP}")
VARIANTS = {  # name -> (rl.mode, sparse KV?, extra overrides, paper bubble, paper throughput gain)
    "baseline": ("dense", False, (), 0.74, 0.0),
    "sorted_on_policy": ("dense", False, SORTED + ("sorted.mode=on_policy",), 0.058, 0.076),
    "sorted_partial": ("sparse_rl", False, SORTED + ("sorted.mode=partial",), 0.034, 0.395),
    "sparse_int8_sorted_partial": ("sparse_rl", True, SORTED + ("sorted.mode=partial",
                                                                "quant.format=int8"), None, None),
}


def row(run) -> dict:
    h = run.history
    return {
        "dense_acc": run.evaluate({"policy": "none"})["accuracy"],
        # the last quarter of the run: the first iterations include compilation
        "bubble_wall": figlib.last_quarter(h, "rollout/bubble_wall"),
        "bubble_slots": figlib.last_quarter(h, "rollout/bubble_slots"),
        "rollout_tokens_per_s": figlib.last_quarter(h, "throughput/rollout_tokens_per_s"),
        "staleness_mean": figlib.run_mean(h, "sorted/staleness_mean"),
        "discarded_token_fraction": figlib.run_mean(h, "sorted/discarded_token_fraction"),
        "wall_s": float(sum(_iter_seconds(r) for r in h)),
        **figlib.summarize(run),
    }


def _iter_seconds(r: dict) -> float:
    return r.get("time/rollout_s", 0.0) + r.get("time/score_s", 0.0) + r.get("time/update_s", 0.0)


def main(argv=None) -> dict:
    p = figlib.variants_parser(__doc__, VARIANTS)
    p.set_defaults(config=LONG_TAIL_CONFIG)
    args = p.parse_args(argv)
    study = figlib.study_from_args(args)
    out = args.out or figlib.default_out("fig_sortedrl", args.config, LONG_TAIL_CONFIG)
    b = study.base
    sparse = b.kv.policy if b.kv.policy != "none" else "snapkv"
    iters = b.train.iterations

    def arm_of(name):
        mode, is_sparse, extra, _, _ = VARIANTS[name]
        if name == "baseline":  # n update batches per rollout, the same samples in all
            extra = (f"rollout.prompts={N_GROUP * b.rollout.prompts}",
                     f"train.iterations={max(iters // N_GROUP, 1)}")
        return mode, sparse if is_sparse else "none", tuple(extra)

    results, histories = figlib.run_variants(study, args.variants, args.seeds, arm_of, row)

    lines = [
        f"{iters} update batches of {b.rollout.prompts} prompts x {b.rollout.samples} samples; seeds "
        f"{args.seeds} (mean ± std); n = {N_GROUP}; max {b.rollout.max_new_tokens} new tokens; stacked "
        f"arm: {sparse} budget {b.kv.budget} + buffer {b.kv.buffer}, int8 W8A8 rollouts. Paper: bubble "
        "74% -> 5.8% (on-policy) / 3.4% (partial), rollout throughput +7.6% / +39.5%.",
        "",
        "| variant | mode | accuracy | train reward (last 25%) | bubble (wall, Eq. 4) | bubble (slot-steps) | "
        "rollout tokens/s | vs baseline | staleness | discarded tokens | wall s | paper bubble | paper throughput |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base_tps = (np.mean([r["rollout_tokens_per_s"] for r in results["baseline"]])
                if "baseline" in results else None)
    for name, rows in results.items():
        col = lambda k: [r[k] for r in rows]  # noqa: E731
        paper, paper_gain = VARIANTS[name][3], VARIANTS[name][4]
        gain = "—" if base_tps is None else f"{np.mean(col('rollout_tokens_per_s')) / base_tps:.2f}x"
        lines.append(
            f"| {name} | {VARIANTS[name][0]} | {fmt(col('dense_acc'))} | {fmt(col('train_reward_last25'))} | "
            f"{fmt(col('bubble_wall'))} | {fmt(col('bubble_slots'))} | {fmt(col('rollout_tokens_per_s'), '.0f')} | {gain} | "
            f"{fmt(col('staleness_mean'))} | {fmt(col('discarded_token_fraction'))} | {fmt(col('wall_s'), '.0f')} | "
            f"{'—' if paper is None else f'{paper:.1%}'} | "
            f"{'—' if paper_gain is None else f'+{paper_gain:.1%}'} |")

    fig = figlib.bars_and_reward_curves(results, histories, [
        ("bubble_wall", "bubble ratio (wall, Eq. 4)"), ("rollout_tokens_per_s", "rollout tokens/s")])
    # the reward curves again, against samples and wall time
    fig2, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for name, hs in histories.items():
        rows = (N_GROUP if name == "baseline" else 1) * b.rollout.prompts * b.rollout.samples
        n = min(len(h) for h in hs)
        reward = np.mean([[h[i]["reward/mean"] for i in range(n)] for h in hs], axis=0)
        wall = np.mean([np.cumsum([_iter_seconds(h[i]) for i in range(n)]) for h in hs], axis=0)
        axes[0].plot(rows * np.arange(1, n + 1), reward, label=name)
        axes[1].plot(wall, reward, label=name)
    axes[0].set_xlabel("samples")
    axes[1].set_xlabel("wall s")
    for ax in axes:
        ax.set_ylabel("train reward")
        ax.legend(fontsize=7)
    fig2.tight_layout()
    os.makedirs(out, exist_ok=True)
    fig2.savefig(os.path.join(out, "reward_vs_samples_and_time.png"), dpi=110)
    plt.close(fig2)
    names = list(results)
    data = {"results": results, "seeds": args.seeds, "histories": histories,
            "variants": {n: [f"rl.mode={VARIANTS[n][0]}", *arm_of(n)[2]] for n in names},
            "paper": {n: {"bubble": VARIANTS[n][3], "throughput_gain": VARIANTS[n][4]} for n in names}}
    figlib.write_outputs(out, "Figure SortedRL: length-aware rollout scheduling", "\n".join(lines),
                         data, fig, "sortedrl", study)
    return data


if __name__ == "__main__":
    main()
