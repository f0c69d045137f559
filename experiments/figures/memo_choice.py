"""How the models of figure a choose their memo (cycle_walk with `memo`): the letter a response
opens with is the model's free choice, so a policy can make the answer independent of evicted
state by always choosing the same letter. This reports, per model, the entropy of the memo
letter over held-out prompts (uniform over the 25 letters: ln 25 = 3.22 nats) under dense
inference, with the accuracy of the same samples.

  python experiments/figures/memo_choice.py --config experiments/configs/walk_memo.yaml

The models are figure a's runs (same configs, reused from the run cache when present).
"""

from __future__ import annotations

import collections
import dataclasses
import math

from experiments.lib import figlib
from experiments.lib.curves import ARMS
from sparserl_jax.data.tasks.cycle_walk import MEMO_LETTERS


def memo_statistics(responses: list[str]) -> dict:
    """Entropy (nats) of the memo letters of `responses` ("#X\\n" first line; none counts as its
    own outcome), the most frequent letter's share, and how many responses have no memo."""
    letters = [
        r[1] if len(r) > 2 and r[0] == "#" and r[1] in MEMO_LETTERS and r[2] == "\n" else None for r in responses
    ]
    counts = collections.Counter(letters)
    n = len(letters)
    entropy = -sum(c / n * math.log(c / n) for c in counts.values()) if n else float("nan")
    top, top_count = max(counts.items(), key=lambda kv: kv[1]) if n else (None, 0)
    return {
        "entropy": entropy,
        "top_letter": top,
        "top_share": top_count / max(n, 1),
        "no_memo": counts.get(None, 0) / max(n, 1),
    }


def run(args, study) -> dict:
    if not study.base.data.task_options.get("memo"):
        raise ValueError(f"memo_choice needs a cycle_walk config with memo: true ({args.config})")
    policy = study.base.kv.policy
    runs = {"warm start": [study.warm_start()]}
    for arm, (mode, sparse) in ARMS.items():
        runs[arm] = [
            study.arm(f"{arm}/seed{s}", mode=mode, policy=policy if sparse else "none", seed=s) for s in args.seeds
        ]
    rows = {}
    for name, arm_runs in runs.items():
        rows[name] = []
        for run_ in arm_runs:
            kv_cfg = dataclasses.replace(run_.cfg.kv, policy="none")  # the samples, not only the score
            res = run_.trainer(log=lambda *_: None).evaluate(kv_cfg=kv_cfg)
            stats = memo_statistics([s["response"] for s in res["samples"]])
            rows[name].append({"accuracy": res["accuracy"], **stats})
    return {"rows": rows, "seeds": args.seeds}


def render(data: dict, base, command: str) -> figlib.Rendered:
    rows, seeds_ = data["rows"], data["seeds"]
    lines = [
        f"Memo letters of {base.train.eval_prompts} held-out prompts per model under dense "
        f"inference (temperature {base.rollout.temperature}); uniform over {len(MEMO_LETTERS)} "
        f"letters is {math.log(len(MEMO_LETTERS)):.2f} nats. Sparse arms trained with "
        f"{base.kv.policy}@{base.kv.budget} from warm start 0; one row per seed {seeds_}.",
        "",
        "| model | seed | accuracy | memo entropy (nats) | most frequent letter | its share | no memo |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, arm_rows in rows.items():
        seeds = [0] if name == "warm start" else seeds_
        for seed, r in zip(seeds, arm_rows):
            lines.append(
                f"| {name} | {seed} | {r['accuracy']:.3f} | {r['entropy']:.2f} | {r['top_letter']} "
                f"| {r['top_share']:.2f} | {r['no_memo']:.2f} |"
            )
    fig, ax = figlib.plt.subplots(figsize=(figlib.COLUMN_W, 3.2), layout="constrained")
    colours = figlib.arm_colours(rows)  # the warm start: black
    for name, arm_rows in rows.items():
        ax.scatter(
            [r["entropy"] for r in arm_rows], [r["accuracy"] for r in arm_rows], label=name, color=colours[name], s=14
        )
    ax.axvline(math.log(len(MEMO_LETTERS)), color="k", ls="--", lw=0.8)
    ax.set_xlabel("memo-letter entropy (nats)")
    ax.set_ylabel(f"accuracy, dense inference\n(avg@1, {base.train.eval_prompts} prompts)")
    ax.set_ylim(-0.02, 1.02)
    figlib.band_legend_below(fig, ax, ncol=2)
    fig.suptitle(f"Memo choice: {figlib.config_name(command)}, {len(seeds_)} seeds")
    caption = (
        "Figure: each model's (one dot per seed; the warm start black, each arm in its colour of "
        "every figure) memo-letter entropy and accuracy under dense inference; dashed: the uniform "
        "choice's entropy, ln 25."
    )
    return figlib.Rendered(
        "Memo choice: does a policy make its memo predictable?", "\n".join(lines), {"memo_choice": fig}, caption
    )


FIGURE = figlib.Figure("memo_choice", __doc__, run, render, seeds=(0, 1, 2), eval_prompts=False)


def main(argv=None) -> dict:
    return FIGURE.main(argv)["rows"]


if __name__ == "__main__":
    main()
