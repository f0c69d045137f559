"""Figure QuRL: quantized rollouts at tiny scale (docs/methods.md#qurl): full-precision
rollouts, naive INT8 (no correction), TIS (FlashRL), ACR (QuRL), ACR + invariant scaling, and
sparse + quantized rollouts (one behaviour policy: evicted KV and int8 weights), beside the
paper's GSM8K numbers.

  python experiments/figures/fig_qurl.py                                # 7 variants x 3 seeds
  python experiments/figures/fig_qurl.py --seeds 0 --variants fp int8_tis --smoke

Every variant starts from the same warm start with the same seeds; accuracy is that of the final
full-precision weights under dense inference; mismatch KL (k3) is KL(pi_behav || pi_old) over the
response tokens, ACR activity the fraction of tokens whose rho exceeds C, both averaged over the
run; rollout tokens/s is measured on this machine (on CPU a quantized dot may be slower).
"""

from __future__ import annotations

from experiments.lib import figlib

INT8 = ("quant.format=int8",)
VARIANTS = {  # name -> (rl.mode, sparse KV rollouts?, extra overrides, paper GSM8K accuracy)
    "fp": ("dense", False, (), 55.35),
    "int8_naive": ("dense", False, INT8, 48.78),
    "int8_tis": ("tis", False, INT8, 51.40),
    "int8_acr": ("qurl", False, INT8, 53.55),
    "int8_acr_invariant_scaling": ("qurl", False, INT8 + ("quant.invariant_scaling=true",), None),
    "sparse_int8_acr": ("qurl", True, INT8, None),
    "sparse_int8_sparse_rl_acr": ("sparse_rl", True, INT8 + ("rl.acr.enabled=true",), None),
}


def row(run, n_eval: int | None = None) -> dict:
    h = run.history
    return {
        "dense_acc": run.evaluate({"policy": "none"}, n=n_eval)["accuracy"],
        "mismatch_kl_k3": figlib.run_mean(h, "mismatch/kl_k3"),
        "acr_active": figlib.run_mean(h, "acr/active_frac"),
        "rollout_tokens_per_s": figlib.run_mean(h, "throughput/rollout_tokens_per_s"),
        **figlib.summarize(run),
    }


LABELS = {  # short readable names in the figure
    "fp": "full precision",
    "int8_naive": "INT8, no correction",
    "int8_tis": "INT8 + TIS",
    "int8_acr": "INT8 + ACR (QuRL)",
    "int8_acr_invariant_scaling": "INT8 + ACR + inv. scaling",
    "sparse_int8_acr": "sparse + INT8 + ACR",
    "sparse_int8_sparse_rl_acr": "sparse + INT8, Sparse-RL + ACR",
}


def run(args, study) -> dict:
    sparse = study.base.kv.policy
    n_eval = figlib.eval_prompts(args, study)

    def arm_of(name):
        mode, is_sparse, extra, _ = VARIANTS[name]
        return mode, sparse if is_sparse else "none", extra

    results, histories = figlib.run_variants(
        study, args.variants, args.seeds, arm_of, lambda run: row(run, n_eval), [({"policy": "none"}, n_eval)]
    )
    return {
        "results": results,
        "seeds": args.seeds,
        "histories": histories,
        "variants": {n: [f"rl.mode={VARIANTS[n][0]}", *VARIANTS[n][2]] for n in results},
        "paper_gsm8k": {n: VARIANTS[n][3] for n in results},
        "eval_prompts": n_eval,
        "warm_starts": {"0": figlib.warm_rows(study, [0], n_eval)[0]},
    }


COLUMNS = (  # (header, row key, format) of the table
    ("accuracy", "dense_acc", ".3f"),
    ("train reward (last 25%)", "train_reward_last25", ".3f"),
    ("mismatch KL (k3)", "mismatch_kl_k3", ".2e"),
    ("ACR active", "acr_active", ".4f"),
    ("rollout tokens/s", "rollout_tokens_per_s", ".0f"),
)


