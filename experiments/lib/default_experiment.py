"""The default experiment: dense vs naive sparse vs Sparse-RL rollouts (figure a's three arms), in the
paper's regime (long responses whose answer needs state written far back), over warm starts and
RL seeds.

  python experiments/default.py            # 3 warm starts x 2 RL seeds, 40 iterations (DEFAULT_*)
  python experiments/default.py --smoke    # seconds, for tests
  python experiments/default.py --warm-starts 0 1 2 --seeds 0 1
  python experiments/default.py --config experiments/configs/default.yaml \
      --out experiments/results/default_kv_recall   # the earlier default: key-value recall
  python experiments/default.py --replot experiments/results/default   # re-render, no training

1. Warm-start (SFT, with a curriculum from short walks) a tiny model on cycle_walk with a memo key
   (experiments/configs/walk_key_rkv.yaml), once per SFT seed of --warm-starts: the prompt names a
   letter, the response writes it first, walks 8-40 labelled steps, and its boxed answer must
   repeat the letter; R-KV at budget 48 + 16 evicts ~47% of the entries a dense cache would hold.
2. From each warm start, with every RL seed of --seeds and the same KV budget, train figure a's
   three arms (fig_a_curves.collect): dense rollouts, naive sparse rollouts (compressed KV, trained
   as if on-policy) and Sparse-RL (compressed KV with rejection sampling and importance
   reweighting). Every run is a single-core process, one per available core (workers.py), so the
   numbers are the same on a machine with 1, 2 or 16 cores. The runs go to <out>/runs, cleared
   first (a fresh experiment; --runs-dir keeps and reuses a cache instead).
3. Evaluate every model under dense and under sparse inference on train.eval_prompts held-out
   prompts, apply both collapse rules and the tie rule (figlib), and write results.md,
   results.json (with a fingerprint of warm start 0: experiments/bench/fingerprint.py), arms.json and
   curves.png to experiments/results/default/.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np

from experiments.lib import curves as fig_a_curves
from experiments.lib import figlib
from experiments.lib.figlib import fmt

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/
CONFIG = os.path.join(HERE, "configs", "walk_key_rkv.yaml")
ARMS = fig_a_curves.ARMS
# Three warm starts (SFT seeds: the draw that moves most between machines) x two RL seeds, 40
# iterations (naive sparse has collapsed by then on every seed of the 50-iteration runs):
# about 20 minutes of 2 cores.
DEFAULT_WARM_STARTS = (0, 1, 2)
DEFAULT_SEEDS = (0, 1)
DEFAULT_OVERRIDES = ("train.iterations=40",)
COLUMNS = (  # (header, row key, format) of the table, around its KV saving column (a percentage)
    ("acc. dense inference", "dense_acc", ".3f"),
    ("acc. sparse inference", "sparse_acc", ".3f"),
    ("token reject (last 25%)", "token_reject_rate", ".3f"),
    ("seq reject (last 25%)", "seq_reject_rate", ".3f"),
    ("mismatch KL (k3)", "mismatch_kl_k3", ".4f"),
    ("train reward (last 25%)", "train_reward_last25", ".3f"),
)
# The per-seed numbers the metrics fingerprint hashes (the default experiment's row before figlib's
# rows; experiments/results/default/fingerprint_smoke.json holds their hash).
_FINGERPRINT_KEYS = {
    "dense_acc": "dense_acc",
    "sparse_acc": "sparse_acc",
    "sparse_kv_saving": "sparse_kv_saving",
    "train_kv_saving": "train_kv_saving",
    "token_reject_rate": "token_reject_rate",
    "seq_reject_rate": "seq_reject_rate",
    "mismatch_kl_k3": "mismatch_kl_k3",
    "final_train_reward": "train_reward_last25",
}


def _sha(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def warm_start_fingerprint(trainer) -> dict:
    """Hashes of the warm start's params and of one sparse rollout from it (the first
    rollout.prompts x samples training prompts, the key of iteration 0, kept sets recorded): two
    machines that agree here made the same eviction decisions from the same weights."""
    import jax

    from sparserl_jax.rollout.on_mesh import generate_on_mesh
    from sparserl_jax.rollout.prompts import pad_prompt_batch

    cfg = trainer.cfg
    examples = trainer.prompts.next_batch()
    ids = [list(e.prompt_ids) for e in examples for _ in range(cfg.rollout.samples)]
    tokens, lengths = pad_prompt_batch(ids, trainer.tokenizer.pad_token_id, cfg.data.max_prompt_len)
    sampler_cfg = dataclasses.replace(trainer.sampler_cfg, record_kept=True)
    out = generate_on_mesh(
        trainer.params,
        trainer.model_cfg,
        tokens,
        lengths,
        jax.random.fold_in(jax.random.key(cfg.train.seed), 0),
        sampler_cfg,
        trainer.mesh,
        request_ids=np.arange(len(ids)),
    )
    return {
        "warm_start_params": _sha(*jax.tree_util.tree_leaves(trainer.params)),
        "first_rollout_tokens": _sha(out.tokens, out.lengths),
        "first_rollout_logprobs": _sha(out.logprobs),
        "first_rollout_kept": _sha(out.kept_positions),
    }


def metrics_fingerprint(data: dict, warm: int | None = None) -> str:
    """One hash of the warm starts' and every arm's per-run metrics, as exact floats; of one warm
    start's (`warm`) alone: the hash of a run with only that warm start (experiments/bench/fingerprint.py's
    is warm start 0's)."""
    keys = ("dense_acc", "sparse_acc", "sparse_kv_saving")
    warms = [
        sorted((k, w[k]) for k in keys) for i, w in sorted(figlib.warm_starts_of(data).items()) if warm in (None, i)
    ]
    rows = [
        [
            arm,
            [
                sorted((k, r[src]) for k, src in _FINGERPRINT_KEYS.items())
                for r in data["per_seed"][arm]
                if warm in (None, r.get("warm_start", 0))
            ],
        ]
        for arm in ARMS
    ]
    head = warms[0] if len(warms) == 1 else warms  # one warm start: the hash of the earlier layout
    return hashlib.sha256(json.dumps([head, rows]).encode()).hexdigest()[:16]


