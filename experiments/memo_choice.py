"""How the models of figure a choose their memo (cycle_walk with `memo`): the letter a response
opens with is the model's free choice, so a policy can make the answer independent of evicted
state by always choosing the same letter. This reports, per model, the entropy of the memo
letter over held-out prompts (uniform over the 25 letters: ln 25 = 3.22 nats) under dense
inference, with the accuracy of the same samples.

  python experiments/memo_choice.py --config experiments/configs/walk_memo.yaml

The models are figure a's runs (same configs, reused from the run cache when present).
"""

from __future__ import annotations

import collections
import dataclasses
import math

import figlib
from fig_a_curves import ARMS
from sparserl_jax.data.tasks.cycle_walk import MEMO_LETTERS


def memo_statistics(responses: list[str]) -> dict:
    """Entropy (nats) of the memo letters of `responses` ("#X\\n" first line; none counts as its
    own outcome), the most frequent letter's share, and how many responses have no memo."""
    letters = [r[1] if len(r) > 2 and r[0] == "#" and r[1] in MEMO_LETTERS and r[2] == "\n" else None
               for r in responses]
    counts = collections.Counter(letters)
    n = len(letters)
    entropy = -sum(c / n * math.log(c / n) for c in counts.values()) if n else float("nan")
    top, top_count = max(counts.items(), key=lambda kv: kv[1]) if n else (None, 0)
    return {"entropy": entropy, "top_letter": top, "top_share": top_count / max(n, 1),
            "no_memo": counts.get(None, 0) / max(n, 1)}


def main(argv=None) -> dict:
    p = figlib.parser(__doc__)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = p.parse_args(argv)
    study = figlib.study_from_args(args)
    if not study.base.data.task_options.get("memo"):
        raise ValueError(f"memo_choice needs a cycle_walk config with memo: true ({args.config})")
    out = args.out or figlib.default_out("memo_choice", args.config)
    policy = study.base.kv.policy
    runs = {"warm start": [study.warm_start()]}
    for arm, (mode, sparse) in ARMS.items():
        runs[arm] = [study.arm(f"{arm}/seed{s}", mode=mode, policy=policy if sparse else "none", seed=s)
                     for s in args.seeds]
    rows = {}
    for name, arm_runs in runs.items():
        rows[name] = []
        for run in arm_runs:
            kv_cfg = dataclasses.replace(run.cfg.kv, policy="none")  # the samples, not only the score
            res = run.trainer(log=lambda *_: None).evaluate(kv_cfg=kv_cfg)
            stats = memo_statistics([s["response"] for s in res["samples"]])
            rows[name].append({"accuracy": res["accuracy"], **stats})
    lines = [
        f"Memo letters of {study.base.train.eval_prompts} held-out prompts per model under dense "
        f"inference (temperature {study.base.rollout.temperature}); uniform over {len(MEMO_LETTERS)} "
        f"letters is {math.log(len(MEMO_LETTERS)):.2f} nats. Sparse arms trained with "
        f"{policy}@{study.base.kv.budget}; one row per seed {args.seeds}.",
        "",
        "| model | seed | accuracy | memo entropy (nats) | most frequent letter | its share | no memo |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, arm_rows in rows.items():
        seeds = [0] if name == "warm start" else args.seeds
        for seed, r in zip(seeds, arm_rows):
            lines.append(f"| {name} | {seed} | {r['accuracy']:.3f} | {r['entropy']:.2f} | {r['top_letter']} "
                         f"| {r['top_share']:.2f} | {r['no_memo']:.2f} |")
    fig, ax = figlib.plt.subplots(figsize=(5, 3.2))
    for i, (name, arm_rows) in enumerate(rows.items()):
        ax.scatter([r["entropy"] for r in arm_rows], [r["accuracy"] for r in arm_rows], label=name,
                   color=f"C{i}")
    ax.axvline(math.log(len(MEMO_LETTERS)), color="k", ls="--", lw=0.8)
    ax.set_xlabel("memo entropy (nats)")
    ax.set_ylabel("accuracy (dense inference)")
    ax.legend(fontsize=7)
    figlib.write_outputs(out, "Memo choice: does a policy make its memo predictable?", "\n".join(lines),
                         {"rows": rows, "seeds": args.seeds}, fig, "memo_choice", study)
    return rows


if __name__ == "__main__":
    main()
