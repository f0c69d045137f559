"""Figure a: training curves of dense, naive sparse and Sparse-RL rollouts (paper claim: naive
sparse rollouts collapse; Sparse-RL stays stable and keeps most of the dense accuracy).

  python experiments/figures/fig_a_curves.py                # 5 seeds x 3 arms on the default task
  python experiments/figures/fig_a_curves.py --config experiments/configs/walk_key_rkv.yaml --warm-starts 0 1 2 --seeds 0 1
  python experiments/figures/fig_a_curves.py --seeds 0 --smoke
  python experiments/figures/fig_a_curves.py --replot experiments/results/fig_a_curves/walk_key
                                                    # re-render PNGs + results.md, no training

Every arm of a warm start (SFT seed, --warm-starts, default 0) starts from it with the same KV
budget; RL seeds (--seeds) change the RL sampling only, and every warm start gets every seed.
Every arm evaluates on the held-out prompts every --eval-every iterations during training (the
held-out accuracy panel); the final evaluations use --eval-prompts prompts (at least
figlib.EVAL_PROMPTS). Both collapse rules (figlib.collapsed, figlib.reward_collapse_iteration) are
applied to every arm, and arms are compared pairwise by the tie rule (figlib.tie_verdict), per warm
start and pooled.

diagnostics.png follows the rollouts themselves (sparserl_jax/rl/diagnostics.py): SARS token
rejection among responses with positive and negative advantage, the veto rate, the fraction of
responses caught in a repetition loop, response length and the sampler-vs-dense mismatch KL per
iteration, and where in a response the rejected tokens sit at the last iteration.
"""

from __future__ import annotations

import numpy as np
from matplotlib.lines import Line2D

from experiments.lib import figlib
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
EVAL_KEY = "eval/accuracy"  # logged every train.eval_every iterations
CURVES = {  # logged metric -> (panel title, y label, floor, ceiling)
    "reward/mean": ("train reward", "mean reward per rollout", 0.0, 1.0),
    "mismatch/kl_k3": ("mismatch KL(pi_sampler || pi_old), k3", "nats per token (symlog)", 0.0, None),
    "sars/token_reject_rate": ("tokens the update leaves out", "fraction of response tokens", 0.0, 1.0),
    "response/length_mean": ("response length", "tokens (mean per rollout)", 0.0, None),
}
ARM_COLUMNS = (  # (header, row key, format) of the arms' table
    ("acc. dense inference", "dense_acc", ".3f"),
    ("acc. sparse inference", "sparse_acc", ".3f"),
    ("train reward (last 25%)", "train_reward_last25", ".3f"),
    ("KV saving (train)", "train_kv_saving", ".1%"),
    ("mismatch KL (k3)", "mismatch_kl_k3", ".4f"),
    ("token reject (last 25%)", "token_reject_rate", ".3f"),
    ("seq reject (last 25%)", "seq_reject_rate", ".3f"),
    ("entropy (last 25%)", "entropy_last25", ".3f"),
)
DIAG_COLUMNS = (  # (header, logged metric, format) of the diagnostics table, last-quarter means
    ("reject A>0", "diag/reject_rate_pos_adv", ".3f"),
    ("reject A<0", "diag/reject_rate_neg_adv", ".3f"),
    ("veto rate", "sars/veto_rate", ".3f"),
    ("loop fraction", "diag/loop_fraction", ".3f"),
    ("response length", "response/length_mean", ".1f"),
    ("mismatch KL (k3)", "mismatch/kl_k3", ".4f"),
    ("mean log pi_sparse/pi_old", "mismatch/kl_k1", ".4f"),
)
DIAG_CURVES = {  # panel title -> ([(logged metric, line style)], y label)
    "SARS token rejection (solid A>0, dashed A<0)": (
        [("diag/reject_rate_pos_adv", "-"), ("diag/reject_rate_neg_adv", "--")],
        "fraction of response tokens",
    ),
    "sequence veto rate": ([("sars/veto_rate", "-")], "fraction of responses"),
    "responses in a repetition loop": ([("diag/loop_fraction", "-")], "fraction of responses"),
    "response length": ([("response/length_mean", "-")], "tokens"),
    "mismatch KL(pi_sparse || pi_old), k3": ([("mismatch/kl_k3", "-")], "nats per token (symlog)"),
}
MARKERS = "osD^v<>p"  # one per warm start
LABELS = {"dense": "dense", "naive_sparse": "naive sparse", "sparse_rl": "Sparse-RL"}


