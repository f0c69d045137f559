"""Figure b: KV saving against accuracy across budgets (paper claim: Sparse-RL keeps most of the
dense accuracy while keeping 35-53% fewer KV entries during rollouts).

  python experiments/figures/fig_b_budget.py                       # budgets 16 24 32 48, seed 0, warm start 0
  python experiments/figures/fig_b_budget.py --budgets 16 24 --smoke
  python experiments/figures/fig_b_budget.py --config experiments/configs/walk_key_rkv.yaml \
      --budgets 32 48 64 96 --warm-starts 0 1 2 --seeds 0 1 \
      --runs-dir runs/figures train.iterations=40      # the default experiment's runs and regime

From every warm start (--warm-starts, SFT seeds) and seed, a dense run and, for each budget, a run
of --mode trained with that budget; the warm starts, the dense-trained runs and those runs are
evaluated with each budget (sparse inference) and densely. The x axis is the KV saving measured
on the evaluation rollouts: the fraction of the entries a dense cache would hold that the sparse
cache did not keep. Both collapse rules apply to every trained model; each budget's runs are
compared with the dense-trained run of the same warm start and seed by the tie rule (figlib), and
the claims below are read at every run (figlib.claims_table). With the default experiment's
config, overrides and run cache, the dense runs and the runs at the config's own budget are its
dense and Sparse-RL runs (the same configs: reused, not re-trained).

Claims, declared before the warm-start re-runs: at each budget B, the run trained at B is not
behind the dense-trained run under dense inference (a tie or ahead at each run pair by the tie
rule: the paper's 'keeps most of the accuracy'), it does not collapse (both rules), and under
sparse inference at B it is not behind the dense-trained model (training at B does not cost the
sparse model).
"""

from __future__ import annotations

from experiments.lib import figlib
from experiments.lib.figlib import fmt


def arguments(p) -> None:
    p.add_argument("--mode", default="sparse_rl", help="rl.mode of the budget-specific runs")


def trained(mode: str, budget: int) -> str:
    """The results key of the runs of `mode` trained at `budget`."""
    return f"{mode}@{budget}"


def _sparse(budget: int) -> str:
    """The row key of an accuracy under sparse inference at `budget` (dense-trained runs, warm starts)."""
    return f"sparse_acc@{budget}"


def run(args, study) -> dict:
    policy = study.base.kv.policy
    n_eval = figlib.eval_prompts(args, study)
    warms = figlib.warms_of(args)
    at = [{"policy": policy, "budget": b} for b in args.budgets]
    dense_evals = [({"policy": "none"}, n_eval), *((kv, n_eval) for kv in at)]

    def dense_score(run):
        accs = figlib.accuracies([run], {"policy": "none"}, n_eval) + [
            figlib.accuracies([run], kv, n_eval)[0] for kv in at
        ]
        return {
            "dense_acc": accs[0],
            **{_sparse(b): a for b, a in zip(args.budgets, accs[1:])},
            **figlib.summarize(run),
        }

    def trained_score(run):
        sparse = run.evaluate({}, n=n_eval)
        return {
            "dense_acc": run.evaluate({"policy": "none"}, n=n_eval)["accuracy"],
            "sparse_acc": sparse["accuracy"],
            "kv_saving": sparse["kv_saving"],
            **figlib.summarize(run),
        }

    dense, dense_hist = figlib.run_variants(
        study, ["dense"], args.seeds, lambda _: ("dense", "none", ()), dense_score, dense_evals, warms
    )
    names = {trained(args.mode, b): b for b in args.budgets}
    results, histories = figlib.run_variants(
        study,
        list(names),
        args.seeds,
        lambda name: (args.mode, policy, [f"kv.budget={names[name]}"]),
        trained_score,
        [({"policy": "none"}, n_eval), ({}, n_eval)],
        warms,
    )
    warm_rows = {}
    for w in warms:
        model = study.warm_start(policy, warm=w)
        warm_rows[str(w)] = {
            "dense_acc": model.evaluate({"policy": "none"}, n=n_eval)["accuracy"],
            **{_sparse(b): model.evaluate(kv, n=n_eval)["accuracy"] for b, kv in zip(args.budgets, at)},
        }
    return {
        "results": {**dense, **results},
        "histories": {**dense_hist, **histories},
        "warm_starts": warm_rows,
        "budgets": list(args.budgets),
        "seeds": args.seeds,
        "policy": policy,
        "mode": args.mode,
        "eval_prompts": n_eval,
    }


