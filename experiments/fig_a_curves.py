"""Figure a: training curves of dense, naive sparse and Sparse-RL rollouts (paper claim: naive
sparse rollouts collapse; Sparse-RL stays stable and keeps most of the dense accuracy).

  python experiments/fig_a_curves.py                # 3 seeds x 3 arms on the default task
  python experiments/fig_a_curves.py --seeds 0 --smoke

Every arm starts from the same warm start with the same KV budget; seeds change the RL sampling
only. Curves are the mean over seeds with a one-standard-deviation band. "Collapse" is reported
as the first iteration at which the 5-iteration moving average of the training reward falls below
half of its value over the first 5 iterations (none if it never does).

diagnostics.png follows the rollouts themselves (sparserl_jax/rl/diagnostics.py): SARS token
rejection among responses with positive and negative advantage, the veto rate, the fraction of
responses caught in a repetition loop, response length and the sampler-vs-dense mismatch KL per
iteration (mean over seeds), and where in a response the rejected tokens sit at the last iteration.
"""

from __future__ import annotations

import numpy as np

import figlib
from figlib import fmt
from sparserl_jax.rl.diagnostics import N_BINS

ARMS = {  # arm -> (rl.mode, sparse rollouts?)
    "dense": ("dense", False),
    "naive_sparse": ("naive_sparse", True),
    "sparse_rl": ("sparse_rl", True),
}
CURVES = {
    "reward/mean": "train reward",
    "response/length_mean": "response length",
    "loss/entropy": "entropy",
    "mismatch/kl_k3": "mismatch KL (k3)",
    "sars/token_reject_rate": "token rejection rate",
}

DIAG_TABLE = {  # logged metric -> (column, format), last-quarter means
    "diag/reject_rate_pos_adv": ("reject A>0", ".3f"),
    "diag/reject_rate_neg_adv": ("reject A<0", ".3f"),
    "sars/veto_rate": ("veto rate", ".3f"),
    "diag/loop_fraction": ("loop fraction", ".3f"),
    "response/length_mean": ("response length", ".1f"),
    "mismatch/kl_k3": ("mismatch KL (k3)", ".4f"),
    "mismatch/kl_k1": ("mean log pi_sparse/pi_old", ".4f"),
}
DIAG_CURVES = {  # panel title -> [(logged metric, line style)]
    "SARS token rejection (solid A>0, dashed A<0)": [("diag/reject_rate_pos_adv", "-"),
                                                     ("diag/reject_rate_neg_adv", "--")],
    "sequence veto rate": [("sars/veto_rate", "-")],
    "responses in a repetition loop": [("diag/loop_fraction", "-")],
    "response length": [("response/length_mean", "-")],
    "mismatch KL(pi_sparse || pi_old), k3": [("mismatch/kl_k3", "-")],
}


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


def diagnostics_figure(histories: dict[str, list[list[dict]]]):
    """The diagnostics per iteration (mean over seeds, one colour per arm) and the relative
    position of rejected tokens at the final iteration."""
    fig, axes = figlib.plt.subplots(2, 3, figsize=(13, 6.4))
    axes = axes.ravel()
    colours = {arm: f"C{i}" for i, arm in enumerate(histories)}
    for ax, (title, keys) in zip(axes, DIAG_CURVES.items()):
        for arm, hs in histories.items():
            for key, style in keys:
                x, m, _ = figlib.curve(hs, key)
                ax.plot(x, m, style, color=colours[arm], label=arm if style == "-" else None)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("iteration")
    axes[0].legend(fontsize=7)
    ax, width = axes[-1], 0.8 / len(histories)
    centres = (np.arange(N_BINS) + 0.5) / N_BINS
    for i, (arm, hs) in enumerate(histories.items()):
        hist = np.mean([[h[-1].get(f"diag/reject_pos_{b}", np.nan) for b in range(N_BINS)]
                        for h in hs if h], axis=0)
        ax.bar(centres + (i - (len(histories) - 1) / 2) * width / N_BINS, hist,
               width=width / N_BINS, color=colours[arm], label=arm)
    ax.set_title("rejected tokens by position in the response (last iteration)", fontsize=9)
    ax.set_xlabel("relative position j / M")
    ax.set_ylabel("fraction of rejected tokens")
    return fig