def arm_extra(smoke: bool = False, eval_every: int | None = None) -> list[str]:
    """The overrides every arm of figure a (and figure e, which evaluates them) trains with."""
    return [f"train.eval_every={eval_every or (1 if smoke else EVAL_EVERY)}"]


def collect(study: figlib.Study, seeds, warms, n_eval: int, extra=()) -> dict:
    """Train (or reuse) every arm x warm start x seed and evaluate them: figure a's numbers (the
    default experiment's too)."""
    policy = study.base.kv.policy
    evals = [({"policy": "none"}, n_eval), ({"policy": policy}, n_eval)]
    results, histories = figlib.run_variants(
        study,
        list(ARMS),
        seeds,
        lambda arm: (ARMS[arm][0], policy if ARMS[arm][1] else "none", extra),
        lambda run: figlib.scores(run, policy, n_eval),
        evals,
        warms,
    )
    warm = figlib.warm_rows(study, warms, n_eval, policy)
    for w in warms:  # the warm start's own mismatch: the naive sparse arm's first rollout samples from it
        first = [
            h[0]["mismatch/kl_k3"]
            for h, r in zip(histories["naive_sparse"], results["naive_sparse"])
            if h and r["warm_start"] == w
        ]
        warm[w]["mismatch_kl_k3"] = float(np.mean(first)) if first else float("nan")
    diag = {
        arm: [{key: figlib.last_quarter(h, key, np.nan) for _, key, _ in DIAG_COLUMNS} for h in hs]
        for arm, hs in histories.items()
    }
    return {
        "warm_starts": {str(w): row for w, row in warm.items()},
        "seeds": list(seeds),
        "per_seed": results,
        "histories": histories,
        "diagnostics": diag,
        "eval_prompts": n_eval,
        "arm_overrides": list(extra),
    }


def run(args, study) -> dict:
    return collect(
        study,
        args.seeds,
        figlib.warms_of(args),
        figlib.eval_prompts(args, study),
        arm_extra(args.smoke, args.eval_every),
    )


def arguments(p) -> None:
    p.add_argument(
        "--eval-every",
        type=int,
        help=f"held-out evaluation every this many iterations during training (default {EVAL_EVERY}; 1 with --smoke)",
    )


# ----------------------------------------------------------------------------- tables


def arm_table(per_seed: dict, warms: dict) -> list[str]:
    """One row per warm start and per arm (mean ± std over runs), with both collapse rules."""
    body = []
    for w, row in sorted(warms.items()):  # a warm start: its accuracies and its first rollout's mismatch
        sparse = f"{row['sparse_acc']:.3f}" if "sparse_acc" in row else "-"
        kl = f"{row['mismatch_kl_k3']:.4f} (first rollout)" if "mismatch_kl_k3" in row else "-"
        body.append([f"warm start {w}", f"{row['dense_acc']:.3f}", sparse, "-", "-", kl, *["-"] * 5])
    body += [[arm, *figlib.arm_cells(rows, ARM_COLUMNS, warms)] for arm, rows in per_seed.items()]
    return figlib.md_table(
        ["model", *figlib.headers(ARM_COLUMNS), "collapsed (accuracy rule)", "collapsed (reward rule, at iteration)"],
        body,
    )