def upgrade(data: dict) -> dict:
    """A results.json of the one-warm-start layout (a row per budget holding per-seed lists) as the
    layout of `run` (rows per run, warm start 0)."""
    if "results" in data:
        return data
    seeds, mode, rows = data["seeds"], data["mode"], data["rows"]

    def reward_rule(its, i: int) -> dict:  # the reward rule's iteration where the run recorded it
        return {} if its is None else {"collapse_iteration": its[i]}

    dense = [
        {
            "warm_start": 0,
            "seed": s,
            "dense_acc": data["dense_trained_dense_acc"][i],
            **reward_rule(data.get("dense_collapse_iteration"), i),
            **{_sparse(r["budget"]): r["dense_trained_sparse_acc"][i] for r in rows},
        }
        for i, s in enumerate(seeds)
    ]
    results = {
        trained(mode, r["budget"]): [
            {
                "warm_start": 0,
                "seed": s,
                "dense_acc": r["trained_dense_acc"][i],
                "sparse_acc": r["trained_sparse_acc"][i],
                "kv_saving": r["kv_saving"][i],
                "train_kv_saving": r["train_kv_saving"][i],
                **reward_rule(r.get("collapse_iteration"), i),
            }
            for i, s in enumerate(seeds)
        ]
        for r in rows
    }
    warm = {"dense_acc": data["warm_dense_acc"], **{_sparse(r["budget"]): r["warm_sparse_acc"][0] for r in rows}}
    return {
        **{k: v for k, v in data.items() if k not in ("rows", "dense_trained_dense_acc", "dense_collapse_iteration")},
        "results": {"dense": dense, **results},
        "warm_starts": {"0": warm},
        "budgets": [r["budget"] for r in rows],
    }


COLUMNS = (  # (header, row key of the runs trained at a budget, format); {mode}: their mode
    ("KV saving (eval)", "kv_saving", ".1%"),
    ("KV saving (train)", "train_kv_saving", ".1%"),
    ("{mode}, sparse inf.", "sparse_acc", ".3f"),
    ("{mode}, dense inf.", "dense_acc", ".3f"),
)


def _at(rows: list[dict], key: str) -> list[dict]:
    """`rows` with row[key] as their 'sparse_acc' (a dense-trained run or warm start at one budget)."""
    return [{**r, "sparse_acc": r[key]} for r in rows]


def claims(results: dict, warms: dict, budgets, mode: str, n_eval: int) -> list[figlib.Claim]:
    """The module doc's claims at each budget, read at every run."""
    out = []
    for b in budgets:
        mine, dense = results[trained(mode, b)], results["dense"]
        out += figlib.survival_claims(f"{mode}@{b}", mine, warms)
        level = figlib.compare(mode, mine, "dense", dense, "dense_acc", n_eval)[-1]
        out.append(
            figlib.comparison_claim(
                f"{mode}@{b} not behind dense-trained, dense inference (tie rule at each run)", level, (0, 1)
            )
        )
        sparse = figlib.compare(mode, mine, "dense", _at(dense, _sparse(b)), "sparse_acc", n_eval)[-1]
        out.append(
            figlib.comparison_claim(
                f"{mode}@{b} not behind dense-trained, sparse inference at {b} (tie rule at each run)", sparse, (0, 1)
            )
        )
    return out