def experiment(study: figlib.Study, seeds=DEFAULT_SEEDS, warms=DEFAULT_WARM_STARTS) -> dict:
    """Every warm start, then every arm x warm start x seed as parallel single-core processes
    (workers.py), evaluated on train.eval_prompts prompts; with the fingerprint of the first warm
    start."""
    data = fig_a_curves.collect(study, seeds, warms, study.base.train.eval_prompts)
    data.pop("arm_overrides")
    trainer = study.warm_start(study.base.kv.policy, warm=warms[0]).trainer(study.log)
    data["fingerprint"] = {**warm_start_fingerprint(trainer), "metrics": metrics_fingerprint(data)}
    data["fingerprint_warm_start"] = warms[0]
    return data


def run(
    config: str, overrides: list[str], out_dir: str, seeds=DEFAULT_SEEDS, warms=DEFAULT_WARM_STARTS, log=print
) -> dict:
    """The experiment's numbers without its outputs, runs in <out_dir>/runs (experiments/bench/fingerprint.py)."""
    return experiment(figlib.Study(config, overrides, os.path.join(out_dir, "runs"), log=log), seeds, warms)


def _upgrade(data: dict) -> dict:
    """A results.json of the default experiment before figlib's layout (results/arm/per_seed),
    as the current layout."""
    if "results" not in data:
        return data
    res = data["results"]
    per_seed = {
        arm: [
            {
                **{k: v for k, v in r.items() if k != "final_train_reward"},
                "train_reward_last25": r["final_train_reward"],
                "seed": s,
            }
            for r, s in zip(res[arm]["per_seed"], res["seeds"])
        ]
        for arm in ARMS
    }
    return {
        "command": data["command"],
        "warm_starts": {"0": res["warm_start"]},
        "seeds": res["seeds"],
        "per_seed": per_seed,
        "histories": data["histories"],
        **({"fingerprint": res["fingerprint"]} if "fingerprint" in res else {}),
        "legacy": {"portable_cpu": res.get("portable_cpu"), "wall_s": res["seconds"]},
    }


