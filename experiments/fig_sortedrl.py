"""Figure SortedRL: length-aware scheduling of rollouts (methods.md 3) at tiny scale: the static
baseline (one big rollout of n update batches, then n off-policy update batches), SortedRL
on-policy and partial on the slot engine, and one run stacking all three methods (sparse KV +
int8 weights + sorted partial rollouts), beside the paper's bubble and throughput numbers.

  python experiments/fig_sortedrl.py                                   # 4 variants x 3 seeds
  python experiments/fig_sortedrl.py --config experiments/configs/default.yaml --seeds 0
  python experiments/fig_sortedrl.py --seeds 0 --variants baseline sorted_partial --smoke

The default workload is experiments/configs/long_tail.yaml: cycle_walk with long-tailed lengths
(most responses ~30 tokens, ~9% at the 124-token cap), where a static batch waits for its longest
row. Every variant starts from the same warm start and trains the same number of update batches
(train.iterations, rounded up to whole groups of n): the baseline in iterations / n iterations of
n x rollout.prompts prompts (its update batch is split into n x the minibatches), the sorted arms
in `iterations` harvests of rollout.prompts prompts with groups of n = sorted.group_batches update
batches. The partial and stacked arms use rl.mode=sparse_rl, whose xi = pi_old / pi_sampler covers
the staleness of resumed tokens (and the sparse KV and int8 weights in the stacked arm); baseline
and on-policy use rl.mode=dense with dense KV.

Time is counted the same way in every arm (experiments/step_timing.py): each iteration's wall time
and the compile time inside it (jax.monitoring compile spans, each second once). The whole run's
wall time includes compile (every arm compiles its programs once) and is also given without it;
the steady state is the update batches after the first group (the baseline's first iteration,
the sorted arms' first n), per update batch with compile excluded. Rollout throughput is
total-time over that steady state: its rollout tokens / its rollout time without compile; the
bubble ratios are those iterations' means weighted by rollout time (Eq. 4 over the whole rollout
time). Figure: throughput and wall bubble bars with the
paper's numbers marked, and cumulative rollout time and train reward against cumulative rollout
tokens after the first group, every arm on one axis (the paper's throughput gains drawn as
slopes from the baseline's).
"""

from __future__ import annotations

import os

import figlib
import numpy as np
import step_timing
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


def _tokens(run, r: dict) -> float:
    return r["response/length_mean"] * run.cfg.rollout.prompts * run.cfg.rollout.samples


def _after_first_group(h: list[dict]) -> list[dict]:
    """The iterations after the first group (which compiles everything); all of a short run."""
    group = lambda i, r: r.get("sorted/group", float(i))  # noqa: E731 (baseline: a group per iteration)
    later = [r for i, r in enumerate(h) if group(i, r) != group(0, h[0])]
    return later or h


def row(run) -> dict:
    h = run.history
    later = _after_first_group(h)
    # rollout time of the steady state, compile excluded (none is expected there)
    t = np.array([r["time/rollout_wall_s"] - r["time/rollout_compile_s"] for r in later])
    weighted = lambda k: float(np.sum(t * [r[k] for r in later]) / max(t.sum(), 1e-12))  # noqa: E731
    timing = step_timing.account(h, 1 if run.cfg.rollout.scheduler == "sorted" else N_GROUP, N_GROUP)
    return {
        "dense_acc": run.evaluate({"policy": "none"})["accuracy"],
        # total tokens / total rollout time after the first group, and Eq. 4 over that time
        "bubble_wall": weighted("rollout/bubble_wall"),
        "bubble_slots": weighted("rollout/bubble_slots"),
        "rollout_tokens_per_s": float(sum(_tokens(run, r) for r in later) / max(t.sum(), 1e-12)),
        "rollout_s": float(t.sum()),
        # the steady state per update batch (a baseline iteration is n of them), compile excluded
        "wall_s_per_batch": timing["steady_s_per_batch"],
        # the curves: cumulative over the update batches after the first group
        "tokens_cum": np.cumsum([_tokens(run, r) for r in later]).tolist(),
        "rollout_s_cum": np.cumsum(t).tolist(),
        "staleness_mean": figlib.run_mean(h, "sorted/staleness_mean"),
        "discarded_token_fraction": figlib.run_mean(h, "sorted/discarded_token_fraction"),
        **timing,  # wall_s: the whole run with compile, wall_s_no_compile, compile_s, ...
        **figlib.summarize(run),
    }


