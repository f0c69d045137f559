"""Figure a: training curves of dense, naive sparse and Sparse-RL rollouts (paper claim: naive
sparse rollouts collapse; Sparse-RL stays stable and keeps most of the dense accuracy).

  python experiments/fig_a_curves.py                # 5 seeds x 3 arms on the default task
  python experiments/fig_a_curves.py --seeds 0 --smoke
  python experiments/fig_a_curves.py --replot experiments/results/fig_a_curves/walk_key
                                                    # re-render PNGs + results.md, no training

Every arm starts from the same warm start with the same KV budget; seeds change the RL sampling
only. Curves are the mean over seeds with a one-sample-standard-deviation band. Every arm
evaluates on the held-out prompts every --eval-every iterations during training (the held-out
accuracy panel); the final evaluations use --eval-prompts prompts (at least figlib.EVAL_PROMPTS).
"Collapse at iteration" is the first iteration at which the 5-iteration moving average of the
training reward falls below half of its value over the first 5 iterations (none if it never
does); "collapsed k of n": seeds whose final dense-inference accuracy ends below COLLAPSE x the warm
start's (as in experiments/default.py).

diagnostics.png follows the rollouts themselves (sparserl_jax/rl/diagnostics.py): SARS token
rejection among responses with positive and negative advantage, the veto rate, the fraction of
responses caught in a repetition loop, response length and the sampler-vs-dense mismatch KL per
iteration (mean over seeds), and where in a response the rejected tokens sit at the last iteration.
"""

from __future__ import annotations

import numpy as np
from matplotlib.ticker import MaxNLocator

import figlib
from figlib import fmt
from sparserl_jax.rl.diagnostics import N_BINS

ARMS = {  # arm -> (rl.mode, sparse rollouts?)
    "dense": ("dense", False),
    "naive_sparse": ("naive_sparse", True),
    "sparse_rl": ("sparse_rl", True),
}
# Every arm also evaluates on train.eval_prompts held-out prompts every EVAL_EVERY iterations (under
# its own rollout KV settings: the dense arm densely, the sparse arms sparsely) for the held-out
# accuracy panel; figure e evaluates the same runs.
EVAL_EVERY = 10
COLLAPSE = 0.5  # a seed collapsed: final dense-inference accuracy < COLLAPSE x the warm start's
#                 (as experiments/default.py)
CURVES = {  # logged metric -> (panel title, y label); the held-out accuracy panel comes second
    "reward/mean": ("train reward", "mean reward per rollout"),
    "response/length_mean": ("response length", "tokens (mean per rollout)"),
    "loss/entropy": ("policy entropy", "nats per token"),
    "mismatch/kl_k3": ("mismatch KL(pi_sampler || pi_old), k3", "nats per token"),
    "sars/token_reject_rate": ("tokens the update leaves out", "fraction of response tokens"),
}
EVAL_KEY = "eval/accuracy"  # logged every train.eval_every iterations

DIAG_TABLE = {  # logged metric -> (column, format), last-quarter means
    "diag/reject_rate_pos_adv": ("reject A>0", ".3f"),
    "diag/reject_rate_neg_adv": ("reject A<0", ".3f"),
    "sars/veto_rate": ("veto rate", ".3f"),
    "diag/loop_fraction": ("loop fraction", ".3f"),
    "response/length_mean": ("response length", ".1f"),
    "mismatch/kl_k3": ("mismatch KL (k3)", ".4f"),
    "mismatch/kl_k1": ("mean log pi_sparse/pi_old", ".4f"),
}
DIAG_UNITS = {  # panel title -> y label
    "SARS token rejection (solid A>0, dashed A<0)": "fraction of response tokens",
    "sequence veto rate": "fraction of responses",
    "responses in a repetition loop": "fraction of responses",
    "response length": "tokens",
    "mismatch KL(pi_sparse || pi_old), k3": "nats per token",
}
DIAG_CURVES = {  # panel title -> [(logged metric, line style)]
    "SARS token rejection (solid A>0, dashed A<0)": [("diag/reject_rate_pos_adv", "-"),
                                                     ("diag/reject_rate_neg_adv", "--")],
    "sequence veto rate": [("sars/veto_rate", "-")],
    "responses in a repetition loop": [("diag/loop_fraction", "-")],
    "response length": [("response/length_mean", "-")],
    "mismatch KL(pi_sparse || pi_old), k3": [("mismatch/kl_k3", "-")],
}


