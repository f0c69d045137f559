"""Calibrate a task for the Sparse-RL figures: does its warm start solve the task with a dense
cache, and how much worse with eviction? (Run this before spending CPU on figures a-e.)

  python experiments/figures/calibrate_task.py --config experiments/configs/walk_recall.yaml
  python experiments/figures/calibrate_task.py --config X.yaml sft.steps=800 --policies snapkv rkv --budgets 32 64

The shared warm start of the config (figlib.Study, cached in runs/figures like every figure's) is
evaluated under dense inference and under each policy@budget (accuracy, KV saving, response
length); one RL iteration of naive sparse rollouts at the config's own policy and budget gives
the warm start's per-token mismatch KL(k3) between the sparse sampler and the dense policy and
the rollout diagnostics (loop fraction). A warm start is usable when its dense accuracy is well
above chance and sparse inference at the figure budgets is measurably lower but not zero (else
the sparse arms see no reward and nothing trains).
"""

from __future__ import annotations

from experiments.lib import figlib
from experiments.lib.figlib import fmt


def arguments(p) -> None:
    p.add_argument("--policies", nargs="+", default=["snapkv", "rkv", "streaming"])
    p.add_argument("--budgets", type=int, nargs="+", default=[32, 48, 64, 96])


def run(args, study) -> dict:
    warm = study.warm_start()
    dense = warm.evaluate({"policy": "none"})
    cells = {f"{pol}@{b}": warm.evaluate({"policy": pol, "budget": b}) for pol in args.policies for b in args.budgets}
    first = study.arm(
        "calibration/naive_sparse", mode="naive_sparse", policy=study.base.kv.policy, extra=["train.iterations=1"]
    ).history[0]
    mismatch = {
        k: first.get(k, float("nan"))
        for k in ("mismatch/kl_k3", "diag/loop_fraction", "reward/mean", "response/length_mean")
    }
    return {"dense": dense, "sparse": cells, "first_sparse_rollout": mismatch}


def render(data: dict, base, command: str) -> figlib.Rendered:
    dense, cells, mismatch = data["dense"], data["sparse"], data["first_sparse_rollout"]
    kvc = base.kv
    lines = [
        f"Task {base.data.task} {base.data.task_options}; warm start 0: "
        f"{base.sft.curriculum.steps} curriculum SFT steps "
        f"{dict(base.sft.curriculum.task_options)} + {base.sft.steps} SFT steps; "
        f"avg@1 on {base.train.eval_prompts} held-out prompts "
        f"at temperature {base.rollout.temperature}, buffer {kvc.buffer}, "
        f"compress_prompt={kvc.compress_prompt}.",
        "",
        "| inference | accuracy | KV saving | response length |",
        "|---|---|---|---|",
        f"| dense | {dense['accuracy']:.3f} | 0.0% | {dense['mean_length']:.1f} |",
        *(
            f"| {name} | {r['accuracy']:.3f} | {r['kv_saving']:.1%} | {r['mean_length']:.1f} |"
            for name, r in cells.items()
        ),
        "",
        f"First naive-sparse rollout from the warm start ({kvc.policy}@{kvc.budget}): mismatch "
        f"KL(k3) {fmt([mismatch['mismatch/kl_k3']], '.4f')} per token, reward "
        f"{fmt([mismatch['reward/mean']])}, responses in a loop {fmt([mismatch['diag/loop_fraction']])}, "
        f"length {fmt([mismatch['response/length_mean']], '.1f')}.",
    ]
    fig, ax = figlib.plt.subplots(figsize=(figlib.COLUMN_W, 3.2), layout="constrained")
    policies = list(dict.fromkeys(name.split("@")[0] for name in cells))
    for pol in policies:
        rows = [r for name, r in cells.items() if name.split("@")[0] == pol]
        ax.plot(
            [100 * r["kv_saving"] for r in rows],
            [r["accuracy"] for r in rows],
            "o-",
            ms=3,
            label=pol,
            color=figlib.POLICY_COLOURS.get(pol, "black"),
        )
    ax.axhline(dense["accuracy"], color=figlib.POLICY_COLOURS["none"], ls="--", label="dense inference")
    ax.set_xlabel("KV saving (% of the dense cache's entries not kept)")
    ax.set_ylabel(f"warm start's accuracy\n(avg@1, {base.train.eval_prompts} prompts)")
    ax.set_ylim(-0.02, 1.02)
    figlib.band_legend_below(fig, ax)
    fig.suptitle(f"Calibration: {figlib.config_name(command)}, warm start 0 under eviction")
    caption = (
        "Figure: the warm start's held-out accuracy under each eviction policy at each budget "
        "against the KV saving it gives (one line per policy, its points the budgets); blue dashed: "
        "dense inference, the one dense mark on this axis. One model, one evaluation per point."
    )
    return figlib.Rendered(
        "Task calibration: the warm start under dense and sparse inference",
        "\n".join(lines),
        {"calibration": fig},
        caption,
    )


FIGURE = figlib.Figure("calibration", __doc__, run, render, arguments, seeds=None, eval_prompts=False)

main = FIGURE.main


if __name__ == "__main__":
    main()
