"""Figure tail: does holding Sparrow's tail keep naive sparse training from collapsing? The tiny
regime (the default experiment's task, R-KV), over warm starts and seeds.

  python experiments/figures/fig_tail.py --warm-starts 0 1 2 --seeds 0 1 --runs-dir runs/figures train.iterations=40
  python experiments/figures/fig_tail.py --smoke --budgets 32 48 --reference 48 --seeds 0
  python experiments/figures/fig_tail.py --replot experiments/results/fig_tail

Plan, fixed before any run (issue 43, item 3, the tiny regime). Sparrow (Zhou et al. 2026) finds
sparse-rollout RL stable while the 5th percentile of the per-token agreement sum_v min(p_sparse(v),
p_dense(v)) (over the sampler's top 20) stays above a threshold through the generation.
1. Calibration, no training: each warm start samples --tail-prompts training prompts x
   rollout.samples with every fixed budget of --budgets (the config's KV policy); the tokens of
   all warm starts are pooled per bin of --every tokens seen. tau = the pooled 5th percentile of
   the --reference budget (the larger budget, whose tail the schedule is to hold).
2. The schedule, calibrated sequentially (eviction is irreversible, so bins are not independent:
   experiments/results/real/tail): bin by bin, with the earlier bins' choices in force, the
   smallest budget under which that bin and every later bin hold their target: tau, or where the
   largest budget's own percentile in a bin is lower, that (real/schedule.py sequential_schedule).
3. Training: naive sparse rollouts (rl.mode=naive_sparse, no correction) at the config's own
   budget (--base, the default experiment's naive arm: the same runs), at the reference budget,
   and with the schedule, from every warm start with every seed; final accuracy on held-out
   prompts under dense inference.
Claims, read at every run by the shared rule (figlib.claims_table): naive at the reference budget
does not collapse (the premise: without it the reference's tail is not a safe level and the
question stays open); naive with the schedule does not collapse; it is not behind naive at the
reference budget (tie rule at each run); and it is ahead of naive at the base budget. Each arm's
training KV saving and its logged agreement tail (agreement/p5) are reported beside them.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from experiments.lib import figlib, workers
from experiments.real import report
from experiments.real.schedule import sequential_schedule

TOP_K = 20  # Sparrow's top 20 (experiments/real/tail.py)
ARMS = ("base", "reference", "schedule")  # naive sparse at --base, at --reference, with the schedule


def arguments(p) -> None:
    p.add_argument("--base", type=int, help="naive sparse's collapsing arm's budget (default: the config's kv.budget)")
    p.add_argument("--reference", type=int, default=96, help="the fixed budget whose pooled tail sets tau")
    p.add_argument("--every", type=int, default=32, help="tokens seen per bin and per schedule entry")
    p.add_argument("--tail-prompts", type=int, default=32, help="training prompts a warm start samples (x samples)")


def _warm_models(config: str, overrides: list[str], runs_dir: str, warms) -> list:
    """Each warm start's trainer (its weights, sampler, tokenizer and prompt source)."""
    study = figlib.Study(config, overrides, runs_dir)
    return [study.warm_start(warm=w).trainer(study.log) for w in warms]


def warm_starts_tail(trainers, warms, kv: dict, every: int, n_prompts: int) -> dict:
    """The tail of KV settings `kv` (a budget, or a schedule) pooled over the warm starts' samples:
    each warm start samples `n_prompts` training prompts x rollout.samples (sampling seed = its
    SFT seed, the same draws for every setting), the dense warm start scores them."""
    from experiments.real import tail
    from sparserl_jax.components import prompt_source
    from sparserl_jax.rollout.prompts import pad_prompt_batch

    batches = []
    for w, trainer in zip(warms, trainers):
        cfg, pad = trainer.cfg, trainer.tokenizer.pad_token_id
        examples = prompt_source(cfg, trainer.tokenizer, batch_size=n_prompts).next_batch()
        ids = [list(e.prompt_ids) for e in examples for _ in range(cfg.rollout.samples)]
        tokens, lengths = pad_prompt_batch(ids, pad, cfg.data.max_prompt_len)
        sampler = dataclasses.replace(trainer.sampler_cfg, kv=dataclasses.replace(cfg.kv, **kv), agreement_k=TOP_K)
        temperature = cfg.rollout.temperature
        batches.append(
            tail.sample_tail(trainer.model_cfg, trainer.params, tokens, lengths, sampler, pad, w, len(ids), temperature)
        )
    schedule = list(kv.get("budget_schedule", ()))
    res = tail.pooled_tail(batches, every)
    res["bins"] = {str(b): v for b, v in res["bins"].items()}  # as results.json keeps them
    return {**res, "arm": {"budget": kv["budget"], "schedule": schedule}}