def arm_extra(smoke: bool = False, eval_every: int | None = None) -> list[str]:
    """The overrides every arm of figure a (and figure e, which evaluates them) trains with."""
    return [f"train.eval_every={eval_every or (1 if smoke else EVAL_EVERY)}"]


def collapsed(rows: list[dict], warm: dict) -> int:
    """Seeds whose final dense-inference accuracy ends below COLLAPSE x the warm start's."""
    return sum(r["dense_acc"] < COLLAPSE * warm["dense_acc"] for r in rows)


def collapse_iteration(history: list[dict], window: int = 5) -> int | None:
    r = np.array([h["reward/mean"] for h in history])
    if len(r) < 2 * window:
        return None
    smooth = np.convolve(r, np.ones(window) / window, mode="valid")
    below = np.nonzero(smooth < 0.5 * smooth[0])[0]
    return int(below[0]) + window if below.size else None


def diagnostics_summary(history: list[dict]) -> dict:
    """Last-quarter means of the rollout diagnostics (nan for runs logged before them)."""
    return {key: figlib.last_quarter(history, key, np.nan) for key in DIAG_TABLE}


def diagnostics_figure(histories: dict[str, list[list[dict]]], title: str):
    """The diagnostics per iteration (mean over seeds, one colour per arm) and the relative
    position of rejected tokens at the final iteration."""
    fig, axes = figlib.plt.subplots(2, 3, figsize=(3 * figlib.PANEL_W, 5.6), layout="constrained")
    axes = axes.ravel()
    colours = {arm: f"C{i}" for i, arm in enumerate(histories)}
    for ax, (title_, keys) in zip(axes, DIAG_CURVES.items()):
        for arm, hs in histories.items():
            for key, style in keys:
                x, m, _ = figlib.curve(hs, key)
                ax.plot(x, m, style, color=colours[arm], label=arm if style == "-" else None)
        ax.set_title(title_, fontsize=8)
        ax.set_xlabel("iteration")
        ax.set_ylabel(DIAG_UNITS[title_])
    ax, width = axes[-1], 0.8 / len(histories)
    centres = (np.arange(N_BINS) + 0.5) / N_BINS
    for i, (arm, hs) in enumerate(histories.items()):
        hist = np.mean([[h[-1].get(f"diag/reject_pos_{b}", np.nan) for b in range(N_BINS)]
                        for h in hs if h], axis=0)
        ax.bar(centres + (i - (len(histories) - 1) / 2) * width / N_BINS, hist,
               width=width / N_BINS, color=colours[arm], label=arm)
    ax.set_title("rejected tokens by position (last iteration)", fontsize=8)
    ax.set_xlabel("relative position in the response, j / M")
    ax.set_ylabel("fraction of rejected tokens")
    figlib.band_legend_below(fig, axes[0])
    for ax in axes[:-1]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title)
    return fig


def run_arms(study: figlib.Study, seeds, arms=ARMS, extra=()) -> dict:
    """{arm: [Run per seed]} (cached runs, shared with the other figures)."""
    runs = {}
    specs = {arm: (mode, study.base.kv.policy if sparse else "none") for arm, (mode, sparse) in arms.items()}
    study.train_all([dict(name=f"{arm}/seed{s}", mode=mode, policy=policy, seed=s, extra=list(extra))
                     for arm, (mode, policy) in specs.items() for s in seeds])
    for arm, (mode, policy) in specs.items():
        runs[arm] = [study.arm(f"{arm}/seed{s}", mode=mode, policy=policy, seed=s, extra=list(extra))
                     for s in seeds]
    return runs


def evaluate_run(run: figlib.Run, sparse_policy: str, n: int | None = None) -> dict:
    return {**figlib.scores(run, sparse_policy, n), "collapse_iteration": collapse_iteration(run.history)}