def render(data: dict, base, command: str) -> figlib.Rendered:
    data = upgrade(data)
    warms, results = figlib.results_of(data)
    budgets, seeds, policy, mode = data["budgets"], data["seeds"], data["policy"], data["mode"]
    n_eval = data.get("eval_prompts", base.train.eval_prompts)
    dense = results["dense"]
    dense_acc = [r["dense_acc"] for r in dense]
    warm_list = sorted(warms)
    body, cs = [], []
    for b in budgets:
        mine = results[trained(mode, b)]
        ratio = [t["sparse_acc"] / max(d, 1e-9) for t, d in zip(mine, dense_acc)]
        body.append(
            [
                str(b),
                *(fmt([r[k] for r in mine], spec) for _, k, spec in COLUMNS[:2]),
                fmt([warms[w][_sparse(b)] for w in warm_list]),
                fmt([r[_sparse(b)] for r in dense]),
                *(fmt([r[k] for r in mine], spec) for _, k, spec in COLUMNS[2:]),
                fmt(ratio, ".0%"),
                *figlib.arm_cells(mine, (), warms),
            ]
        )
        for other, other_rows in (
            ("dense-trained", _at(dense, _sparse(b))),
            ("warm start", {w: {"sparse_acc": row[_sparse(b)]} for w, row in warms.items()}),  # one model each
        ):
            cs += figlib.compare(
                f"{mode}@{b}", mine, other, other_rows, "sparse_acc", n_eval, metric=f"sparse inference at B = {b}"
            )
    d_acc, d_reward = figlib.arm_cells(dense, (), warms)
    runs = len(dense)
    lines = [
        f"Policy {policy}, buffer {base.kv.buffer}; {mode} trained at each budget for "
        f"{base.train.iterations} iterations from warm start(s) {warm_list} with seeds {seeds} on each "
        f"({runs} runs per budget). Dense inference: warm start(s) {fmt([warms[w]['dense_acc'] for w in warm_list])}, "
        f"dense-trained {fmt(dense_acc)} (collapsed: accuracy rule {d_acc}, reward rule {d_reward}).",
        "",
        *figlib.md_table(
            [
                "budget",
                *figlib.headers(COLUMNS[:2]),
                "warm start, sparse inf.",
                "dense-trained, sparse inf.",
                *(h.format(mode=mode) for h in figlib.headers(COLUMNS[2:])),
                f"{mode} sparse / dense-trained dense",
                *figlib.COLLAPSE_HEADERS,
            ],
            body,
        ),
        "",
        figlib.COLLAPSE_NOTE,
        *figlib.per_warm_start_table({trained(mode, b): results[trained(mode, b)] for b in budgets}, warms),
        *figlib.comparison_lines(
            cs, "Paired differences (by warm start and seed; each warm start is one model, paired with its runs):"
        ),
        *figlib.claims_table(claims(results, warms, budgets, mode, n_eval)),
    ]

    fig, ax = figlib.plt.subplots(figsize=(figlib.COLUMN_W, 4.2), layout="constrained")
    x = [100 * figlib.mean_std([r["kv_saving"] for r in results[trained(mode, b)]])[0] for b in budgets]
    colours = figlib.arm_colours(["dense", mode])
    for values, label, colour in (
        ([[warms[w][_sparse(b)] for w in warm_list] for b in budgets], "warm start, sparse inf.", "black"),
        ([[r[_sparse(b)] for r in dense] for b in budgets], "dense-trained, sparse inf.", colours["dense"]),
        (
            [[r["sparse_acc"] for r in results[trained(mode, b)]] for b in budgets],
            f"{mode} trained at B, sparse inf.",
            colours[mode],
        ),
    ):
        m, s = zip(*(figlib.mean_std(v) for v in values))
        ax.errorbar(x, m, yerr=figlib.clipped_err(m, s), marker="o", ms=4, capsize=3, label=label, color=colour)
    ax.axhline(figlib.mean_std(dense_acc)[0], color=colours["dense"], ls="--", label="dense-trained, dense inf.")
    top = ax.secondary_xaxis("top")
    top.set_xticks(x, [str(b) for b in budgets])
    top.set_xlabel(f"training and inference budget B (tokens, + buffer {base.kv.buffer})")
    ax.set(
        ylim=(0, None),
        xlabel="KV saving on the evaluation rollouts\n(% of the dense cache's entries not kept)",
        ylabel=f"accuracy (avg@1, {n_eval} prompts)",
    )
    figlib.band_legend_below(fig, ax, ncol=1)
    fig.suptitle(
        figlib.run_title(
            base,
            command,
            seeds,
            "Figure b: KV saving vs accuracy",
            warm_list,
            setting=f"{policy} at budgets B",
            runs=f"{mode} trained at each B; {figlib.runs_phrase(seeds, warm_list)}, {base.train.iterations} iterations",
        )
    )
    caption = (
        f"Figure: held-out accuracy (avg@1 on {n_eval} prompts) under sparse inference with {policy} "
        f"at budget B (top axis) against the KV saving measured on the evaluation rollouts, "
        f"for the warm start(s) (black), the dense-trained model (blue) and the {mode} model trained at that "
        "budget (its arm's colour); blue dashed: the dense-trained model under dense inference (the one "
        "dense-inference mark on this axis). "
        + (
            figlib.seeds_caption("Points", seeds, "; the warm start is one model")
            if len(warm_list) == 1
            else f"Points: mean over runs (warm starts {warm_list} x seeds {seeds}; the warm start's over its "
            "warm starts); error bars: ± one sample standard deviation over those, clipped at 0."
        )
    )
    return figlib.Rendered("Figure b: KV saving vs accuracy across budgets", "\n".join(lines), {"budget": fig}, caption)


FIGURE = figlib.Figure(
    "fig_b_budget", __doc__, run, render, arguments, seeds=(0,), warm_starts=(0,), budgets=(16, 24, 32, 48)
)

main = FIGURE.main


if __name__ == "__main__":
    main()
