"""How much does the warm start's robustness to eviction vary with the SFT draw?

  python experiments/figures/warm_start_spread.py                      # seeds 0-3, R-KV budgets 48 and 64
  python experiments/figures/warm_start_spread.py --seeds 0 1 --budgets 48 --smoke

The default experiment's RL arms start from warm starts (SFT with train.seed = k). Their dense
accuracy is stable, but how often R-KV keeps the far-back key (their sparse-inference accuracy) is
a property of the SFT'd weights: this trains one warm start per SFT seed (--seeds; the run cache
of figlib.Study, parallel single-core processes with the portable CPU settings of workers.py: the
same warm starts the figures and the default experiment draw with --warm-starts), evaluates each
under dense inference and under the config's policy at each budget, and writes the spread to
experiments/results/warm_start_spread/.
"""

from __future__ import annotations

import os

from experiments.lib import figlib
from experiments.lib.figlib import fmt

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/


def arguments(p) -> None:
    p.add_argument("--budgets", type=int, nargs="+", default=[48, 64])


def run(args, study) -> dict:
    n = study.base.train.eval_prompts
    evals = [({"policy": "none"}, n)] + [({"budget": b}, n) for b in args.budgets]
    study.train_all([{"warm_start": s} for s in args.seeds], evals)
    rows = []
    for s in args.seeds:
        warm = study.warm_start(warm=s)
        row = {"seed": s, "dense_acc": warm.evaluate({"policy": "none"}, n)["accuracy"]}
        for b in args.budgets:
            ev = warm.evaluate({"budget": b}, n)
            row[f"sparse_acc@{b}"], row[f"kv_saving@{b}"] = ev["accuracy"], ev["kv_saving"]
        rows.append(row)
    return {"rows": rows, "budgets": args.budgets}


def render(data: dict, base, command: str) -> figlib.Rendered:
    rows = data["rows"]
    budgets = data.get("budgets") or [int(k.split("@")[1]) for k in rows[0] if k.startswith("sparse_acc@")]
    cols = ["dense_acc"] + [f"sparse_acc@{b}" for b in budgets]
    lines = [
        f"Warm starts of `{figlib.config_name(command)}` (task {base.data.task}), one per SFT seed "
        f"(train.seed); sparse inference with {base.kv.policy} (buffer {base.kv.buffer}); avg@1 on "
        f"{base.train.eval_prompts} held-out prompts.",
        "",
        *figlib.md_table(
            ["SFT seed", *cols],
            [
                *([str(r["seed"]), *(f"{r[c]:.3f}" for c in cols)] for r in rows),
                ["mean ± std", *(fmt([r[c] for r in rows], ".3f") for c in cols)],
            ],
        ),
    ]
    lines += [
        "",
        "KV saving under sparse inference (mean ± std over the SFT seeds): "
        + ", ".join(f"budget {b}: {fmt([r[f'kv_saving@{b}'] for r in rows], '.1%')}" for b in budgets)
        + ".",
    ]
    fig, ax = figlib.plt.subplots(figsize=(figlib.COLUMN_W, 3.0), layout="constrained")
    for i, c in enumerate(cols):
        vals = [r[c] for r in rows]
        colour = figlib.POLICY_COLOURS["none" if i == 0 else base.kv.policy]
        ax.plot([i] * len(vals), vals, "o", ms=4, color=colour, mfc=colour if i == 0 else "white", alpha=0.8)
        ax.plot([i - 0.2, i + 0.2], [sum(vals) / len(vals)] * 2, "k-", lw=1.5)
    ax.set_xticks(range(len(cols)), ["dense"] + [f"{base.kv.policy}@{b}" for b in budgets])
    ax.set_xlim(-0.5, len(cols) - 0.5)
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel(f"warm start's accuracy\n(avg@1, {base.train.eval_prompts} prompts)")
    ax.set_xlabel("inference")
    fig.suptitle(f"Warm-start spread: {len(rows)} SFT seeds of {figlib.config_name(command)}")
    caption = (
        "Figure: each warm start's accuracy (one dot per SFT seed) under each inference, named under "
        "its column (filled: dense inference; open: sparse inference at each budget, in the eviction "
        "policy's colour); black bar: the mean."
    )
    return figlib.Rendered("Warm-start spread", "\n".join(lines), {"spread": fig}, caption)


FIGURE = figlib.Figure(
    "warm_start_spread",
    __doc__,
    run,
    render,
    arguments,
    seeds=(0, 1, 2, 3),
    seeds_help="SFT seeds (train.seed) of the warm starts",
    eval_prompts=False,
    default_config=os.path.join(HERE, "configs", "walk_key_rkv.yaml"),
)

main = FIGURE.main


if __name__ == "__main__":
    main()