def render(data: dict, b, command: str) -> figlib.Rendered:
    warms, results = figlib.results_of(data)
    seeds, sparse = data["seeds"], b.kv.policy
    n_eval = data.get("eval_prompts", b.train.eval_prompts)
    paper = {name: "—" if VARIANTS[name][3] is None else f"{VARIANTS[name][3]:.2f}" for name in results}
    cs = figlib.compare_arms(
        results, [(name, "fp") for name in results if name != "fp"], {"dense_acc": "dense inference"}, n_eval
    )
    lines = [
        f"{b.train.iterations} iterations from warm start 0; seeds {seeds} (mean ± std); int8 W8A8 rollouts "
        f"(embedding and lm_head full precision), ACR C = {b.rl.acr.c}, invariant s = "
        f"{b.quant.invariant_s}; sparse rows: {sparse}, budget {b.kv.budget} + buffer {b.kv.buffer}. "
        "Paper: GSM8K, Qwen2.5-0.5B-Instruct, PPO (BF16 / naive INT8 / TIS / QuRL).",
        "",
        *figlib.md_table(
            ["rollouts", "mode", *figlib.headers(COLUMNS), *figlib.COLLAPSE_HEADERS, "paper GSM8K"],
            (
                [name, VARIANTS[name][0], *figlib.arm_cells(rows, COLUMNS, warms), paper[name]]
                for name, rows in results.items()
            ),
        ),
        "",
        figlib.warm_note(warms) + figlib.COLLAPSE_NOTE,
        *figlib.comparison_lines(cs, "Paired differences from full-precision rollouts (by seed):"),
    ]
    title = figlib.run_title(b, command, seeds, "Figure QuRL, INT8 rollouts (the sparse rows also evict KV)")

    # full-precision rollouts sample from pi_old itself: a run-mean KL of theirs within float rounding
    # of 0 is drawn as 0, not as a bar of rounding noise (every other arm as measured)
    def drawn(name: str, r: dict) -> float:
        return 0.0 if name == "fp" and abs(r["mismatch_kl_k3"]) < KL_ROUNDING else r["mismatch_kl_k3"]

    shown = {name: [{**r, "kl_drawn": drawn(name, r)} for r in rows] for name, rows in results.items()}
    rounded = sorted(r["mismatch_kl_k3"] for r in results.get("fp", []) if drawn("fp", r) == 0.0)
    fig = figlib.ablation_figure(
        shown,
        data["histories"],
        [
            (
                "dense_acc",
                f"accuracy (avg@1, {n_eval} prompts),\ndense inference, full-precision weights",
                ".2f",
                False,
            ),
            ("kl_drawn", "mismatch KL(pi_behav || pi_old), k3,\nnats per token (run mean, symlog)", ".1e", True),
        ],
        LABELS,
        title,
        reference="fp" if "fp" in results else None,
        roles={"fp": "dense", "int8_acr": "qurl", "int8_acr_invariant_scaling": "qurl_invariant"},
    )
    caption = (
        f"Figure: final held-out accuracy (avg@1 on {n_eval} prompts, full-precision weights, dense "
        "inference) and the behaviour-vs-old-policy mismatch KL (k3 estimator, nats per response "
        "token, mean over the run; symmetric-log axis, linear around 0; the full-precision arm samples "
        f"from pi_old itself, so its run means within {KL_ROUNDING:.0e} of 0 are float rounding of a KL "
        "that is 0, drawn as 0"
        + (f": {len(rounded)} runs, {rounded[0]:.1e} to {rounded[-1]:.1e}" if rounded else "")
        + ") of each rollout variant (top; dots: the seeds); "
        "train reward per iteration, one panel per variant, grey dashed: full-precision rollouts "
        f"(bottom). {figlib.BAND_CAPTION} Seeds {seeds}."
    )
    return figlib.Rendered("Figure QuRL: quantized rollouts", "\n".join(lines), {"qurl": fig}, caption)


# Full-precision rollouts sample from pi_old itself: their k3 is 0 up to float rounding (run means of
# order 1e-9 here, either sign), four orders below the smallest int8 arm's (1e-5).
KL_ROUNDING = 1e-6

FIGURE = figlib.Figure("fig_qurl", __doc__, run, render, seeds=(0, 1, 2), choices={"--variants": VARIANTS})

main = FIGURE.main


if __name__ == "__main__":
    main()