def table(per_seed: dict, warms: dict) -> list[str]:
    """One row per warm start and per arm (mean ± std over runs), with both collapse rules."""
    body = [
        [f"warm start {w}", f"{row['dense_acc']:.3f}", f"{row['sparse_acc']:.3f}", *["-"] * 7]
        for w, row in sorted(warms.items())
    ]
    for arm, rows in per_seed.items():
        saving = fmt([100 * r["train_kv_saving"] for r in rows], ".1f")
        body.append(
            [arm, *figlib.stat_cells(rows, COLUMNS[:2]), f"{saving}%", *figlib.arm_cells(rows, COLUMNS[2:], warms)]
        )
    return figlib.md_table(
        [
            "model",
            *figlib.headers(COLUMNS[:2]),
            "KV saving (train rollouts)",
            *figlib.headers(COLUMNS[2:]),
            "collapsed (accuracy rule)",
            "collapsed (reward rule, at iteration)",
        ],
        body,
    )


REPLICATES = "replicates"  # <out>/replicates/<machine>.json: the same command's results.json on another machine


def replicates(out: str) -> dict:
    """{"replicates": {machine: results.json}} from <out>/replicates/ (none: {}): the same command
    run unchanged on other machines, rendered beside this result (figlib.Figure.beside)."""
    folder = os.path.join(out, REPLICATES)
    if not os.path.isdir(folder):
        return {}
    found = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                found[os.path.splitext(name)[0]] = json.load(f)
    return {"replicates": found} if found else {}


def render(data: dict, base, command: str) -> figlib.Rendered:
    replicas = {name: _upgrade(d) for name, d in data.get("replicates", {}).items()}  # other machines' runs
    data = _upgrade(data)
    warms, per_seed = figlib.results_of(data, "per_seed")
    n = base.train.eval_prompts
    kvc = base.kv
    runs = len(next(iter(per_seed.values())))
    lines = [
        f"KV policy for sparse rollouts and sparse inference: {kvc.policy}, budget {kvc.budget}, "
        f"buffer {kvc.buffer}, compress_prompt={kvc.compress_prompt}; task {base.data.task}; "
        f"{base.train.iterations} iterations of {base.rollout.prompts}x{base.rollout.samples} rollouts; "
        f"warm starts (SFT seeds) {sorted(warms)}, RL seeds {data['seeds']} on each: {runs} runs per arm; "
        f"accuracy is avg@1 on {n} held-out prompts (temperature {base.rollout.temperature}).",
        "",
        *table(per_seed, warms),
        "",
        figlib.COLLAPSE_NOTE,
        "",
        f"Mean ± std over {runs} run(s). Sparse inference KV saving: "
        f"{np.mean([r['sparse_kv_saving'] for r in per_seed['sparse_rl']]):.1%} of the entries a dense cache holds.",
        *figlib.per_warm_start_table(per_seed, warms),
        *fig_a_curves.comparisons(per_seed, n),
        *fig_a_curves.verdicts_table({**data, "replicates": replicas}, n, REPLICATES),
    ]
    if "legacy" in data:
        portable = {True: "on", False: "off", None: "not recorded"}[data["legacy"]["portable_cpu"]]
        lines += [
            "",
            f"Recorded by this run: portable CPU settings {portable}, wall time {data['legacy']['wall_s']:.0f} s.",
        ]
    title = figlib.run_title(
        base,
        command,
        data["seeds"],
        "Default experiment: dense vs naive sparse vs Sparse-RL rollouts",
        sorted(warms),
        default_config=CONFIG,
    )
    fig, _ = fig_a_curves.curves_figure(data["histories"], warms, per_seed, base, n, title)
    return figlib.Rendered(
        "Default experiment",
        "\n".join(lines),
        {"curves": fig},
        fig_a_curves.curves_caption(False, base, n, warms, data["seeds"]),
    )


FIGURE = figlib.Figure(
    "default",
    __doc__,
    lambda args, study: experiment(study, args.seeds, figlib.warms_of(args)),
    render,
    seeds=DEFAULT_SEEDS,
    warm_starts=DEFAULT_WARM_STARTS,
    eval_prompts=False,
    default_config=CONFIG,
    fresh_runs=True,
    defaults=DEFAULT_OVERRIDES,
    beside=replicates,
)

main = FIGURE.main