def comparisons(per_seed: dict, n_eval: int) -> list[str]:
    """The tie rule's verdicts: Sparse-RL vs naive sparse (dense and sparse inference), Sparse-RL
    and naive sparse vs dense (dense inference); Sparse-RL's accuracy as a fraction of dense's."""
    cs = figlib.compare_arms(
        per_seed, [("sparse_rl", "naive_sparse")], figlib.ACC_METRICS, n_eval
    ) + figlib.compare_arms(
        per_seed, [("sparse_rl", "dense"), ("naive_sparse", "dense")], {"dense_acc": "dense inference"}, n_eval
    )
    lines = figlib.comparison_lines(
        cs, f"Paired differences (same warm start and seed; {n_eval} prompts per evaluation):"
    )
    if "sparse_rl" in per_seed and "dense" in per_seed:
        srl, dense = ([r["dense_acc"] for r in per_seed[arm]] for arm in ("sparse_rl", "dense"))
        lines += [
            "",
            f"Sparse-RL's dense-inference accuracy as a fraction of the dense arm's: per run "
            f"{', '.join(f'{a / max(b, 1e-9):.2f}' for a, b in zip(srl, dense))}; ratio of the means "
            f"{figlib.ratio_of_means(srl, dense):.0%}.",
        ]
    return lines


def claims(data: dict, n_eval: int) -> list[tuple[str, int, int, dict]]:
    """The papers' claims read at every run of one result: (claim, runs where it holds, runs, the
    other outcomes' counts by name). Collapse by the accuracy rule first, the reward rule beside it;
    comparisons by the tie rule at each run pair (figlib.Comparison.counts), and Sparse-RL vs dense
    also per warm start (the tie rule over its seeds)."""
    warms, per_seed = figlib.results_of(data, "per_seed")
    n = len(per_seed["naive_sparse"])

    def by_accuracy(arm: str) -> int:
        rows = per_seed[arm]
        return sum(figlib.collapsed(r["dense_acc"], w) for r, w in zip(rows, figlib.warm_dense_of(rows, warms)))

    def by_reward(arm: str) -> int:
        return sum(r["collapse_iteration"] is not None for r in per_seed[arm])

    def compared(a: str, b: str, key: str) -> list[figlib.Comparison]:
        return figlib.compare(a, per_seed[a], b, per_seed[b], key, n_eval)

    (ahead, tie, behind), (s_ahead, s_tie, s_behind) = (
        compared("sparse_rl", "naive_sparse", k)[-1].counts() for k in ("dense_acc", "sparse_acc")
    )
    vs_dense = compared("sparse_rl", "dense", "dense_acc")
    d_ahead, d_tie, d_behind = vs_dense[-1].counts()
    per_warm = [c.sign for c in vs_dense[:-1]] or [vs_dense[-1].sign]
    n_ahead, n_tie, n_behind = compared("naive_sparse", "dense", "dense_acc")[-1].counts()
    return [
        ("naive sparse collapses (accuracy rule)", by_accuracy("naive_sparse"), n, {}),
        ("naive sparse collapses (reward rule, beside it)", by_reward("naive_sparse"), n, {}),
        (
            "naive sparse behind dense, dense inference (tie rule at each run)",
            n_behind,
            n,
            {"tie": n_tie, "ahead": n_ahead},
        ),
        ("Sparse-RL does not collapse (accuracy rule)", n - by_accuracy("sparse_rl"), n, {}),
        ("Sparse-RL does not collapse (reward rule, beside it)", n - by_reward("sparse_rl"), n, {}),
        (
            "Sparse-RL ahead of naive sparse, dense inference (tie rule at each run)",
            ahead,
            n,
            {"tie": tie, "behind": behind},
        ),
        ("Sparse-RL not behind naive sparse, dense inference (tie rule at each run)", n - behind, n, {}),
        (
            "Sparse-RL ahead of naive sparse, sparse inference (tie rule at each run)",
            s_ahead,
            n,
            {"tie": s_tie, "behind": s_behind},
        ),
        (
            "Sparse-RL level with dense, dense inference (a tie at each run)",
            d_tie,
            n,
            {"behind": d_behind, "ahead": d_ahead},
        ),
        (
            "Sparse-RL level with dense at each warm start (the tie rule over its seeds)",
            per_warm.count(0),
            len(per_warm),
            {"behind": per_warm.count(-1), "ahead": per_warm.count(1)},
        ),
    ]


def machine_of(data: dict) -> str:
    """A result's machine as its provenance names it (CPU model, family and model)."""
    return data.get("provenance", {}).get("cpu", "machine not recorded").replace(", AVX-512)", ")")