def main(argv=None) -> dict:
    p = figlib.parser(__doc__, replot=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--eval-every", type=int, help=f"held-out evaluation every this many iterations "
                   f"during training (default {EVAL_EVERY}; 1 with --smoke)")
    args = p.parse_args(argv)
    if args.replot:
        data, base = figlib.load_results(args.replot)
        render(data, base, args.replot, replot=True)
        return data
    study = figlib.study_from_args(args)
    out = args.out or figlib.default_out("fig_a_curves", args.config)
    policy = study.base.kv.policy
    n_eval = figlib.eval_prompts(args, study)
    extra = arm_extra(args.smoke, args.eval_every)
    runs = run_arms(study, args.seeds, extra=extra)
    warm = study.warm_start()
    warm_row = {"dense_acc": warm.evaluate({"policy": "none"}, n=n_eval)["accuracy"],
                "sparse_acc": warm.evaluate({"policy": policy}, n=n_eval)["accuracy"]}
    per_seed = {arm: [evaluate_run(r, policy, n_eval) for r in rs] for arm, rs in runs.items()}
    # the warm start's own mismatch: the first rollout of the naive sparse arm samples from it
    warm_row["mismatch_kl_k3"] = float(np.mean([r.history[0]["mismatch/kl_k3"]
                                                for r in runs["naive_sparse"] if r.history]))
    diag = {arm: [diagnostics_summary(r.history) for r in rs] for arm, rs in runs.items()}
    histories = {arm: [r.history for r in rs] for arm, rs in runs.items()}
    data = {"warm_start": warm_row, "per_seed": per_seed, "seeds": args.seeds,
            "histories": histories, "diagnostics": diag, "eval_prompts": n_eval,
            "arm_overrides": extra}
    render(data, study.base, out, study=study)
    return data


def render(data: dict, base, out: str, study=None, replot: bool = False) -> None:
    """results.md, curves.png and (with diagnostics) diagnostics.png of `data` (a fresh run's, or
    a committed results.json's)."""
    warm_row, per_seed, seeds, histories = (data["warm_start"], data["per_seed"], data["seeds"],
                                            data["histories"])
    n_eval = data.get("eval_prompts", base.train.eval_prompts)
    command = data["command"] if replot else figlib.command_line()
    kvc = base.kv
    warm_kl = (f"{warm_row['mismatch_kl_k3']:.4f} (first rollout)" if "mismatch_kl_k3" in warm_row
               else "-")
    lines = [
        f"Task {base.data.task}; rollouts {base.rollout.prompts}x"
        f"{base.rollout.samples} for {base.train.iterations} iterations; sparse arms use "
        f"{kvc.policy} with budget {kvc.budget} + buffer {kvc.buffer}; seeds {seeds} "
        f"(mean ± std over seeds). Accuracy is avg@1 on {n_eval} held-out "
        "prompts at the training temperature.",
        "",
        "| arm | acc. dense inference | acc. sparse inference | train reward (last 25%) | "
        "KV saving | mismatch KL (k3) | token reject | seq reject | entropy (last 25%) | "
        "collapse at iteration | collapsed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| warm start | {warm_row['dense_acc']:.3f} | {warm_row['sparse_acc']:.3f} | - | - | "
        f"{warm_kl} | - | - | - | - | - |",
    ]
    for arm, rows in per_seed.items():
        col = lambda k: [r[k] for r in rows]  # noqa: E731
        collapses = [r["collapse_iteration"] for r in rows]
        lines.append(
            f"| {arm} | {fmt(col('dense_acc'))} | {fmt(col('sparse_acc'))} | "
            f"{fmt(col('train_reward_last25'))} | {fmt(col('train_kv_saving'), '.1%')} | "
            f"{fmt(col('mismatch_kl_k3'), '.4f')} | {fmt(col('token_reject_rate'))} | "
            f"{fmt(col('seq_reject_rate'))} | {fmt(col('entropy_last25'))} | "
            f"{', '.join('none' if c is None else str(c) for c in collapses)} | "
            f"{collapsed(rows, warm_row)} of {len(rows)} |"
        )
    lines += [
        "",
        f"Collapsed: seeds whose final dense-inference accuracy ends below {COLLAPSE:.0%} of the "
        "warm start's (as in experiments/default.py). Collapse at iteration: the first iteration "
        "at which the 5-iteration moving average of the train reward falls below half its first "
        "value (none if it never does).",
    ]
    what = "Figure a: dense vs naive sparse vs Sparse-RL rollouts (KV settings of the sparse arms)"
    title = figlib.run_title(base, command, seeds, what)
    if "diagnostics" in data:
        diag = data["diagnostics"]
        lines += [
            "",
            "Rollout diagnostics (last 25% of iterations; rejection counts every response token the "
            "update leaves out, SARS and IBR-mask alike):",
            "",
            "| arm | " + " | ".join(col for col, _ in DIAG_TABLE.values()) + " |",
            "|---|" + "---|" * len(DIAG_TABLE),
        ]
        for arm, rows in diag.items():
            lines.append(f"| {arm} | " + " | ".join(fmt([r[k] for r in rows], spec)
                                                    for k, (_, spec) in DIAG_TABLE.items()) + " |")
        lines += ["", "![diagnostics](diagnostics.png)", "",
                  "Diagnostics figure: each rollout diagnostic per iteration, mean over seeds (no "
                  "bands, for legibility), and where in a response the tokens rejected at the last "
                  "iteration sit (mean over seeds)."]
        figlib.save_figure(out, diagnostics_figure(histories, title), "diagnostics")

    fig, has_eval = curves_figure(histories, warm_row, per_seed, base, n_eval, title)
    periodic = (f"the solid lines with dots are the periodic held-out accuracy logged during training "
                f"(avg@1 on {base.train.eval_prompts} prompts every train.eval_every iterations, "
                "under the arm's own rollout KV settings: dense for the dense arm, sparse for the "
                "sparse arms); " if has_eval else
                "these runs logged no periodic held-out accuracy (train.eval_every was 0); ")
    caption = (
        "Figure: per-iteration training metrics of each arm. Held-out accuracy panel: "
        f"{periodic}the star at iteration 0 is the warm start and the markers at the last "
        f"iteration are the final weights, both under dense inference (avg@1 on {n_eval} prompts). "
        f"{figlib.BAND_CAPTION} Seeds {seeds}.")
    figlib.write_outputs(out, "Figure a: training curves", "\n".join(lines), data, fig, "curves",
                         study, caption=caption, replot=replot)