def _calibrate_job(job) -> dict:
    """Worker: the calibration (the module doc's steps 1 and 2) in one single-core process."""
    config, overrides, runs_dir, warms, budgets, reference, every, n_prompts = job
    trainers = _warm_models(config, overrides, runs_dir, warms)
    fixed = [warm_starts_tail(trainers, warms, {"budget": b}, every, n_prompts) for b in budgets]
    tau = fixed[list(budgets).index(reference)]["agreement_p5"]
    reached = {int(b) for r in fixed for b in r["bins"]}

    def measure(schedules):
        kvs = [{"budget": max(s), "budget_schedule": tuple(s), "schedule_every": every} for s in schedules]
        return [warm_starts_tail(trainers, warms, kv, every, n_prompts) for kv in kvs]

    top = fixed[list(budgets).index(max(budgets))]
    ceiling = {int(b): v["p5"] for b, v in top["bins"].items()}
    schedule, trials, final = sequential_schedule(max(reached) + 1, list(budgets), tau, reached, measure, ceiling)
    final = final or measure([schedule])[0]
    return {"fixed": fixed, "tau": tau, "schedule": list(schedule), "sequential_trials": trials, "schedule_row": final}


def run(args, study) -> dict:
    args.base = args.base or study.base.kv.budget
    if args.reference not in args.budgets or args.base not in args.budgets:
        raise ValueError(f"--reference={args.reference} and --base={args.base} must be among --budgets={args.budgets}")
    warms = figlib.warms_of(args)
    n_eval = figlib.eval_prompts(args, study)
    study.train_all([{"warm_start": w} for w in warms])
    job = (
        study.config,
        study.overrides,
        study.runs_dir,
        warms,
        args.budgets,
        args.reference,
        args.every,
        args.tail_prompts,
    )
    (cal,) = workers.parallel_map(_calibrate_job, [job], study.cores)
    schedule = cal["schedule"]
    extras = {
        "base": [f"kv.budget={args.base}"],
        "reference": [f"kv.budget={args.reference}"],
        "schedule": [
            f"kv.budget={max(schedule)}",
            f"kv.budget_schedule=[{','.join(map(str, schedule))}]",
            f"kv.schedule_every={args.every}",
        ],
    }
    policy = study.base.kv.policy
    results, histories = figlib.run_variants(
        study,
        list(ARMS),
        args.seeds,
        lambda arm: ("naive_sparse", policy, extras[arm]),
        lambda r: {
            "dense_acc": r.evaluate({"policy": "none"}, n=n_eval)["accuracy"],
            "agreement_p5": figlib.run_mean(r.history, "agreement/p5", np.nan),
            **figlib.summarize(r),
        },
        [({"policy": "none"}, n_eval)],
        warms,
    )
    return {
        "calibration": {k: cal[k] for k in ("fixed", "sequential_trials", "schedule_row")},
        "tau": cal["tau"],
        "schedule": schedule,
        "arm_overrides": extras,
        "results": results,
        "histories": histories,
        "warm_starts": {str(w): row for w, row in figlib.warm_rows(study, warms, n_eval).items()},
        "seeds": args.seeds,
        "budgets": list(args.budgets),
        "base": args.base,
        "reference": args.reference,
        "every": args.every,
        "tail_prompts": args.tail_prompts,
        "eval_prompts": n_eval,
    }


LABELS = {"base": "naive @ base budget", "reference": "naive @ reference budget", "schedule": "naive @ tail schedule"}
COLUMNS = (
    ("acc. dense inf.", "dense_acc", ".3f"),
    ("train reward (last 25%)", "train_reward_last25", ".3f"),
    ("KV saving (train)", "train_kv_saving", ".1%"),
    ("agreement p5 (run mean)", "agreement_p5", ".3f"),
    ("mismatch KL (k3)", "mismatch_kl_k3", ".4f"),
)


def claims(results: dict, warms: dict, n_eval: int) -> list[figlib.Claim]:
    """The module doc's claims, read at every run."""

    def versus(a: str, b: str, text: str, holds) -> figlib.Claim:
        c = figlib.compare(a, results[a], b, results[b], "dense_acc", n_eval)[-1]
        return figlib.comparison_claim(text, c, holds)

    return [
        *figlib.survival_claims(LABELS["reference"] + " (the premise)", results["reference"], warms),
        *figlib.survival_claims(LABELS["schedule"], results["schedule"], warms),
        versus("schedule", "reference", "the schedule not behind the reference budget (tie rule at each run)", (0, 1)),
        versus("schedule", "base", "the schedule ahead of the base budget (tie rule at each run)", (1,)),
    ]


