"""Figure d: correction ablation on sparse rollouts: none (naive sparse), SARS only, IBR only, both
(Sparse-RL), and Sparse-RL with the SARS ratio taken per token, per sequence and as a geometric
mean (docs/methods.md#sars).

  python experiments/figures/fig_d_corrections.py                  # 6 variants x 3 seeds, warm start 0
  python experiments/figures/fig_d_corrections.py --seeds 0 --variants none both --smoke
  python experiments/figures/fig_d_corrections.py --config experiments/configs/walk_key_rkv.yaml \
      --warm-starts 0 1 2 --seeds 0 1 --variants none sars_only ibr_only both \
      --runs-dir runs/figures train.iterations=40      # the default experiment's runs and regime

Every variant trains from the same warm starts (--warm-starts, SFT seeds) with sparse rollouts
(the base config's policy and budget) and the same seeds on each; the table gives the mean ±
standard deviation over runs, both collapse rules for every variant, the paired differences the
tie rule judges (per warm start and pooled) and each claim's count of runs (figlib.claims_table).
With the default experiment's config, overrides and run cache, 'none' and 'both' are its naive
sparse and Sparse-RL runs (the same configs: reused, not re-trained).
"""

from __future__ import annotations

from experiments.lib import figlib

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


def run(args, study) -> dict:
    policy = study.base.kv.policy
    n_eval = figlib.eval_prompts(args, study)
    warms = figlib.warms_of(args)
    results, histories = figlib.run_variants(
        study,
        args.variants,
        args.seeds,
        lambda name: (VARIANTS[name][0], policy, VARIANTS[name][1]),
        lambda run: figlib.scores(run, policy, n_eval),
        [({"policy": "none"}, n_eval), ({}, n_eval)],
        warms,
    )
    return {
        "results": results,
        "seeds": args.seeds,
        "histories": histories,
        "variants": {n: list(VARIANTS[n][1]) + [f"rl.mode={VARIANTS[n][0]}"] for n in results},
        "eval_prompts": n_eval,
        "warm_starts": {str(w): row for w, row in figlib.warm_rows(study, warms, n_eval).items()},
    }


ROLES = {
    "none": "naive_sparse",
    "both": "sparse_rl",
    "both_sequence_level": "sparse_rl_sequence",
    "both_geometric_level": "sparse_rl_geometric",
}  # each variant's colour (figlib.ARM_COLOURS)
COMPARE = [
    ("both", "none"),
    ("sars_only", "none"),
    ("ibr_only", "none"),
    ("both", "sars_only"),
    ("both", "ibr_only"),
    ("both_sequence_level", "both"),
    ("both_geometric_level", "both"),
]
# The paper's ablation read at every run (declared before the warm-start re-runs): each correction
# ahead of none, and the combination not behind either part alone, on dense inference by the tie
# rule at each run pair; every variant's survival by both collapse rules.
CLAIMS = [  # (a, b, outcomes where it holds, phrase)
    ("both", "none", (1,), "ahead of"),
    ("sars_only", "none", (1,), "ahead of"),
    ("ibr_only", "none", (1,), "ahead of"),
    ("both", "sars_only", (0, 1), "not behind"),
    ("both", "ibr_only", (0, 1), "not behind"),
]


def claims(results: dict, warms: dict, n_eval: int) -> list[figlib.Claim]:
    """CLAIMS and every variant's survival, read at each run (figlib.claims_table renders them)."""
    out = [c for name, rows in results.items() for c in figlib.survival_claims(LABELS[name], rows, warms)]
    for a, b, holds, phrase in CLAIMS:
        if a in results and b in results:
            c = figlib.compare(a, results[a], b, results[b], "dense_acc", n_eval)[-1]
            text = f"{LABELS[a]} {phrase} {LABELS[b]}, dense inference (tie rule at each run)"
            out.append(figlib.comparison_claim(text, c, holds))
    return out


COLUMNS = (  # (header, row key, format) of the table
    ("acc. dense inf.", "dense_acc", ".3f"),
    ("acc. sparse inf.", "sparse_acc", ".3f"),
    ("train reward (last 25%)", "train_reward_last25", ".3f"),
    ("token reject (last 25%)", "token_reject_rate", ".3f"),
    ("seq reject (last 25%)", "seq_reject_rate", ".3f"),
    ("mismatch KL (k3)", "mismatch_kl_k3", ".4f"),
    ("entropy (last 25%)", "entropy_last25", ".3f"),
    ("skipped steps", "skipped_steps", ".0f"),
)


def render(data: dict, base, command: str) -> figlib.Rendered:
    warms, results = figlib.results_of(data)
    seeds, kvc = data["seeds"], base.kv
    policy = kvc.policy
    n_eval = data.get("eval_prompts", base.train.eval_prompts)
    cs = figlib.compare_arms(results, COMPARE, figlib.ACC_METRICS, n_eval)
    runs = len(next(iter(results.values())))
    lines = [
        f"Sparse rollouts with {policy}, budget {kvc.budget} + buffer {kvc.buffer}; "
        f"{base.train.iterations} iterations from warm start(s) {sorted(warms) or [0]} with seeds {seeds} on each: "
        f"{runs} runs per variant (mean ± std over runs).",
        "",
        *figlib.md_table(
            ["corrections", "mode", *figlib.headers(COLUMNS), *figlib.COLLAPSE_HEADERS],
            ([name, VARIANTS[name][0], *figlib.arm_cells(rows, COLUMNS, warms)] for name, rows in results.items()),
        ),
        "",
        figlib.warm_note(warms) + figlib.COLLAPSE_NOTE,
        *figlib.per_warm_start_table(results, warms),
        *figlib.comparison_lines(cs, "Paired differences (by warm start and seed):"),
        *figlib.claims_table(claims(results, warms, n_eval)),
    ]
    acc = f"accuracy (avg@1, {n_eval} prompts)"
    fig = figlib.ablation_figure(
        results,
        data["histories"],
        [
            ("dense_acc", f"{acc},\ndense inference", ".2f", False),
            ("sparse_acc", f"{acc},\nsparse inference ({policy}@{kvc.budget})", ".2f", False),
        ],
        LABELS,
        figlib.run_title(base, command, seeds, "Figure d, correction ablation", sorted(warms) or [0]),
        reference="none" if "none" in results else None,
        roles=ROLES,
    )
    caption = (
        f"Figure: final held-out accuracy (avg@1 on {n_eval} prompts) of each correction variant "
        f"under dense and under sparse inference (top; dots: the seeds), and its train reward per "
        "iteration (mean reward of the rollouts; bottom, one panel per variant; grey dashed: no "
        f"correction). {figlib.BAND_CAPTION} Warm starts {sorted(warms) or [0]}, seeds {seeds} on each."
    )
    return figlib.Rendered("Figure d: correction ablation", "\n".join(lines), {"corrections": fig}, caption)


FIGURE = figlib.Figure(
    "fig_d_corrections", __doc__, run, render, seeds=(0, 1, 2), warm_starts=(0,), choices={"--variants": VARIANTS}
)

main = FIGURE.main


if __name__ == "__main__":
    main()