def verdicts_table(data: dict, n_eval: int, folder: str = "replicates") -> list[str]:
    """The claims on this result's machine, on every replicate beside it (data["replicates"]:
    {name: results.json of the same command on another machine, in <folder>/<name>.json}), and
    pooled over all of them: counts of runs, a verdict word only where every run on every machine
    agrees (figlib.verdict_phrase)."""
    results = {
        f"this result: {machine_of(data)}": data,
        **{f"{name}.json: {machine_of(d)}": d for name, d in data.get("replicates", {}).items()},
    }
    read = [claims(d, d.get("eval_prompts", n_eval)) for d in results.values()]
    body = []
    for i, (claim, _, _, names) in enumerate(read[0]):
        k, n = sum(r[i][1] for r in read), sum(r[i][2] for r in read)
        pooled = {name: sum(r[i][3][name] for r in read) for name in names}
        body.append([claim, *(figlib.claim_cell(*r[i][1:]) for r in read), figlib.claim_cell(k, n, pooled)])
    arms = [d["per_seed"] for d in results.values()]
    acc = [([r["dense_acc"] for r in a["sparse_rl"]], [r["dense_acc"] for r in a["dense"]]) for a in arms]
    body.append(
        [
            "Sparse-RL's dense-inference accuracy / dense's (ratio of the means)",
            *(f"{figlib.ratio_of_means(*a):.0%}" for a in acc),
            f"{figlib.ratio_of_means(sum((a[0] for a in acc), []), sum((a[1] for a in acc), [])):.0%}",
        ]
    )
    warm = [
        " / ".join(f"{w['sparse_acc']:.3f}" for _, w in sorted(figlib.warm_starts_of(d).items()))
        for d in results.values()
    ]
    body.append(["warm starts' sparse-inference accuracy (SFT seeds in order)", *warm, "-"])
    header = ["claim (rule)", *results, f"pooled over {len(results)} machines"]
    if len(results) == 1:  # one machine: its column is the pooled one
        header, body = header[:-1], [cells[:-1] for cells in body]
        where = "this machine (runs where the claim holds)"
    else:
        where = (
            "each machine and pooled over every replicate (runs where the claim holds; the same "
            "command, unchanged, on each machine)"
        )
    lines = ["", f"Verdicts on {where}:", "", *figlib.md_table(header, body), "", figlib.VERDICT_NOTE]
    for name, d in data.get("replicates", {}).items():
        shown = {**d, "provenance": {**d["provenance"], "arms_json": False}}  # its arms.json is not committed
        lines += [
            "",
            f"Replicate [{folder}/{name}.json]({folder}/{name}.json): `{d['command']}`. "
            + figlib.provenance_line(shown),
        ]
    return lines


def diagnostics_table(diag: dict) -> list[str]:
    return [
        "",
        "Rollout diagnostics (last 25% of iterations; rejection counts every response token the "
        "update leaves out, SARS and IBR-mask alike):",
        "",
        *figlib.md_table(
            ["arm", *figlib.headers(DIAG_COLUMNS)],
            ([arm, *figlib.stat_cells(rows, DIAG_COLUMNS)] for arm, rows in diag.items()),
        ),
    ]


# ----------------------------------------------------------------------------- figures


def final_accuracy_panel(ax, per_seed: dict, warms: dict, colours: dict, n_eval: int) -> None:
    """Every run's final accuracy (dots, marker = warm start; filled: dense inference, open: sparse
    inference) and the mean over runs (bar), beside the warm start's and the collapse threshold."""
    for i, (arm, rows) in enumerate(per_seed.items()):
        for dx, key, filled in ((-0.18, "dense_acc", True), (0.18, "sparse_acc", False)):
            vals = np.array([r[key] for r in rows])
            jitter = np.linspace(-0.07, 0.07, len(vals)) if len(vals) > 1 else np.zeros(1)
            for v, j, r in zip(vals, jitter, rows):
                m = MARKERS[sorted(warms).index(r.get("warm_start", 0)) % len(MARKERS)] if warms else "o"
                ax.plot(i + dx + j, v, m, ms=3.5, color=colours[arm], mfc=colours[arm] if filled else "white", mew=0.8)
            ax.plot([i + dx - 0.12, i + dx + 0.12], [vals.mean()] * 2, color="k", lw=1.5)
    if warms:
        dense = np.mean([w["dense_acc"] for w in warms.values()])
        ax.axhline(dense, color="0.4", lw=0.8, ls="-")
        ax.axhline(figlib.COLLAPSE_FRACTION * dense, color="0.4", lw=0.8, ls="--")
        if all("sparse_acc" in w for w in warms.values()):
            ax.axhline(np.mean([w["sparse_acc"] for w in warms.values()]), color="0.4", lw=0.8, ls=":")
    ax.set_xticks(range(len(per_seed)), [LABELS.get(a, a) for a in per_seed])
    ax.set(
        xlim=(-0.6, len(per_seed) - 0.4),
        ylim=(-0.02, 1.02),
        ylabel="accuracy (avg@1)",
        title=f"final accuracy, every run ({n_eval} prompts)",
    )