def render(data: dict, base, command: str) -> figlib.Rendered:
    warms, results = figlib.results_of(data)
    n_eval, every, tau = data["eval_prompts"], data["every"], data["tau"]
    cal = data["calibration"]
    rows = cal["fixed"] + [cal["schedule_row"]]
    names = [f"fixed {r['arm']['budget']}" for r in cal["fixed"]] + [f"schedule {data['schedule']}"]
    n_bins = max(int(b) for r in rows for b in r["bins"]) + 1
    cal_body = [
        [
            name,
            f"{r['kv_saving']:.1%}",
            f"{r['kl_k3']:.4f}",
            f"{r['agreement_mean']:.3f}",
            f"{r['agreement_p5']:.3f}",
            " / ".join(f"{r['bins'][str(b)]['p5']:.2f}" if str(b) in r["bins"] else "-" for b in range(n_bins)),
        ]
        for name, r in zip(names, rows)
    ]
    body = [
        [LABELS[a], " ".join(data["arm_overrides"][a]), *figlib.arm_cells(results[a], COLUMNS, warms)] for a in ARMS
    ]
    lines = [
        f"Calibration (no training): the warm starts {sorted(warms)} sample their training prompts with each "
        f"budget of {base.kv.policy} (buffer {base.kv.buffer}), tokens pooled over warm starts, bins of {every} "
        f"tokens seen; tau = the reference budget {data['reference']}'s 5th percentile = {tau:.3f}; the sequential "
        f"calibration sampled {len(cal['sequential_trials'])} candidate schedules. "
        + report.equal_mismatch_sentence(cal["fixed"], cal["schedule_row"]),
        "",
        *figlib.md_table(
            [
                "rollouts",
                "KV saving",
                "mismatch KL (k3)",
                "agreement mean",
                "agreement p5",
                f"p5 per bin of {every} tokens",
            ],
            cal_body,
        ),
        "",
        f"Training: naive sparse rollouts (no correction), {base.train.iterations} iterations from warm starts "
        f"{sorted(warms)} with seeds {data['seeds']} on each (mean ± std over runs).",
        "",
        *figlib.md_table(["arm", "overrides", *figlib.headers(COLUMNS), *figlib.COLLAPSE_HEADERS], body),
        "",
        figlib.warm_note(warms) + figlib.COLLAPSE_NOTE,
        *figlib.comparison_lines(
            figlib.compare_arms(
                results,
                [("schedule", "reference"), ("schedule", "base"), ("reference", "base")],
                {"dense_acc": "dense inference"},
                n_eval,
            ),
            "Paired differences (by warm start and seed):",
        ),
        *figlib.claims_table(claims(results, warms, n_eval)),
    ]
    fig, (ax_cal, ax_acc) = figlib.plt.subplots(
        2, 1, figsize=(figlib.COLUMN_W, 5.6), layout="constrained", height_ratios=[3, 2]
    )
    centres = (np.arange(n_bins) + 0.5) * every
    shades = figlib.plt.cm.viridis(np.linspace(0.1, 0.85, len(cal["fixed"])))
    for i, r in enumerate(rows):
        fixed = i < len(cal["fixed"])
        ys = [r["bins"].get(str(b), {}).get("p5", np.nan) for b in range(n_bins)]
        label = f"{r['arm']['budget'] if fixed else 'schedule'} ({r['kv_saving']:.0%})"
        style = dict(color=shades[i], lw=0.9) if fixed else dict(color="black", lw=1.6, ls=":")
        ax_cal.plot(centres, ys, marker=".", label=label, **style)
    ax_cal.axhline(tau, color="0.4", ls="--", lw=0.8, label=f"tau {tau:.3f}")
    ax_cal.set(xlabel="tokens seen (prompt + response)", ylabel="agreement p5 (pooled per bin)")
    ax_cal.legend(fontsize=7, loc="lower left", ncol=2, title="budget (KV saved)", title_fontsize=7)
    ax_cal.set_title("calibration (warm starts, no training)", fontsize=8)
    colours = figlib.arm_colours(ARMS, {"base": "naive_sparse", "reference": "dense", "schedule": "sparse_rl"})
    figlib.run_bars(
        ax_acc,
        list(ARMS),
        {a: [r["dense_acc"] for r in results[a]] for a in ARMS},
        colours,
        horizontal=True,
        value_fmt=".2f",
        labels=[f"{data['base']}", f"{data['reference']}", "schedule"],
    )
    ax_acc.set(
        xlabel=f"final accuracy (avg@1, {n_eval} prompts,\ndense inference)", ylabel="naive sparse at", xlim=(0, 1.15)
    )
    ax_acc.set_title("naive sparse training", fontsize=8)
    fig.suptitle(
        figlib.run_title(base, command, data["seeds"], "Figure tail: holding the agreement tail", sorted(warms))
    )
    caption = (
        "Figure: top, the 5th percentile of the per-token agreement sum_v min(p_sparse, p_dense) over the "
        f"sampler's top {TOP_K}, pooled per bin of {every} tokens over the warm starts' samples, for each fixed "
        "budget (coloured by budget) and the sequentially calibrated schedule (black, dotted); legend: each one's KV saving; dashed: tau, the reference budget's pooled "
        "percentile. Bottom: final dense-inference accuracy of naive sparse training at the base budget, the "
        "reference budget and the schedule; bars: mean over runs (warm starts x seeds), error bars ± one sample "
        "standard deviation, dots: the runs."
    )
    return figlib.Rendered(
        "Figure tail: holding Sparrow's tail in naive sparse training", "\n".join(lines), {"tail": fig}, caption
    )


FIGURE = figlib.Figure(
    "fig_tail",
    __doc__,
    run,
    render,
    arguments,
    seeds=(0, 1),
    warm_starts=(0, 1, 2),
    budgets=(32, 48, 64, 96),
    default_config=os.path.join(figlib.HERE, "configs", "walk_key_rkv.yaml"),
)

main = FIGURE.main


if __name__ == "__main__":
    main()
