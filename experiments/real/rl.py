"""RL on the real model: Sparse-RL, QuRL and SortedRL arms trained on SmolLM2-135M-Instruct on CPU.

  python -m sparserl_jax.fetch smollm2-135m-instruct --out checkpoints/smollm2-135m
  python experiments/real/rl.py                                # every arm (ARMS), resumable
  python experiments/real/rl.py --arms dense sparse_rl_rkv --seeds 0 1 train.iterations=4
  python experiments/real/rl.py --replot experiments/results/real/rl

Each arm is one training run of the base config (default experiments/configs/real/
smollm2_chat_arithmetic.yaml) with the arm's rl.mode, KV policy, quantization and scheduler; the
runs go to parallel single-core processes (experiments/lib/workers.py) into runs/real_rl/<config
hash>/, so a killed command resumes every unfinished run from its last checkpoint when re-run (the
trainer's exact resume; finished runs are reused). Then the final weights of every run, and the
untrained model at every seed, are evaluated (avg@1, sampled at the rollout temperature with the
seed train.seed + 1, so a run and the untrained model of its seed see the same prompts and draws)
with dense full-precision inference on
--eval-prompts held-out prompts (cached per run), and results.md / results.json / real_rl.png
are written: accuracy before and after, training reward per iteration (sampled on prompts never
seen before), mismatch KL, SARS rejection, ACR activity, KV saving, rollout tokens/s, bubble and
seconds per iteration per arm. Three comparisons share the `dense` arm (full precision, dense KV,
the batch scheduler): Sparse-RL (dense | naive R-KV | Sparse-RL R-KV), QuRL (full precision |
int8 W8A8 uncorrected | QuRL: ACR + invariant scaling) and SortedRL (batch | sorted partial);
`stacked` combines R-KV, int8 and the sorted scheduler.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence

import numpy as np
from matplotlib import pyplot as plt
from matplotlib.container import BarContainer
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from experiments.lib import figlib
from experiments.lib.figlib import fmt
from experiments.real.smoke import SMOKE_BATCH

CONFIG = os.path.join(figlib.HERE, "configs", "real", "smollm2_chat_arithmetic.yaml")
RUNS = os.path.join(figlib.REPO, "runs", "real_rl")

INT8 = ("quant.format=int8", "quant.mode=w8a8")
SORTED = ("rollout.scheduler=sorted", "sorted.mode=partial")


@dataclasses.dataclass(frozen=True)
class Arm:
    """One training run's settings on top of the base config; `seeds`: how many of --seeds."""

    mode: str
    policy: str
    extra: tuple[str, ...] = ()
    seeds: int = 2
    label: str = ""

    def seeds_of(self, seeds: Sequence[int]) -> list[int]:
        return list(seeds)[: self.seeds]

    def overrides(self, seed: int) -> list[str]:
        return [f"rl.mode={self.mode}", f"kv.policy={self.policy}", f"train.seed={seed}", *self.extra]


ARMS = {
    "dense": Arm("dense", "none", label="dense fp, batch scheduler"),
    "naive_rkv": Arm("naive_sparse", "rkv", label="R-KV, no correction"),
    "sparse_rl_rkv": Arm("sparse_rl", "rkv", label="R-KV + Sparse-RL"),
    "int8_naive": Arm("dense", "none", INT8, label="int8 W8A8, no correction"),
    "qurl": Arm("qurl", "none", INT8 + ("quant.invariant_scaling=true",), label="int8 + ACR + inv. scaling"),
    "sorted_partial": Arm("sparse_rl", "none", SORTED, seeds=1, label="SortedRL partial"),
    "stacked": Arm("sparse_rl", "rkv", SORTED + INT8, seeds=1, label="R-KV + int8 + SortedRL"),
}
# name -> (arms, the paper's figure / table it stands beside)
COMPARISONS = {
    "Sparse-RL": (("dense", "naive_rkv", "sparse_rl_rkv"), "Sparse-RL Table 1 / Fig. 3"),
    "QuRL": (("dense", "int8_naive", "qurl"), "QuRL Table 1"),
    "SortedRL": (("dense", "sorted_partial"), "SortedRL Fig. 6"),
    "stacked": (("dense", "stacked"), "-"),
}
# A seconds-long version on a tiny checkpoint (tests): with --smoke and model.checkpoint=<tiny>.
SMOKE = (
    "train.iterations=2",
    "train.save_every=1",
    *SMOKE_BATCH,
    "rollout.max_new_tokens=24",
    "kv.budget=64",
    "kv.buffer=8",
    "sorted.group_batches=2",
    "train.eval_prompts=2",
    "rl.update.compile_ahead=false",
)