def _metric_panel(ax, histories: dict, colours: dict, key: str, title: str, ylabel: str, floor, ceil) -> None:
    """One logged metric per iteration: mean over runs, ± one std band clipped to [floor, ceil]."""
    figlib.mean_curves(ax, histories, colours, key, floor, ceil)
    ax.set(title=title, ylabel=ylabel)
    figlib.iteration_axis(ax)
    if key == "mismatch/kl_k3":  # spikes of ~10 next to drifts of ~1e-2: log above 1e-3, floor 0
        ax.set_yscale("symlog", linthresh=1e-3, linscale=0.5)
        ax.set_ylim(bottom=0)
    elif ceil is not None:
        ax.set_ylim(-0.02, ceil + 0.02)
    else:
        ax.set_ylim(bottom=0)


def _held_out_panel(ax, histories: dict, colours: dict, warms: dict, per_seed: dict, dense_eval: bool) -> None:
    """Held-out accuracy logged during training (under each arm's own rollout KV, or dense
    inference with train.eval_kv=dense), the warm start (stars) and the final weights under the
    same inference (diamonds)."""
    last = max(len(h) for hs in histories.values() for h in hs)
    for i, (arm, hs) in enumerate(histories.items()):
        sparse = ARMS.get(arm, ("", False))[1] and not dense_eval  # evaluated under sparse inference
        x, m, s = figlib.sparse_curve(hs, EVAL_KEY)
        figlib.mean_line(
            ax,
            x,
            m,
            s,
            colours[arm],
            0.0,
            1.0,
            "--o" if sparse else "-o",
            ms=3,
            lw=1.2,
            mfc="white" if sparse else colours[arm],
        )
        key = "sparse_acc" if sparse else "dense_acc"
        fm, fs = figlib.mean_std(r[key] for r in per_seed[arm])
        ax.errorbar(
            last + max(last, 4) * 0.03 * (i + 1),
            fm,
            yerr=figlib.clipped_err([fm], [fs], 0.0, 1.0),
            fmt="D",
            ms=4,
            color=colours[arm],
            mfc="white" if sparse else colours[arm],
            capsize=2,
        )
    if warms:
        ax.plot(0, np.mean([w["dense_acc"] for w in warms.values()]), "*", ms=9, color="k")
        if all("sparse_acc" in w for w in warms.values()):
            ax.plot(0, np.mean([w["sparse_acc"] for w in warms.values()]), "*", ms=9, color="k", mfc="white")
    ax.set(
        ylim=(-0.02, 1.02),
        ylabel="accuracy (avg@1)",
        title="held-out accuracy, dense inference"
        if dense_eval
        else "held-out accuracy (solid: dense inference,\ndense arm; dashed: sparse inference, sparse arms)",
    )
    figlib.iteration_axis(ax)


