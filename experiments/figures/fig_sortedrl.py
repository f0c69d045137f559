"""Figure SortedRL: length-aware scheduling of rollouts (docs/methods.md#sortedrl) at tiny
scale: the static baseline (one big rollout of n update batches, then n off-policy update
batches), SortedRL on-policy (a dropped prompt re-queued at once, the paper's rule; and our
`hold` variant, sorted.requeue=hold) and partial on the slot engine, and one run stacking all
three methods (sparse KV + int8 weights + sorted partial rollouts), beside the paper's bubble and
throughput numbers.

  python experiments/figures/fig_sortedrl.py                                   # 5 variants x 3 seeds
  python experiments/figures/fig_sortedrl.py --config experiments/configs/default.yaml --seeds 0
  python experiments/figures/fig_sortedrl.py --seeds 0 --variants baseline sorted_partial --smoke
  python experiments/figures/fig_sortedrl.py --replot experiments/results/fig_sortedrl

The default workload is experiments/configs/long_tail.yaml: cycle_walk with long-tailed lengths
(most responses ~30 tokens, ~9% at the 124-token cap), where a static batch waits for its longest
row. Every variant starts from the same warm start and trains the same number of update batches
(train.iterations, rounded up to whole groups of n): the baseline in iterations / n iterations of
n x rollout.prompts prompts (its update batch is split into n x the minibatches), the sorted arms
in `iterations` harvests of rollout.prompts prompts with groups of n = sorted.group_batches update
batches. The partial and stacked arms use rl.mode=sparse_rl, whose xi = pi_old / pi_sampler covers
the staleness of resumed tokens (and the sparse KV and int8 weights in the stacked arm); baseline
and on-policy use rl.mode=dense with dense KV. Time is counted the same way in every arm
(experiments/lib/step_timing.py; TIMING below, which results.md quotes).
"""

from __future__ import annotations

import os

import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MultipleLocator, PercentFormatter

from experiments.lib import figlib, step_timing

