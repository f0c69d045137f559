"""The default experiment: dense vs naive sparse vs Sparse-RL rollouts from one warm start, in the
paper's regime (long responses whose answer needs state written far back).

  python experiments/default.py            # 2 seeds; about 7 minutes on 2 CPU cores
  python experiments/default.py --smoke    # seconds, for tests
  python experiments/default.py --config experiments/configs/default.yaml \
      --out experiments/results/default_kv_recall   # the earlier default: key-value recall

1. Warm-start (SFT, with a curriculum from short walks) a tiny model on cycle_walk with a memo key
   (experiments/configs/walk_key_rkv.yaml): the prompt names a letter, the response writes it
   first, walks 8-40 labelled steps, and its boxed answer must repeat the letter; R-KV at budget
   48 + 16 evicts ~47% of the entries a dense cache would hold.
2. From that start, with the same seed and KV budget, train three arms: dense rollouts, naive
   sparse rollouts (compressed KV, trained as if on-policy) and Sparse-RL (compressed KV with
   rejection sampling and importance reweighting), each for every seed of --seeds (default 0 1).
   Every run is a single-core process, one per available core (workers.py), so the numbers are
   the same on a machine with 1, 2 or 16 cores.
3. Evaluate every model under dense and under sparse inference, and write a markdown table,
   JSON and a PNG of the training curves to experiments/results/default/.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import workers  # noqa: E402  (imports no JAX)
from figlib import FROM_WARM_START, curve, fmt, mean_std, smoke_overrides  # noqa: E402
import jax  # noqa: E402
from sparserl_jax import components, distributed  # noqa: E402
from sparserl_jax import kvcache as kv  # noqa: E402
from sparserl_jax.config import dump_config, load_config, to_dict  # noqa: E402
from sparserl_jax.train import Trainer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ARMS = {  # arm name -> (rl.mode, sparse rollouts?)
    "dense": ("dense", False),
    "naive_sparse": ("naive_sparse", True),
    "sparse_rl": ("sparse_rl", True),
}
CURVES = ("reward/mean", "response/length_mean", "loss/entropy", "mismatch/kl_k3",
          "sars/token_reject_rate")


def evaluate_both(trainer: Trainer, sparse_kv: kv.KVConfig, n: int) -> dict:
    dense_kv = dataclasses.replace(sparse_kv, policy="none")
    dense = trainer.evaluate(kv_cfg=dense_kv, n=n)
    sparse = trainer.evaluate(kv_cfg=sparse_kv, n=n)
    return {"dense_acc": dense["accuracy"], "sparse_acc": sparse["accuracy"],
            "sparse_kv_saving": sparse["kv_saving"]}


def _sha(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def warm_start_fingerprint(trainer: Trainer) -> dict:
    """Hashes of the warm start's params and of one sparse rollout from it (the first
    rollout.prompts x samples training prompts, the key of iteration 0, kept sets recorded): two
    machines that agree here made the same eviction decisions from the same weights."""
    cfg = trainer.cfg
    examples = trainer.prompts.next_batch()
    ids = [list(e.prompt_ids) for e in examples for _ in range(cfg.rollout.samples)]
    tokens, lengths = components.pad_prompt_batch(ids, trainer.tokenizer.pad_token_id, cfg.data.max_prompt_len)
    sampler_cfg = dataclasses.replace(trainer.sampler_cfg, record_kept=True)
    out = distributed.generate_on_mesh(trainer.params, trainer.model_cfg, tokens, lengths,
                                       jax.random.fold_in(jax.random.key(cfg.train.seed), 0),
                                       sampler_cfg, trainer.mesh, request_ids=np.arange(len(ids)))
    return {"warm_start_params": _sha(*jax.tree_util.tree_leaves(trainer.params)),
            "first_rollout_tokens": _sha(out.tokens, out.lengths),
            "first_rollout_logprobs": _sha(out.logprobs),
            "first_rollout_kept": _sha(out.kept_positions)}


def metrics_fingerprint(results: dict) -> str:
    """One hash of the warm start's and every arm's per-seed metrics, as exact floats."""
    rows = [[arm, [sorted(r.items()) for r in results[arm]["per_seed"]]] for arm in ARMS]
    return hashlib.sha256(json.dumps([sorted(results["warm_start"].items()), rows]).encode()).hexdigest()[:16]


def _warm_start(job) -> dict:
    """Worker: the shared warm start (SFT only, no RL iterations), evaluated and fingerprinted."""
    config, overrides, warm_dir = job
    base = load_config([config], overrides)
    warm = Trainer(load_config([config], overrides + [f"train.out_dir={warm_dir}", "train.iterations=0"]))
    warm.run()
    return {"eval": evaluate_both(warm, base.kv, base.train.eval_prompts),
            "fingerprint": warm_start_fingerprint(warm)}


def _arm(job) -> tuple[dict, list[dict], dict]:
    """Worker: one arm and seed from the warm start, trained and evaluated."""
    config, overrides, warm_dir, out_dir, arm, seed = job
    mode, sparse = ARMS[arm]
    base = load_config([config], overrides)
    policy = base.kv.policy if sparse else "none"
    arm_overrides = [f"model.init_from={warm_dir}", *FROM_WARM_START,
                     f"rl.mode={mode}", f"kv.policy={policy}", f"train.seed={seed}"]
    trainer = Trainer(load_config([config], overrides + [f"train.out_dir={out_dir}", *arm_overrides]))
    history = trainer.run()
    last = history[-max(len(history) // 4, 1):]
    return {
        **evaluate_both(trainer, base.kv, base.train.eval_prompts),
        "train_kv_saving": float(np.mean([h["kv/saving"] for h in history])),
        "token_reject_rate": float(np.mean([h.get("sars/token_reject_rate", 0) for h in last])),
        "seq_reject_rate": float(np.mean([h.get("sars/seq_reject_rate", 0) for h in last])),
        "mismatch_kl_k3": float(np.mean([h["mismatch/kl_k3"] for h in history])),
        "final_train_reward": float(np.mean([h["reward/mean"] for h in last])),
    }, history, {"overrides": arm_overrides, "config": to_dict(trainer.cfg)}


def run(config: str, overrides: list[str], out_dir: str, seeds=(0, 1, 2, 3, 4), log=print) -> dict:
    """The warm start, then every arm x seed as parallel single-core processes (workers.py): the
    numbers do not depend on how many cores the machine has."""
    base = load_config([config], overrides)
    work = os.path.join(out_dir, "runs")
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.perf_counter()
    warm_dir = os.path.join(work, "warm_start")
    warm = workers.parallel_map(_warm_start, [(config, overrides, warm_dir)])[0]
    results = {"seeds": list(seeds), "warm_start": warm["eval"]}
    log(f"warm start: {results['warm_start']}  ({time.perf_counter() - t0:.0f}s)")
    jobs = [(config, overrides, warm_dir, os.path.join(work, f"{arm}_seed{s}"), arm, s)
            for arm in ARMS for s in seeds]
    outs = workers.parallel_map(_arm, jobs)
    histories, resolved = {}, {}
    for arm in ARMS:
        per_seed = [out for job, out in zip(jobs, outs) if job[4] == arm]
        rows = [r for r, _, _ in per_seed]
        results[arm] = {key: mean_std(r[key] for r in rows)[0] for key in rows[0]}
        results[arm]["std"] = {key: mean_std(r[key] for r in rows)[1] for key in rows[0]}
        results[arm]["per_seed"] = rows
        histories[arm] = [h for _, h, _ in per_seed]
        resolved[arm] = [c for _, _, c in per_seed]
        log(f"{arm}: {results[arm]['per_seed']}")
    results["fingerprint"] = {**warm["fingerprint"], "metrics": metrics_fingerprint(results)}
    results["portable_cpu"] = workers.portable_cpu_enabled()
    results["seconds"] = time.perf_counter() - t0
    dump_config(base, os.path.join(out_dir, "config.yaml"))
    write_outputs(results, histories, base, out_dir)
    with open(os.path.join(out_dir, "arms.json"), "w") as f:  # every run's resolved config
        json.dump({"base_overrides": overrides, "arms": resolved}, f, indent=1)
    return results


COLLAPSE = 0.5  # a seed collapsed: final dense-inference accuracy < COLLAPSE x the warm start's


def collapsed(rows: list[dict], warm: dict) -> int:
    return sum(r["dense_acc"] < COLLAPSE * warm["dense_acc"] for r in rows)


def table(results: dict, base) -> str:
    kvc = base.kv
    lines = [
        f"KV policy for sparse rollouts and sparse inference: {kvc.policy}, budget {kvc.budget}, "
        f"buffer {kvc.buffer}, compress_prompt={kvc.compress_prompt}; task {base.data.task}; "
        f"{base.train.iterations} iterations of {base.rollout.prompts}x{base.rollout.samples} rollouts; "
        f"accuracy is avg@1 on {base.train.eval_prompts} held-out prompts (temperature "
        f"{base.rollout.temperature}).",
        "",
        "| model | acc. dense inference | acc. sparse inference | KV saving (train rollouts) "
        "| token reject | seq reject | mismatch KL (k3) | train reward (last 25%) | collapsed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    w = results["warm_start"]
    lines.append(f"| warm start | {w['dense_acc']:.3f} | {w['sparse_acc']:.3f} | - | - | - | - | - | - |")
    for arm in ARMS:
        rows = results[arm]["per_seed"]
        col = lambda key, spec=".3f": fmt([r[key] for r in rows], spec)  # noqa: E731
        saving = fmt([100 * r["train_kv_saving"] for r in rows], ".1f")
        lines.append(
            f"| {arm} | {col('dense_acc')} | {col('sparse_acc')} | {saving}% "
            f"| {col('token_reject_rate')} | {col('seq_reject_rate')} | {col('mismatch_kl_k3', '.4f')} "
            f"| {col('final_train_reward')} | {collapsed(rows, w)} of {len(rows)} |"
        )
    seeds = results["seeds"]
    lines.append("")
    lines.append(f"A seed has collapsed when its dense-inference accuracy ends below {COLLAPSE:.0%} of the "
                 "warm start's (decided before the 5-seed run).")
    lines.append(f"Mean ± std over {len(seeds)} seed(s) (train.seed {', '.join(map(str, seeds))}; one "
                 "shared warm start). Sparse inference KV saving: "
                 f"{results['sparse_rl']['sparse_kv_saving']:.1%} of the entries a dense cache holds. "
                 f"Wall time: {results['seconds']:.0f} s on {len(workers.available_cores())} core(s).")
    return "\n".join(lines)


def write_outputs(results: dict, histories: dict, base, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    md = table(results, base)
    command = "python " + " ".join(sys.argv)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(f"# Default experiment\n\nCommand: `{command}`\n\n{md}\n")
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"command": command, "results": results, "histories": histories}, f, indent=1)
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3.2))
    for ax, key in zip(axes, CURVES):
        for arm, hists in histories.items():
            x, m, sd = curve(hists, key)
            (line,) = ax.plot(x, m, label=arm)
            ax.fill_between(x, m - sd, m + sd, alpha=0.2, color=line.get_color())  # the line's colour
        ax.set_title(key)
        ax.set_xlabel("iteration")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "curves.png"), dpi=110)
    plt.close(fig)
    print(md)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(HERE, "configs", "walk_key_rkv.yaml"))
    p.add_argument("--out", default=os.path.join(HERE, "results", "default"))
    p.add_argument("--smoke", action="store_true", help="a seconds-long run (tests)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="train.seed of every arm")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    overrides = list(args.overrides)
    if args.smoke:
        overrides += [*smoke_overrides(args.config, overrides), "train.progress=false"]
    return run(args.config, overrides, args.out, seeds=args.seeds)


if __name__ == "__main__":
    main()