def row(run: figlib.Run, n_eval: int) -> dict:
    """One run's numbers: dense full-precision accuracy of the final weights and its training-time
    statistics (iteration means unless named last25)."""
    h = run.history
    return {
        "dense_acc": run.evaluate({"policy": "none"}, n=n_eval)["accuracy"],
        "reward_first25": float(np.mean([x["reward/mean"] for x in h[: max(len(h) // 4, 1)]])),
        "acr_active": figlib.run_mean(h, "acr/active_frac"),
        "rollout_tokens_per_s": figlib.run_mean(h, "throughput/rollout_tokens_per_s"),
        "bubble": figlib.run_mean(h, "rollout/bubble_wall"),
        "seconds_per_iteration": figlib.seconds_per_iteration(h),  # the first compiles
        "iterations": len(h),
        **figlib.summarize(run),
    }


def run(args, study: figlib.Study) -> dict:
    """Every arm's runs and the untrained model at every seed, trained in parallel single-core
    workers, then scored here from the cache."""
    n_eval = args.eval_prompts or study.base.train.eval_prompts
    untrained = {s: (f"untrained/seed{s}", ARMS["dense"].overrides(s) + ["train.iterations=0"]) for s in args.seeds}
    # the two-seed comparisons first, seed-major; then the one-seed arms (sorted, stacked)
    runs = sorted([(-ARMS[n].seeds, i, n, s) for n in args.arms for i, s in enumerate(ARMS[n].seeds_of(args.seeds))])
    jobs = list(untrained.values()) + [(f"{n}/seed{s}", ARMS[n].overrides(s)) for _, _, n, s in runs]
    t0 = time.perf_counter()
    study.train_runs(jobs, [({"policy": "none"}, n_eval)], progress=True)  # each final model evaluated there
    wall = time.perf_counter() - t0
    before = {s: study.train(*job).evaluate({"policy": "none"}, n=n_eval)["accuracy"] for s, job in untrained.items()}
    results, histories = {}, {}
    for name in args.arms:
        seeds = ARMS[name].seeds_of(args.seeds)
        runs = [study.train(f"{name}/seed{s}", ARMS[name].overrides(s)) for s in seeds]
        results[name] = [{**row(r, n_eval), "seed": s, "untrained_acc": before[s]} for s, r in zip(seeds, runs)]
        histories[name] = [r.history for r in runs]
    meta = {
        "untrained_dense_acc": float(np.mean(list(before.values()))),
        "untrained_by_seed": before,
        "eval_prompts": n_eval,
        "train_wall_s": wall,
        "cores": len(study.cores),
    }
    return {"results": results, "histories": histories, "meta": meta}


def iteration_seconds(histories: dict) -> float:
    """Every logged iteration's seconds, summed over all runs (core-seconds: one core each)."""
    return sum(figlib.iteration_time(x) for hs in histories.values() for h in hs for x in h)


def diff_se_untrained(meta: dict) -> float:
    """The standard error of a difference of two evaluations at the untrained accuracy
    (figlib.diff_se): the tie rule's unit where a trained model meets the untrained one."""
    p, n = meta["untrained_dense_acc"], meta["eval_prompts"]
    return figlib.diff_se(p, n, p, n)


def paired(a: list[dict], b: list[dict], n: int) -> str:
    """a - b per seed (b's row of the same seed), each with 2 SE of that difference, and the tie
    rule's verdict over the seeds."""
    by_seed = {r["seed"]: r["dense_acc"] for r in b}
    pairs = [(r["dense_acc"], by_seed[r["seed"]]) for r in a if r["seed"] in by_seed]
    diffs, ses = [x - y for x, y in pairs], [figlib.diff_se(x, n, y, n) for x, y in pairs]
    verdict = {1: "ahead", -1: "behind", 0: "tie"}[figlib.tie_verdict(diffs, ses)]
    return ", ".join(f"{d:+.3f} (2 SE {2 * se:.3f})" for d, se in zip(diffs, ses)) + f": {verdict}"


COLUMNS = (  # (header, row key, format) of the arms' table, after its arm, seeds and iterations
    ("dense acc", "dense_acc", ".3f"),
    ("reward first25", "reward_first25", ".3f"),
    ("reward last25", "train_reward_last25", ".3f"),
    ("KV saving", "train_kv_saving", ".1%"),
    ("mismatch KL k3", "mismatch_kl_k3", ".2e"),
    ("SARS token reject (last25)", "token_reject_rate", ".1%"),
    ("ACR active", "acr_active", ".1%"),
    ("rollout tok/s", "rollout_tokens_per_s", ".1f"),
    ("bubble", "bubble", ".1%"),
    ("s / iteration", "seconds_per_iteration", ".0f"),
)


def tables(results: dict, meta: dict) -> str:
    lines = [
        "Untrained model: "
        + ", ".join(f"{a:.3f} (seed {s})" for s, a in meta["untrained_by_seed"].items())
        + " accuracy (avg@1 sampled at the rollout "
        "temperature, seed train.seed + 1; dense, full precision) "
        f"on {meta['eval_prompts']} held-out prompts. Differences are read by the tie rule "
        "(figlib.tie_verdict): a difference counts only beyond 2 SE of the difference of the two "
        "evaluations at every seed, SE = sqrt(p1 (1 - p1) / n + p2 (1 - p2) / n) (2 SE "
        f"{2 * diff_se_untrained(meta):.3f} for two evaluations at the untrained accuracy). Every row: "
        "mean ± sample std over its seeds; "
        "`dense acc` is the final weights' accuracy on the same prompts and samples' seed (dense "
        "full-precision inference); SARS rejects only under rl.mode sparse_rl; `reward` the training "
        "reward (sampled accuracy on prompts never seen before) "
        "over the first / last quarter of the iterations.",
        "",
        *figlib.md_table(
            ["arm", "seeds", "iterations", *figlib.headers(COLUMNS)],
            (
                [
                    f"{name} ({ARMS[name].label})",
                    str(len(rows)),
                    str(rows[0]["iterations"]),
                    *figlib.stat_cells(rows, COLUMNS),
                ]
                for name, rows in results.items()
            ),
        ),
    ]
    lines += [
        "",
        "Comparisons: dense accuracy change from the untrained model evaluated with the same "
        "seed (mean ± std over seeds); then each arm minus the first arm of the comparison, "
        "paired by seed (every seed's difference with 2 SE of that difference, and the tie rule's "
        "verdict over the seeds):",
        "",
    ]
    for title, (names, paper) in COMPARISONS.items():
        have = [n for n in names if n in results]
        if len(have) < 2:
            continue
        deltas = ", ".join(
            f"{n} {fmt([r['dense_acc'] - r['untrained_acc'] for r in results[n]], '+.3f')}" for n in have
        )
        pairs = "; ".join(
            f"{n} - {have[0]}: {paired(results[n], results[have[0]], meta['eval_prompts'])}" for n in have[1:]
        )
        lines.append(f"- **{title}** (beside {paper}): {deltas}; paired: {pairs}")
    return "\n".join(lines)


def render(data: dict, b, command: str) -> figlib.Rendered:
    results, histories, meta = data["results"], data["histories"], data["meta"]
    caption = (
        f"Each run: {b.rollout.prompts} prompts x {b.rollout.samples} samples per iteration at temperature "
        f"{b.rollout.temperature}, up to {b.rollout.max_new_tokens} new tokens, lr {b.rl.optim.lr}; R-KV "
        f"budget {b.kv.budget} + buffer {b.kv.buffer}; seconds per iteration: median over the iterations "
        f"after the first, on one core of this machine, {meta['cores']} runs in parallel "
        f"(the runs' iterations: {iteration_seconds(histories) / 3600:.1f} core-hours in all; this "
        f"command's wall time {meta['train_wall_s'] / 60:.0f} min, finished runs reused).\n\n"
        f"Figure: top left, each arm's held-out accuracy after training (avg@1 on {meta['eval_prompts']} "
        "prompts, dense full-precision inference): bars are the mean over the arm's seeds, error bars ± one "
        "sample standard deviation over its seeds (none for the arms marked '1 seed'), dots the seeds; "
        "hatched bars: arms run with one seed (no spread; not comparable to a two-seed mean); "
        "the grey line is the untrained model's accuracy (mean over seeds) and the grey band ± 2 SE of the "
        f"difference of two evaluations at that accuracy ({2 * diff_se_untrained(meta):.3f}: a trained model inside it "
        "ties the untrained one). Top "
        "right: the mismatch KL (k3) between the rollout policy and pi_old, mean over the run (its value "
        "beside each bar; the dense arm's is ~0). Below, one panel per comparison: the training "
        "reward (sampled accuracy on prompts never seen before) per iteration, lines the mean over seeds, "
        "shaded bands ± one sample standard deviation over the seeds (2 seeds: half their difference "
        "x sqrt 2); dashed lines without a band: arms run with one seed."
    )
    return figlib.Rendered(
        f"RL on {os.path.basename(b.model.checkpoint)}: {b.data.task}",
        tables(results, meta),
        {"real_rl": figure(data, b)},
        caption,
    )


def _label(name: str, results: dict) -> str:
    return ARMS[name].label + (" (1 seed)" if len(results[name]) == 1 else "")


def figure(data: dict, b):
    """Held-out accuracy and mismatch KL per arm, then the training reward, one panel per
    comparison (the dense arm in each), every arm in its own colour."""
    results, histories, meta = data["results"], data["histories"], data["meta"]
    names = list(results)
    colours = figlib.arm_colours(
        ARMS, {"naive_rkv": "naive_sparse", "sparse_rl_rkv": "sparse_rl", "qurl": "qurl_invariant"}
    )  # the palette of every figure
    comparisons = [(t, [n for n in arms if n in results], paper) for t, (arms, paper) in COMPARISONS.items()]
    comparisons = (
        [c for c in comparisons if set(c[1]) - {"dense"}]  # a panel where an arm beside dense ran
        or [("dense", ["dense"], "-")]
    )
    rows = 1 + -(-len(comparisons) // 2)
    fig = plt.figure(figsize=(2 * figlib.PANEL_W, 2.5 + 2.1 * (rows - 1) + 0.9), layout="constrained")
    grid = fig.add_gridspec(rows, 2, height_ratios=[1.25] + [1] * (rows - 1))
    acc_ax = fig.add_subplot(grid[0, 0])
    kl_ax = fig.add_subplot(grid[0, 1], sharey=acc_ax)
    figlib.run_bars(
        acc_ax,
        names,
        {n: [r["dense_acc"] for r in results[n]] for n in names},
        colours,
        horizontal=True,
        labels=[_label(n, results) for n in names],
    )
    bars = next(c for c in acc_ax.containers if isinstance(c, BarContainer))
    for bar, n in zip(bars, names):  # one-seed arms: hatched, no spread to show
        if len(results[n]) == 1:
            bar.set(hatch="////", edgecolor="white", linewidth=0)
    untrained, two_se = meta["untrained_dense_acc"], 2 * diff_se_untrained(meta)
    acc_ax.axvspan(max(untrained - two_se, 0.0), untrained + two_se, color="0.85", lw=0, zorder=0)
    acc_ax.axvline(untrained, color="0.45", lw=1.2, zorder=0.5)
    acc_ax.set_xlim(0, max(untrained + two_se, max(r["dense_acc"] for rs in results.values() for r in rs)) * 1.15)
    acc_ax.set_xlabel(f"held-out accuracy after training\n(avg@1, {meta['eval_prompts']} prompts, dense fp)")
    kl = {n: [r["mismatch_kl_k3"] for r in results[n]] for n in names}
    means, stds = figlib.run_bars(kl_ax, names, kl, colours, horizontal=True, floor=None, value_fmt=".2g")
    kl_ax.set_xlim(0, float(np.max(means + stds)) * 1.35)
    kl_ax.tick_params(labelleft=False)
    kl_ax.set_xlabel("mismatch KL k3 (rollout vs pi_old),\nnats per token, run mean")
    first = None  # the reward panels share their y axis
    for i, (title, arms, paper) in enumerate(comparisons):
        ax = fig.add_subplot(grid[1 + i // 2, i % 2], sharey=first)
        first = first or ax
        figlib.mean_curves(
            ax,
            {n: histories[n] for n in arms},
            colours,
            "reward/mean",
            0.0,
            1.0,
            lw=1.3,
            one_run_dashed=True,
            marker=".",
            ms=4,
        )
        ax.set_title(
            f"{title} (beside {paper})"
            if paper != "-"
            else "stacked: all three methods"
            if title == "stacked"
            else title
        )
        figlib.iteration_axis(ax)
        if i % 2 == 0:
            ax.set_ylabel("train reward\n(sampled accuracy, new prompts)")
    first.set_ylim(bottom=0.0)
    handles = [
        Line2D([], [], color=colours[n], ls="--" if len(results[n]) == 1 else "-", lw=1.3, label=_label(n, results))
        for n in names
    ]
    handles.append(Patch(color="0.85", label="untrained model ± 2 SE of a difference"))
    fig.legend(handles=handles, loc="outside lower center", ncol=2, frameon=False)
    seeds = sorted({r["seed"] for rs in results.values() for r in rs})
    fig.suptitle(
        f"Sparse-RL, QuRL and SortedRL arms on {os.path.basename(b.model.checkpoint)} ({b.data.task}):\n"
        f"{results[names[0]][0]['iterations']} iterations of {b.rollout.prompts}x{b.rollout.samples} "
        f"rollouts, seeds {seeds} (one-seed arms: the first)"
    )
    return fig


def arguments(p) -> None:
    p.add_argument(
        "--eval-prompts", type=int, help="held-out prompts of the final evaluations (default: train.eval_prompts)"
    )


FIGURE = figlib.Figure(
    "real/rl",
    __doc__,
    run,
    render,
    arguments=arguments,
    seeds=(0, 1),
    eval_prompts=False,
    choices={"--arms": ARMS},
    seeds_help="seeds of the two-seed arms; one-seed arms (sorted, stacked) take the first",
    default_config=CONFIG,
    runs_dir=RUNS,
    smoke=SMOKE,
)

main = FIGURE.main


if __name__ == "__main__":
    main()
