"""Calibrate a task for the Sparse-RL figures: does its warm start solve the task with a dense
cache, and how much worse with eviction? (Run this before spending CPU on figures a-e.)

  python experiments/calibrate_task.py --config experiments/configs/walk_recall.yaml
  python experiments/calibrate_task.py --config X.yaml --policies snapkv rkv --budgets 32 64 sft.steps=800

The shared warm start of the config (figlib.Study, cached in runs/figures like every figure's) is
evaluated under dense inference and under each policy@budget (accuracy, KV saving, response
length); one RL iteration of naive sparse rollouts at the config's own policy and budget gives
the warm start's per-token mismatch KL(k3) between the sparse sampler and the dense policy and
the rollout diagnostics (loop fraction). A warm start is usable when its dense accuracy is well
above chance and sparse inference at the figure budgets is measurably lower but not zero (else
the sparse arms see no reward and nothing trains).
"""

from __future__ import annotations

import figlib
from figlib import fmt


def main(argv=None) -> dict:
    p = figlib.parser(__doc__)
    p.add_argument("--policies", nargs="+", default=["snapkv", "rkv", "streaming"])
    p.add_argument("--budgets", type=int, nargs="+", default=[32, 48, 64, 96])
    args = p.parse_args(argv)
    study = figlib.study_from_args(args)
    out = args.out or figlib.default_out("calibration", args.config)
    warm = study.warm_start()
    dense = warm.evaluate({"policy": "none"})
    cells = {f"{pol}@{b}": warm.evaluate({"policy": pol, "budget": b})
             for pol in args.policies for b in args.budgets}
    first = study.arm("calibration/naive_sparse", mode="naive_sparse", policy=study.base.kv.policy,
                      extra=["train.iterations=1"]).history[0]
    mismatch = {k: first.get(k, float("nan")) for k in
                ("mismatch/kl_k3", "diag/loop_fraction", "reward/mean", "response/length_mean")}

    kvc = study.base.kv
    lines = [
        f"Task {study.base.data.task} {study.base.data.task_options}; warm start: "
        f"{study.base.sft.curriculum.steps} curriculum SFT steps "
        f"{dict(study.base.sft.curriculum.task_options)} + {study.base.sft.steps} SFT steps; "
        f"avg@1 on {study.base.train.eval_prompts} held-out prompts "
        f"at temperature {study.base.rollout.temperature}, buffer {kvc.buffer}, "
        f"compress_prompt={kvc.compress_prompt}.",
        "",
        "| inference | accuracy | KV saving | response length |",
        "|---|---|---|---|",
        f"| dense | {dense['accuracy']:.3f} | 0.0% | {dense['mean_length']:.1f} |",
        *(f"| {name} | {r['accuracy']:.3f} | {r['kv_saving']:.1%} | {r['mean_length']:.1f} |"
          for name, r in cells.items()),
        "",
        f"First naive-sparse rollout from the warm start ({kvc.policy}@{kvc.budget}): mismatch "
        f"KL(k3) {fmt([mismatch['mismatch/kl_k3']], '.4f')} per token, reward "
        f"{fmt([mismatch['reward/mean']])}, responses in a loop {fmt([mismatch['diag/loop_fraction']])}, "
        f"length {fmt([mismatch['response/length_mean']], '.1f')}.",
    ]
    fig, ax = figlib.plt.subplots(figsize=(5, 3.4))
    for pol in args.policies:
        rows = [cells[f"{pol}@{b}"] for b in args.budgets]
        ax.plot([r["kv_saving"] for r in rows], [r["accuracy"] for r in rows], "o-", label=pol)
    ax.axhline(dense["accuracy"], color="k", ls="--", label="dense")
    ax.set_xlabel("KV saving")
    ax.set_ylabel("accuracy (warm start)")
    ax.legend(fontsize=7)
    data = {"dense": dense, "sparse": cells, "first_sparse_rollout": mismatch}
    figlib.write_outputs(out, "Task calibration: the warm start under dense and sparse inference",
                         "\n".join(lines), data, fig, "calibration", study)
    return data


if __name__ == "__main__":
    main()