def curves_figure(histories, warm_row, per_seed, base, n_eval, title):
    """Train reward, held-out accuracy and the other CURVES per iteration, mean ± std over seeds;
    one legend below the panels. Returns the figure and whether periodic evaluations were logged."""
    from matplotlib.lines import Line2D

    fig, axes = figlib.plt.subplots(2, 3, figsize=(3 * figlib.PANEL_W, 5.6), layout="constrained")
    axes = axes.ravel()
    panels = [("reward/mean", axes[0])] + list(zip(list(CURVES)[1:], axes[2:]))
    colours = {arm: f"C{i}" for i, arm in enumerate(histories)}
    for key, ax in panels:
        for arm, hs in histories.items():
            x, m, s = figlib.curve(hs, key)
            ax.plot(x, m, color=colours[arm], lw=1.2)
            ax.fill_between(x, m - s, m + s, color=colours[arm], alpha=0.2, lw=0)
        ax.set_title(CURVES[key][0], fontsize=9)
        ax.set_ylabel(CURVES[key][1])
        ax.set_xlabel("iteration")
        if key == "mismatch/kl_k3":  # spikes of ~10 next to drifts of ~1e-2: log above 1e-3
            ax.set_yscale("symlog", linthresh=1e-3, linscale=0.5)
    ax = axes[1]
    has_eval = False
    last = max(len(h) for hs in histories.values() for h in hs)
    for i, (arm, hs) in enumerate(histories.items()):
        x, m, s = figlib.sparse_curve(hs, EVAL_KEY)
        if len(x):
            has_eval = True
            ax.plot(x, m, "-o", ms=3, color=colours[arm], lw=1.2)
            ax.fill_between(x, m - s, m + s, color=colours[arm], alpha=0.2, lw=0)
        fm, fs = figlib.mean_std(r["dense_acc"] for r in per_seed[arm])
        ax.errorbar(last + max(last, 4) * 0.025 * (i + 1), fm, yerr=fs, fmt="D", ms=4, color=colours[arm], capsize=2)
    ax.plot(0, warm_row["dense_acc"], "*", ms=9, color="k")
    ax.set_ylim(0, 1.02)
    ax.set_title("held-out accuracy", fontsize=9)
    ax.set_ylabel("accuracy (avg@1)")
    ax.set_xlabel("iteration")
    handles = [Line2D([], [], color=colours[a], lw=1.5, label=a) for a in histories]
    handles += [Line2D([], [], color="k", marker="*", ms=8, ls="", label="warm start (dense inf.)"),
                Line2D([], [], color="0.3", marker="D", ms=4, ls="",
                       label=f"final, dense inf. ({n_eval} prompts)")]
    if has_eval:
        handles.append(Line2D([], [], color="0.3", marker="o", ms=3, label="during training"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title)
    return fig, has_eval


if __name__ == "__main__":
    main()