def main(argv=None) -> dict:
    p = figlib.variants_parser(__doc__, VARIANTS)
    p.set_defaults(config=LONG_TAIL_CONFIG)
    args = p.parse_args(argv)
    study = figlib.study_from_args(args)
    out = args.out or figlib.default_out("fig_sortedrl", args.config, LONG_TAIL_CONFIG)
    b = study.base
    sparse = b.kv.policy if b.kv.policy != "none" else "snapkv"
    iters = N_GROUP * max(-(-b.train.iterations // N_GROUP), 1)  # update batches: whole groups

    def arm_of(name):
        mode, is_sparse, extra, _, _ = VARIANTS[name]
        if name == "baseline":  # n update batches per rollout, the same samples in all
            extra = (f"rollout.prompts={N_GROUP * b.rollout.prompts}",
                     f"train.iterations={iters // N_GROUP}")
        else:
            extra = (*extra, f"train.iterations={iters}")
        return mode, sparse if is_sparse else "none", tuple(extra)

    with step_timing.timed_workers(figlib):  # every arm's steps timed the same way
        results, histories = figlib.run_variants(study, args.variants, args.seeds, arm_of, row)

    lines = [
        f"{iters} update batches of {b.rollout.prompts} prompts x {b.rollout.samples} samples; seeds "
        f"{args.seeds} (mean ± std); n = {N_GROUP}; max {b.rollout.max_new_tokens} new tokens; stacked "
        f"arm: {sparse} budget {b.kv.budget} + buffer {b.kv.buffer}, int8 W8A8 rollouts. Paper: bubble "
        "74% -> 5.8% (on-policy) / 3.4% (partial), rollout throughput +7.6% / +39.5%.",
        "",
        "Time is counted the same way in every arm: each training step's wall time and the compile "
        "time inside it (jax.monitoring compile spans). Steady state: the update batches after the "
        "first group (the first n; the baseline's first iteration; a run of one group, as with "
        "--smoke: all of it). Rollout tokens/s: the steady "
        "state's rollout tokens / its rollout time, compile excluded; bubbles: those iterations' "
        "means weighted by rollout time; wall s / batch: a steady-state update batch's whole step "
        "(rollout, rewards, scoring, update), compile excluded (a baseline iteration is n batches); "
        "wall s: the whole run's steps, compile included (every arm compiles once), then without "
        "it; compiles: XLA compilations in the steady state (0 expected).",
        "",
        "| variant | mode | accuracy | train reward (last 25%) | bubble (wall, Eq. 4) | bubble (slot-steps) | "
        "rollout tokens/s | vs baseline | staleness | discarded tokens | wall s / batch | "
        "wall s (with compile) | wall s (no compile) | compiles after 1st group | "
        "paper bubble | paper throughput |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
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
            f"{fmt(col('staleness_mean'))} | {fmt(col('discarded_token_fraction'))} | "
            f"{fmt(col('wall_s_per_batch'), '.3f')} | {fmt(col('wall_s'), '.1f')} | "
            f"{fmt(col('wall_s_no_compile'), '.1f')} | {fmt(col('steady_compiles'), '.0f')} | "
            f"{'—' if paper is None else f'{paper:.1%}'} | "
            f"{'—' if paper_gain is None else f'+{paper_gain:.1%}'} |")

    fig = _figure(results, histories, base_tps)
    names = list(results)
    data = {"results": results, "seeds": args.seeds, "histories": histories,
            "variants": {n: [f"rl.mode={VARIANTS[n][0]}", *arm_of(n)[2]] for n in names},
            "paper": {n: {"bubble": VARIANTS[n][3], "throughput_gain": VARIANTS[n][4]} for n in names}}
    figlib.write_outputs(out, "Figure SortedRL: length-aware rollout scheduling", "\n".join(lines),
                         data, fig, "sortedrl", study)
    return data


def _figure(results: dict, histories: dict, base_tps):
    """Throughput and wall bubble per arm (the paper's numbers marked), then cumulative rollout
    time and train reward against cumulative rollout tokens, every arm on one axis."""
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    names = list(results)
    x = np.arange(len(names))
    for ax, key, title in ((axes[0], "rollout_tokens_per_s", "rollout tokens/s (total time)"),
                           (axes[1], "bubble_wall", "bubble ratio (wall, Eq. 4)")):
        stats = [figlib.mean_std(r[key] for r in results[n]) for n in names]
        ax.bar(x, [m for m, _ in stats], yerr=[s for _, s in stats], capsize=3)
        for i, n in enumerate(names):
            bubble, gain = VARIANTS[n][3], VARIANTS[n][4]
            mark = bubble if key == "bubble_wall" else (None if base_tps is None or gain is None
                                                        else base_tps * (1 + gain))
            if mark is not None:
                ax.plot([i - 0.4, i + 0.4], [mark, mark], "r--", lw=1.5,
                        label="paper" if i == 0 or not ax.get_legend_handles_labels()[0] else None)
        ax.set_xticks(x, names, fontsize=7, rotation=30)
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for name in names:
        rows = results[name]
        n = min(len(r["tokens_cum"]) for r in rows)
        tokens = np.mean([r["tokens_cum"][:n] for r in rows], axis=0)
        seconds = np.mean([r["rollout_s_cum"][:n] for r in rows], axis=0)
        reward = np.mean([[r["reward/mean"] for r in _after_first_group(h)[:n]]
                          for h in histories[name]], axis=0)
        axes[2].plot(tokens, seconds, marker=".", label=name)
        axes[3].plot(tokens, reward, marker=".", label=name)
    if base_tps:
        top = max(r["tokens_cum"][-1] for rows in results.values() for r in rows)
        for name, gain in (("on-policy", VARIANTS["sorted_on_policy"][4]),
                           ("partial", VARIANTS["sorted_partial"][4])):
            axes[2].plot([0, top], [0, top / (base_tps * (1 + gain))], ":", lw=1,
                         label=f"paper {name}: baseline rate +{gain:.1%}")
    axes[2].set_title("rollout time after the first group")
    axes[2].set_ylabel("rollout s")
    axes[3].set_title("train reward (after the first group)")
    for ax in axes[2:]:
        ax.set_xlabel("rollout tokens")
        ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