N_GROUP = 4  # the paper's n
LONG_TAIL_CONFIG = os.path.join(figlib.HERE, "configs", "long_tail.yaml")
SORTED = ("rollout.scheduler=sorted", f"sorted.group_batches={N_GROUP}")
VARIANTS = {  # name -> (rl.mode, sparse KV?, extra overrides, paper bubble, paper throughput gain)
    "baseline": ("dense", False, (), 0.74, 0.0),
    "sorted_on_policy": ("dense", False, SORTED + ("sorted.mode=on_policy", "sorted.requeue=immediate"), 0.058, 0.076),
    "sorted_on_policy_hold": ("dense", False, SORTED + ("sorted.mode=on_policy", "sorted.requeue=hold"), None, None),
    "sorted_partial": ("sparse_rl", False, SORTED + ("sorted.mode=partial",), 0.034, 0.395),
    "sparse_int8_sorted_partial": (
        "sparse_rl",
        True,
        SORTED + ("sorted.mode=partial", "quant.format=int8"),
        None,
        None,
    ),
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


def arm(name: str, b) -> tuple[str, str, tuple[str, ...]]:
    """(rl.mode, kv.policy, extra overrides) of a variant on base config `b`. Every arm trains
    train.iterations update batches rounded up to whole groups of n; the baseline n per rollout."""
    mode, is_sparse, extra, _, _ = VARIANTS[name]
    iters = update_batches(b)
    extra = (
        (f"rollout.prompts={N_GROUP * b.rollout.prompts}", f"train.iterations={iters // N_GROUP}")
        if name == "baseline"
        else (*extra, f"train.iterations={iters}")
    )
    return mode, (b.kv.policy if b.kv.policy != "none" else "snapkv") if is_sparse else "none", extra


def update_batches(b) -> int:
    return N_GROUP * max(-(-b.train.iterations // N_GROUP), 1)


def run(args, study) -> dict:
    with step_timing.timed_workers(figlib):  # every arm's steps timed the same way
        results, histories = figlib.run_variants(study, args.variants, args.seeds, lambda n: arm(n, study.base), row)
    return {
        "results": results,
        "seeds": args.seeds,
        "histories": histories,
        "variants": {n: [f"rl.mode={VARIANTS[n][0]}", *arm(n, study.base)[2]] for n in results},
        "paper": {n: {"bubble": VARIANTS[n][3], "throughput_gain": VARIANTS[n][4]} for n in results},
    }


TIMING = (
    "Time is counted the same way in every arm: each training step's wall time and the compile time inside "
    "it (jax.monitoring compile spans). Steady state: the update batches after the first group (the first "
    "n; the baseline's first iteration; a run of one group, as with --smoke: all of it). Rollout tokens/s: "
    "the steady state's rollout tokens / its rollout time, compile excluded; bubbles: those iterations' "
    "means weighted by rollout time; wall s / batch: a steady-state update batch's whole step (rollout, "
    "rewards, scoring, update), compile excluded (a baseline iteration is n batches); wall s: the whole "
    "run's steps, compile included (every arm compiles once), then without it; compiles: XLA "
    "compilations in the steady state (0 expected)."
)
UNTIMED = (  # results.json files written before step_timing timed the arms
    " These numbers were recorded before the arms were timed alike (commit 8e2a5ae): nothing is "
    "compile-subtracted (rollout time and wall s / batch are the logged rollout, + score + update, "
    "times after the first group; wall s the whole run's) and compile time and counts are '—'."
)
COLUMNS = (  # (header, key, format) of the table
    ("accuracy", "dense_acc", ".3f"),
    ("train reward (last 25%)", "train_reward_last25", ".3f"),
    ("bubble (wall, Eq. 4)", "bubble_wall", ".3f"),
    ("bubble (slot-steps)", "bubble_slots", ".3f"),
    ("rollout tokens/s", "rollout_tokens_per_s", ".0f"),
    ("staleness", "staleness_mean", ".3f"),
    ("discarded tokens", "discarded_token_fraction", ".3f"),
    ("wall s / batch", "wall_s_per_batch", ".3f"),
    ("wall s (with compile)", "wall_s", ".1f"),
    ("wall s (no compile)", "wall_s_no_compile", ".1f"),
    ("compiles after 1st group", "steady_compiles", ".0f"),
)
ROLES = {"baseline": "dense", "sparse_int8_sorted_partial": "stacked"}  # colours: figlib.ARM_COLOURS
LABELS = {
    "baseline": "batch (baseline)",
    "sorted_on_policy": "sorted on-policy",
    "sorted_on_policy_hold": "sorted on-policy\n(hold)",
    "sorted_partial": "sorted partial",
    "sparse_int8_sorted_partial": "sparse + int8\n+ sorted partial",
}


def render(data: dict, b, command: str) -> figlib.Rendered:
    results, seeds = data["results"], data["seeds"]
    timed = all("wall_s_no_compile" in r for rows in results.values() for r in rows)
    lines = [
        f"{update_batches(b)} update batches of {b.rollout.prompts} prompts x {b.rollout.samples} samples; "
        f"seeds {seeds} (mean ± std); n = {N_GROUP}; max {b.rollout.max_new_tokens} new tokens; stacked "
        f"arm: {arm('sparse_int8_sorted_partial', b)[1]} budget {b.kv.budget} + buffer {b.kv.buffer}, int8 "
        "W8A8 rollouts. Paper: bubble 74% -> 5.8% (on-policy) / 3.4% (partial), rollout throughput "
        "+7.6% / +39.5%.",
        "",
        TIMING + ("" if timed else UNTIMED),
        "",
    ]
    base_tps = np.mean([r["rollout_tokens_per_s"] for r in results["baseline"]]) if "baseline" in results else None
    body = []
    for name, rows in results.items():
        mode, _, _, bubble, gain = VARIANTS[name]
        body.append(
            [
                name,
                mode,
                *figlib.stat_cells(rows, COLUMNS, "—"),
                "—" if base_tps is None else f"{np.mean([r['rollout_tokens_per_s'] for r in rows]) / base_tps:.2f}x",
                "—" if bubble is None else f"{bubble:.1%}",
                "—" if gain is None else f"+{gain:.1%}",
            ]
        )
    lines += figlib.md_table(
        [
            "variant",
            "mode",
            *figlib.headers(COLUMNS),
            "rollout tokens/s vs baseline",
            "paper bubble",
            "paper throughput",
        ],
        body,
    )
    n_eval = b.train.eval_prompts
    lines += figlib.comparison_lines(
        figlib.compare_arms(
            results,
            [(n, "baseline") for n in results if n != "baseline"],
            {"dense_acc": "accuracy (dense inference)"},
            n_eval,
        ),
        f"Accuracy against the baseline, paired by seed ({n_eval} prompts per evaluation):",
    )
    title = (
        f"Figure SortedRL: length-aware rollout scheduling, {figlib.runs_phrase(seeds)}\n"
        f"{figlib.config_name(command, LONG_TAIL_CONFIG)} (task {b.data.task}, up to "
        f"{b.rollout.max_new_tokens} new tokens): {update_batches(b)} update batches of "
        f"{b.rollout.prompts}x{b.rollout.samples} rollouts, n = {N_GROUP}"
    )
    caption = (
        "Figure: top, each arm's steady-state rollout throughput and wall bubble ratio (Eq. 4), dots: the "
        "seeds, black dashes: the paper's numbers (throughput: the baseline's rate x (1 + the paper's gain)); "
        "middle, the whole run's wall time for the same update batches"
        + (" (compile excluded)" if timed else "")
        + " and the final accuracy (avg@1 on "
        f"{b.train.eval_prompts} prompts, dense inference; against the baseline by the tie rule in the table "
        "above), bars the mean over seeds, error bars ± one sample standard deviation, dots the seeds; "
        "bottom left, cumulative rollout time against cumulative rollout tokens after the first group"
        + (" (compile excluded)" if timed else "")
        + ", dotted: the baseline's rate raised by the paper's "
        f"gains; bottom right, the train reward per group of n = {N_GROUP} update batches (one baseline "
        f"rollout). {figlib.BAND_CAPTION} Seeds {seeds}."
    )
    return figlib.Rendered(
        "Figure SortedRL: length-aware rollout scheduling",
        "\n".join(lines),
        {"sortedrl": _figure(results, data["histories"], base_tps, title)},
        caption,
    )


def _reward_by_group(h: list[dict]) -> np.ndarray:
    """Each group's mean train reward (a baseline iteration is one; sorted: n equal harvests)."""
    per = N_GROUP if "sorted/group" in h[0] else 1  # iterations per group
    return np.array([x["reward/mean"] for x in h[: len(h) // per * per]]).reshape(-1, per).mean(1)


def _figure(results: dict, histories: dict, base_tps: float | None, title: str):
    """Throughput and wall bubble bars (the paper's numbers marked), cumulative rollout time against
    cumulative rollout tokens, and the train reward per group, every arm in its own colour."""
    names, colours = list(results), figlib.arm_colours(VARIANTS, ROLES)
    fig, (tps_ax, bub_ax, wall_ax, acc_ax, time_ax, rew_ax) = figlib.panels(3, 9.0)
    wall = "wall_s_no_compile" if all("wall_s_no_compile" in r for n in names for r in results[n]) else "wall_s"
    for ax, key, ylabel in (
        (tps_ax, "rollout_tokens_per_s", "rollout tokens / s\n(steady state)"),
        (bub_ax, "bubble_wall", "bubble ratio, Eq. 4\n(share of rollout wall time)"),
        (wall_ax, wall, "whole run's wall time (s)" + (",\ncompile excluded" if wall != "wall_s" else "")),
        (acc_ax, "dense_acc", "accuracy (avg@1,\ndense inference)"),
    ):
        marks = {
            n: VARIANTS[n][3]
            if key == "bubble_wall"
            else base_tps * (1 + VARIANTS[n][4])
            if key == "rollout_tokens_per_s" and base_tps and VARIANTS[n][4]
            else None
            for n in names
        }
        figlib.run_bars(
            ax,
            names,
            {n: [r[key] for r in results[n]] for n in names},
            colours,
            marks=marks,
            labels=[LABELS[n] for n in names],
            value_fmt=".2f" if key == "dense_acc" else None,
        )
        ax.set_ylabel(ylabel)
    acc_ax.set_ylim(0, 1.1)
    bub_ax.set_ylim(0, 1)
    bub_ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    for name in names:
        tokens, _ = figlib.spread([r["tokens_cum"] for r in results[name]])
        rewards = figlib.spread([_reward_by_group(h) for h in histories[name]])
        for ax, x, (m, s) in (
            (time_ax, tokens, figlib.spread([r["rollout_s_cum"] for r in results[name]])),
            (rew_ax, N_GROUP * np.arange(1, len(rewards[0]) + 1), rewards),
        ):
            figlib.mean_line(ax, x, m, s, colours[name], 0.0, 1.0 if ax is rew_ax else None, marker=".", ms=3, lw=1.2)
    handles = [Patch(color=colours[n], alpha=0.85, label=LABELS[n].replace("\n", " ")) for n in names]
    handles.append(Line2D([], [], ls="--", color="black", lw=1.5, label="paper"))
    top = max(r["tokens_cum"][-1] for rows in results.values() for r in rows)
    for name, gain in [(n, VARIANTS[n][4]) for n in ("sorted_on_policy", "sorted_partial")] if base_tps else ():
        handles += time_ax.plot(
            [0, top],
            [0, top / (base_tps * (1 + gain))],
            ":",
            lw=1.2,
            color=colours[name],
            label=f"paper, {LABELS[name]}: baseline rate +{gain:.1%}",
        )
    time_ax.set(
        xlabel="cumulative rollout tokens\n(update batches after the first group)", ylabel="cumulative rollout time (s)"
    )
    rew_ax.set(
        xlabel="update batches trained", ylabel=f"train reward (mean per rollout,\ngroups of n = {N_GROUP} batches)"
    )
    rew_ax.xaxis.set_major_locator(MultipleLocator(N_GROUP))
    fig.legend(handles=handles, loc="outside lower center", ncol=3, frameon=False)
    fig.suptitle(title)
    return fig


FIGURE = figlib.Figure(
    "fig_sortedrl",
    __doc__,
    run,
    render,
    seeds=(0, 1, 2),
    eval_prompts=False,
    default_config=LONG_TAIL_CONFIG,
    choices={"--variants": VARIANTS},
)
main = FIGURE.main

if __name__ == "__main__":
    main()
