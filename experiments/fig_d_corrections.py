"""Figure d: correction ablation on sparse rollouts: none (naive sparse), SARS only, IBR only, both
(Sparse-RL), and Sparse-RL with the SARS ratio taken per token, per sequence and as a geometric
mean (methods.md 1.2).

  python experiments/fig_d_corrections.py                  # 6 variants x 3 seeds
  python experiments/fig_d_corrections.py --seeds 0 --variants none both --smoke

Every variant uses the same warm start, sparse rollouts (the base config's policy and budget) and
seeds; the table gives the mean ± standard deviation over seeds.
"""

from __future__ import annotations

import figlib
from figlib import fmt

VARIANTS = {  # name -> (rl.mode, extra overrides)
    "none": ("naive_sparse", ()),
    "sars_only": ("sars_only", ()),
    "ibr_only": ("ibr_only", ()),
    "both": ("sparse_rl", ()),
    "both_sequence_level": ("sparse_rl", ("rl.sars.token_level=sequence", "rl.sars.veto_level=sequence")),
    "both_geometric_level": ("sparse_rl", ("rl.sars.token_level=geometric", "rl.sars.veto_level=geometric")),
}


LABELS = {  # short readable names in the figure
    "none": "none (naive sparse)",
    "sars_only": "SARS only",
    "ibr_only": "IBR only",
    "both": "SARS + IBR (Sparse-RL)",
    "both_sequence_level": "Sparse-RL, sequence ratio",
    "both_geometric_level": "Sparse-RL, geometric ratio",
}


def main(argv=None) -> dict:
    args = figlib.variants_parser(__doc__, VARIANTS, replot=True).parse_args(argv)
    if args.replot:
        data, base = figlib.load_results(args.replot)
        render(data, base, args.replot, replot=True)
        return data
    study = figlib.study_from_args(args)
    out = args.out or figlib.default_out("fig_d_corrections", args.config)
    policy = study.base.kv.policy
    n_eval = figlib.eval_prompts(args, study)
    results, histories = figlib.run_variants(
        study, args.variants, args.seeds, lambda name: (VARIANTS[name][0], policy, VARIANTS[name][1]),
        lambda run: figlib.scores(run, policy, n_eval))
    names = list(results)
    data = {"results": results, "seeds": args.seeds, "histories": histories,
            "variants": {n: list(VARIANTS[n][1]) + [f"rl.mode={VARIANTS[n][0]}"] for n in names},
            "eval_prompts": n_eval}
    render(data, study.base, out, study=study)
    return data


def render(data: dict, base, out: str, study=None, replot: bool = False) -> None:
    """results.md and corrections.png of `data` (a fresh run's, or a committed results.json's)."""
    results, seeds = data["results"], data["seeds"]
    kvc = base.kv
    policy = kvc.policy
    command = data["command"] if replot else figlib.command_line()
    lines = [
        f"Sparse rollouts with {policy}, budget {kvc.budget} + buffer {kvc.buffer}; "
        f"{base.train.iterations} iterations; seeds {seeds} (mean ± std).",
        "",
        "| corrections | mode | acc. dense inf. | acc. sparse inf. | train reward (last 25%) | "
        "token reject | seq reject | mismatch KL (k3) | entropy (last 25%) | skipped steps |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        col = lambda k: [r[k] for r in rows]  # noqa: E731
        lines.append(
            f"| {name} | {VARIANTS[name][0]} | {fmt(col('dense_acc'))} | {fmt(col('sparse_acc'))} | "
            f"{fmt(col('train_reward_last25'))} | {fmt(col('token_reject_rate'))} | "
            f"{fmt(col('seq_reject_rate'))} | {fmt(col('mismatch_kl_k3'), '.4f')} | "
            f"{fmt(col('entropy_last25'))} | {fmt(col('skipped_steps'), '.0f')} |"
        )
    n_eval = data.get("eval_prompts", base.train.eval_prompts)
    acc = f"accuracy (avg@1, {n_eval} prompts)"
    fig = figlib.ablation_figure(
        results, data["histories"],
        [("dense_acc", f"{acc},\ndense inference", ".2f", False),
         ("sparse_acc", f"{acc},\nsparse inference ({policy}@{kvc.budget})", ".2f", False)],
        LABELS, figlib.run_title(base, command, seeds, "Figure d, correction ablation"),
        reference="none" if "none" in results else None)
    caption = (
        f"Figure: final held-out accuracy (avg@1 on {n_eval} prompts) of each correction variant "
        f"under dense and under sparse inference (top), and its train reward per iteration (mean "
        "reward of the rollouts; bottom, one panel per variant; grey dashed: no correction). "
        f"{figlib.BAND_CAPTION} Seeds {seeds}.")
    figlib.write_outputs(out, "Figure d: correction ablation", "\n".join(lines), data, fig,
                         "corrections", study, caption=caption, replot=replot)


if __name__ == "__main__":
    main()