def curves_figure(histories: dict, warms: dict, per_seed: dict, base, n_eval: int, title: str):
    """Six panels, two a row: train reward, held-out accuracy during training (policy entropy for
    runs that logged none), every run's final accuracy, mismatch KL, tokens left out, response
    length. Returns the figure and whether held-out accuracy was logged during training."""
    fig, axes = figlib.panels(3, 7.8)
    colours = figlib.arm_colours(histories)
    for key, ax in zip(CURVES, (axes[0], axes[3], axes[4], axes[5])):
        _metric_panel(ax, histories, colours, key, *CURVES[key])
    has_eval = all(len(figlib.sparse_curve(hs, EVAL_KEY)[0]) for hs in histories.values())
    if has_eval:
        _held_out_panel(axes[1], histories, colours, warms, per_seed, dense_eval(base))
    else:
        _metric_panel(axes[1], histories, colours, "loss/entropy", "policy entropy", "nats per token", 0.0, None)
    final_accuracy_panel(axes[2], per_seed, warms, colours, n_eval)
    handles = [Line2D([], [], color=colours[a], lw=1.5, label=LABELS.get(a, a)) for a in histories]
    if has_eval:
        handles += [
            Line2D([], [], color="k", marker="*", ms=8, ls="", label="warm start, dense inf."),
            Line2D([], [], color="k", marker="*", ms=8, ls="", mfc="white", label="warm start, sparse inf."),
            Line2D([], [], color="0.3", marker="D", ms=4, ls="", label=f"final, mean ({n_eval} prompts)"),
            Line2D(
                [],
                [],
                color="0.3",
                marker="o",
                ms=3,
                label=f"during training, dense inf. ({base.train.eval_prompts} prompts)",
            ),
        ]
        if not dense_eval(base):
            handles.append(
                Line2D(
                    [], [], color="0.3", marker="o", ms=3, ls="--", mfc="white", label="during training, sparse inf."
                )
            )
    handles += [
        Line2D([], [], color="0.3", marker="o", ms=4, ls="", label="final, a run, dense inf."),
        Line2D([], [], color="0.3", marker="o", ms=4, ls="", mfc="white", label="final, a run, sparse inf."),
        Line2D([], [], color="0.4", ls="-", lw=0.8, label="warm start's level, dense inf."),
        Line2D([], [], color="0.4", ls=":", lw=0.8, label="warm start's level, sparse inf."),
        Line2D([], [], color="0.4", ls="--", lw=0.8, label="collapse threshold"),
    ]
    if len(warms) > 1:
        handles += [
            Line2D([], [], color="0.3", marker=MARKERS[i % len(MARKERS)], ls="", ms=4, label=f"warm start {w}")
            for i, w in enumerate(sorted(warms))
        ]
    fig.legend(handles=handles, loc="outside lower center", ncol=3, frameon=False)
    fig.suptitle(title)
    return fig, has_eval


def diagnostics_figure(histories: dict, title: str):
    """The diagnostics per iteration (mean over runs, one colour per arm) and the relative position
    of rejected tokens at the final iteration; two panels a row."""
    fig, axes = figlib.panels(3, 7.2)
    colours = figlib.arm_colours(histories)
    for ax, (title_, (keys, ylabel)) in zip(axes, DIAG_CURVES.items()):
        for arm, hs in histories.items():
            for key, style in keys:
                x, m, _ = figlib.curve(hs, key)
                ax.plot(x, m, style, color=colours[arm], label=LABELS.get(arm, arm) if style == "-" else None)
        ax.set(title=title_, ylabel=ylabel)
        figlib.iteration_axis(ax)
        if "KL" in title_:
            ax.set_yscale("symlog", linthresh=1e-3, linscale=0.5)
        ax.set_ylim(bottom=0)
    ax, width = axes[-1], 0.8 / len(histories)
    centres = (np.arange(N_BINS) + 0.5) / N_BINS
    for i, (arm, hs) in enumerate(histories.items()):
        hist = np.mean([[h[-1].get(f"diag/reject_pos_{b}", np.nan) for b in range(N_BINS)] for h in hs if h], axis=0)
        ax.bar(
            centres + (i - (len(histories) - 1) / 2) * width / N_BINS, hist, width=width / N_BINS, color=colours[arm]
        )
    ax.set(
        title="rejected tokens by position (last iteration)",
        ylabel="fraction of rejected tokens",
        xlabel="relative position in the response, j / M",
    )
    figlib.band_legend_below(fig, axes[0])
    fig.suptitle(title)
    return fig


# ----------------------------------------------------------------------------- render