def run_arms(study: figlib.Study, seeds, arms=ARMS) -> dict:
    """{arm: [Run per seed]} (cached runs, shared with the other figures)."""
    runs = {}
    specs = {arm: (mode, study.base.kv.policy if sparse else "none") for arm, (mode, sparse) in arms.items()}
    study.train_all([dict(name=f"{arm}/seed{s}", mode=mode, policy=policy, seed=s)
                     for arm, (mode, policy) in specs.items() for s in seeds])
    for arm, (mode, policy) in specs.items():
        runs[arm] = [study.arm(f"{arm}/seed{s}", mode=mode, policy=policy, seed=s) for s in seeds]
    return runs


def evaluate_run(run: figlib.Run, sparse_policy: str) -> dict:
    return {**figlib.scores(run, sparse_policy), "collapse_iteration": collapse_iteration(run.history)}


def main(argv=None) -> dict:
    p = figlib.parser(__doc__)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = p.parse_args(argv)
    study = figlib.study_from_args(args)
    out = args.out or figlib.default_out("fig_a_curves", args.config)
    policy = study.base.kv.policy
    runs = run_arms(study, args.seeds)
    warm = study.warm_start()
    warm_row = {"dense_acc": warm.evaluate({"policy": "none"})["accuracy"],
                "sparse_acc": warm.evaluate({"policy": policy})["accuracy"]}
    per_seed = {arm: [evaluate_run(r, policy) for r in rs] for arm, rs in runs.items()}
    # the warm start's own mismatch: the first rollout of the naive sparse arm samples from it
    warm_row["mismatch_kl_k3"] = float(np.mean([r.history[0]["mismatch/kl_k3"]
                                                for r in runs["naive_sparse"] if r.history]))

    kvc = study.base.kv
    lines = [
        f"Task {study.base.data.task}; rollouts {study.base.rollout.prompts}x"
        f"{study.base.rollout.samples} for {study.base.train.iterations} iterations; sparse arms use "
        f"{kvc.policy} with budget {kvc.budget} + buffer {kvc.buffer}; seeds {args.seeds} "
        f"(mean ± std over seeds). Accuracy is avg@1 on {study.base.train.eval_prompts} held-out "
        "prompts at the training temperature.",
        "",
        "| arm | acc. dense inference | acc. sparse inference | train reward (last 25%) | "
        "KV saving | mismatch KL (k3) | token reject | seq reject | entropy (last 25%) | "
        "collapse at iteration |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| warm start | {warm_row['dense_acc']:.3f} | {warm_row['sparse_acc']:.3f} | - | - | "
        f"{warm_row['mismatch_kl_k3']:.4f} (first rollout) | - | - | - | - |",
    ]
    for arm, rows in per_seed.items():
        col = lambda k: [r[k] for r in rows]  # noqa: E731
        collapses = [r["collapse_iteration"] for r in rows]
        lines.append(
            f"| {arm} | {fmt(col('dense_acc'))} | {fmt(col('sparse_acc'))} | "
            f"{fmt(col('train_reward_last25'))} | {fmt(col('train_kv_saving'), '.1%')} | "
            f"{fmt(col('mismatch_kl_k3'), '.4f')} | {fmt(col('token_reject_rate'))} | "
            f"{fmt(col('seq_reject_rate'))} | {fmt(col('entropy_last25'))} | "
            f"{', '.join('none' if c is None else str(c) for c in collapses)} |"
        )

    diag = {arm: [diagnostics_summary(r.history) for r in rs] for arm, rs in runs.items()}
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
    lines += ["", "![diagnostics](diagnostics.png)"]
    histories = {arm: [r.history for r in rs] for arm, rs in runs.items()}
    figlib.save_figure(out, diagnostics_figure(histories), "diagnostics")

    fig, axes = figlib.plt.subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3.2))
    for ax, (key, label) in zip(axes, CURVES.items()):
        for arm, rs in runs.items():
            x, m, s = figlib.curve([r.history for r in rs], key)
            ax.plot(x, m, label=arm)
            ax.fill_between(x, m - s, m + s, alpha=0.2)
        ax.set_title(label)
        ax.set_xlabel("iteration")
    axes[0].legend()
    data = {"warm_start": warm_row, "per_seed": per_seed, "seeds": args.seeds,
            "histories": histories, "diagnostics": diag}
    figlib.write_outputs(out, "Figure a: training curves", "\n".join(lines), data, fig, "curves", study)
    return data


if __name__ == "__main__":
    main()