def render(data: dict, base, command: str) -> figlib.Rendered:
    warms, per_seed = figlib.results_of(data, "per_seed")
    seeds, n_eval = data["seeds"], data.get("eval_prompts", base.train.eval_prompts)
    kvc = base.kv
    lines = [
        f"Task {base.data.task}; rollouts {base.rollout.prompts}x{base.rollout.samples} for "
        f"{base.train.iterations} iterations; sparse arms use {kvc.policy} with budget {kvc.budget} + "
        f"buffer {kvc.buffer}; warm starts (SFT seeds) {sorted(warms) or [0]}, RL seeds {seeds} on each "
        f"(mean ± std over the {len(next(iter(per_seed.values())))} runs). Accuracy is avg@1 on "
        f"{n_eval} held-out prompts at the training temperature.",
        "",
        *arm_table(per_seed, warms),
        "",
        figlib.COLLAPSE_NOTE,
        *figlib.per_warm_start_table(per_seed, warms),
        *comparisons(per_seed, n_eval),
        *verdicts_table(data, n_eval),
    ]
    title = figlib.run_title(
        base, command, seeds, "Figure a: dense vs naive sparse vs Sparse-RL rollouts", sorted(warms) or [0]
    )
    curves, has_eval = curves_figure(data["histories"], warms, per_seed, base, n_eval, title)
    figures = {"curves": curves}
    if "diagnostics" in data:
        lines += [
            *diagnostics_table(data["diagnostics"]),
            "",
            "![diagnostics](diagnostics.png)",
            "",
            "Diagnostics figure: each rollout diagnostic per iteration, mean over runs (no bands, "
            "for legibility), and where in a response the tokens rejected at the last iteration "
            "sit (mean over runs).",
        ]
        figures["diagnostics"] = diagnostics_figure(data["histories"], title)
    return figlib.Rendered(
        "Figure a: training curves", "\n".join(lines), figures, curves_caption(has_eval, base, n_eval, warms, seeds)
    )


def dense_eval(base) -> bool:
    """Whether the runs logged their held-out accuracy under dense inference (train.eval_kv)."""
    return getattr(base.train, "eval_kv", "rollout") == "dense"


def curves_caption(has_eval: bool, base, n_eval: int, warms: dict, seeds) -> str:
    """The caption of curves.png: what its marks mean (figure a and the default experiment)."""
    under = (
        "under dense inference (train.eval_kv=dense)"
        if dense_eval(base)
        else "under the arm's own rollout KV settings (dense for the dense arm, sparse for the sparse arms)"
    )
    styles = (
        ""
        if dense_eval(base)
        else " (solid lines and filled marks: dense inference, the dense arm; dashed lines and open marks: "
        "sparse inference, the sparse arms: two inferences on one axis)"
    )
    held_out = (
        "Held-out accuracy panel: lines with dots, held-out accuracy logged during training (avg@1 on "
        f"{base.train.eval_prompts} prompts every train.eval_every iterations) {under}{styles}; stars at "
        "iteration 0, the warm start (filled: dense, open: sparse inference); diamonds after the last "
        f"iteration, the final weights under the same inference as the line (avg@1 on {n_eval} prompts, "
        "mean ± std over runs). "
        if has_eval
        else "These runs logged no held-out accuracy during training (train.eval_every 0): the second panel "
        "is the policy entropy. "
    )
    return (
        "Figure: per-iteration training metrics of each arm (colours: dense blue, naive sparse red, "
        f"Sparse-RL green, as in every figure). {held_out}Final-accuracy panel: every run "
        "(filled: dense inference, open: sparse inference; marker: warm start), black bar: the mean; "
        "grey lines: the warm start under dense (solid) and sparse (dotted) inference, dashed: the "
        "collapse threshold (half the warm start's dense accuracy). Mismatch KL on a symmetric-log "
        f"axis (linear below 1e-3). {figlib.BAND_CAPTION} Warm starts {sorted(warms) or [0]}, seeds {seeds}."
    )


FIGURE = figlib.Figure("fig_a_curves", __doc__, run, render, arguments, seeds=(0, 1, 2, 3, 4), warm_starts=(0,))

main = FIGURE.main
