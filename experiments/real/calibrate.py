"""Calibrate a task on a real checkpoint before RL: does the model partly solve it (GRPO groups with
mixed rewards), how long does it answer, and what does sparse (KV-evicted) inference cost?

  python experiments/real/calibrate.py --config experiments/configs/real/smollm2_chat_arithmetic.yaml
  python experiments/real/calibrate.py --config X.yaml --arms greedy --dense-only data.task_options.max_value=20

On --prompts held-out task prompts (the evaluation seed stream, in the config's chat template):
greedy accuracy, sampled accuracy at the rollout temperature with --samples responses per prompt
(the fraction of prompts whose group has mixed rewards, i.e. a non-zero GRPO advantage), the
response length distribution and the answer format; all with the dense cache and with the config's
kv.policy at each --budgets (default the config's kv.budget), buffer kv.buffer (KV saving = 1 -
kept / dense entries behind each generated token). `key=value` overrides change the config (a
difficulty setting, rollout.max_new_tokens). Every call appends one run to results.json in --out
(default experiments/results/real/calibration/<task>/) and re-renders results.md from all runs,
so the settings tried (failures too) stay side by side; --fresh starts a new file. One process,
arms one after the other: pin it to one core (taskset -c 0) for the numbers of the other
experiments (experiments/lib/workers.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time

import numpy as np

from experiments.lib import figprov  # the provenance sentence every results.md carries

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

TARGET = (0.2, 0.6)  # greedy accuracy wanted before RL (runs 1-8: the 4-iteration RL study's setting)

# The collapse study's setting must meet every one of these on the untrained model before any RL
# run (declared 2026-11-26, before the first calibration of them): a training signal that exists
# for dense and sparse rollouts alike, the paper's regime for the cache (the question itself kept),
# and a mismatch the corrections have to repair. (name, what it reads, the test.)
STUDY_TARGETS = (
    (
        "dense reward 0.25-0.75",
        "sampled dense accuracy at the rollout temperature",
        lambda c: 0.25 <= c["dense_reward"] <= 0.75,
    ),
    ("mixed >= 50%", "sampled dense groups with mixed rewards (a GRPO signal)", lambda c: c["dense_mixed"] >= 0.5),
    (
        "sparse >= half dense",
        "sampled sparse accuracy over sampled dense",
        lambda c: c["sparse_reward"] >= 0.5 * c["dense_reward"],
    ),
    ("budget > prompt", "kv.budget over the longest prompt (tokens)", lambda c: c["budget"] > c["prompt_max"]),
    ("KV saving >= 30%", "sampled sparse KV saving", lambda c: c["kv_saving"] >= 0.30),
    ("k3 >= 0.02", "KL k3 per token, sparse sampler vs the dense model", lambda c: c["k3"] >= 0.02),
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", action="append", required=True, help="YAML file(s), merged in order")
    p.add_argument("overrides", nargs="*", help="key=value settings, e.g. data.task_options.max_value=20")
    p.add_argument("--prompts", type=int, default=128, help="held-out task prompts")
    p.add_argument("--samples", type=int, default=4, help="sampled responses per prompt (a GRPO group)")
    p.add_argument("--arms", nargs="+", default=["greedy", "sampled"], choices=["greedy", "sampled"])
    p.add_argument(
        "--budgets",
        type=int,
        nargs="+",
        default=None,
        help="sparse budgets of kv.policy (default: the config's kv.budget)",
    )
    p.add_argument("--dense-only", action="store_true", help="no sparse arms (a quick difficulty check)")
    p.add_argument("--rows-per-call", type=int, default=64, help="responses per sampler call")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default train.seed + 1)")
    p.add_argument("--note", default="", help="a sentence stored with the run (shown in results.md)")
    p.add_argument("--out", help="default experiments/results/real/calibration/<task>")
    p.add_argument("--fresh", action="store_true", help="start a new results.json instead of appending")
    p.add_argument("--rerender", action="store_true", help="only rewrite results.md from results.json")
    args = p.parse_intermixed_args(argv)  # key=value overrides may follow any option
    for name in ("prompts", "samples", "rows_per_call"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    return args


def load(args):
    """The config (a relative model.checkpoint read from the repository root when it is not
    found from here) and its model."""
    from sparserl_jax import components
    from sparserl_jax.config import load_config

    cfg = load_config(args.config, args.overrides)
    if not cfg.data.task:
        raise ValueError("calibrate.py measures a synthetic task: the config needs data.task")
    ckpt = cfg.model.checkpoint
    if ckpt and not os.path.isdir(ckpt) and os.path.isdir(os.path.join(REPO, ckpt)):
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, checkpoint=os.path.join(REPO, ckpt)))
    if not cfg.model.checkpoint or not os.path.isdir(cfg.model.checkpoint):
        raise FileNotFoundError(
            f"model.checkpoint={cfg.model.checkpoint!r} is not a directory; fetch it with python -m "
            "sparserl_jax.fetch smollm2-135m-instruct --out checkpoints/smollm2-135m"
        )
    return cfg, components.build_model(cfg)


def group_stats(rewards: np.ndarray) -> dict:
    """rewards [prompts, k]: mixed groups (0 < sum < k: a non-zero GRPO advantage), all right, all wrong."""
    solved = rewards.sum(axis=1)
    k = rewards.shape[1]
    return {
        "mixed": float(np.mean((solved > 0) & (solved < k))),
        "all_right": float(np.mean(solved == k)),
        "all_wrong": float(np.mean(solved == 0)),
        "pass_at_k": float(np.mean(solved > 0)),
    }


def length_stats(lengths: np.ndarray, max_new: int) -> dict:
    q = np.percentile(lengths, [10, 25, 50, 75, 90])
    return {
        "mean": float(lengths.mean()),
        "p10": float(q[0]),
        "p25": float(q[1]),
        "p50": float(q[2]),
        "p75": float(q[3]),
        "p90": float(q[4]),
        "max": int(lengths.max()),
        "at_cap": float(np.mean(lengths >= max_new)),
        "ge_128": float(np.mean(lengths >= 128)),
    }


def format_stats(task, responses: list[str]) -> dict:
    """How the responses state their answer: a \\boxed{}, another final answer the task's reward
    reads (e.g. "The answer is N"), or none."""
    from sparserl_jax.data.rewards import extract_boxed

    boxed = [extract_boxed(r) is not None for r in responses]
    final = getattr(task, "final_answer", extract_boxed)
    found = [final(r) is not None for r in responses]
    return {"boxed": float(np.mean(boxed)), "answer_found": float(np.mean(found))}


class DenseScorer:
    """evaluate_examples' on_rollout hook: the dense model's teacher-forced log-probs (pi_old of the
    untrained model) of every sampled token at the sampling temperature; `mismatch()` then gives
    what the first RL iteration's corrections would see (measure.mismatch_numbers: k3, SARS
    rejection at the authors' settings, xi quantiles)."""

    def __init__(self, parts, temperature: float):
        from sparserl_jax.rl.config import UpdateConfig
        from sparserl_jax.rl.update import make_score_fn

        self.parts = parts
        self.score = make_score_fn(parts.model_cfg, UpdateConfig(temperature=temperature, score_batch_size=16))
        self.rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def __call__(self, prompt_tokens, prompt_lens, out) -> None:
        import jax
        import jax.numpy as jnp

        from sparserl_jax.rl.batch import assemble

        batch = assemble(
            jnp.asarray(prompt_tokens),
            jnp.asarray(prompt_lens),
            jnp.asarray(out.tokens),
            jnp.asarray(out.logprobs),
            jnp.asarray(out.mask),
            pad_token_id=self.parts.tokenizer.pad_token_id,
        )
        old = self.score(self.parts.params, batch["tokens"])
        self.rows.append(jax.device_get((old, batch["sampler_logp"], batch["response_mask"])))

    def mismatch(self) -> dict:
        from experiments.real import measure

        width = max(r[0].shape[1] for r in self.rows)

        def cat(i: int, fill) -> np.ndarray:
            return np.concatenate(
                [np.pad(r[i], ((0, 0), (0, width - r[i].shape[1])), constant_values=fill) for r in self.rows]
            )

        res = measure.mismatch_numbers(cat(0, 0.0), cat(1, 0.0), cat(2, False))
        res.pop("min_log_xi")
        return res


def measure_arm(cfg, parts, examples, *, name: str, kv_cfg, temperature: float, k: int, seed: int, rows: int) -> dict:
    from sparserl_jax import components
    from sparserl_jax.evaluate import evaluate_examples
    from sparserl_jax.rollout.sampling import SamplingConfig

    t0 = time.perf_counter()
    sampler = components.sampler_config(cfg, parts.tokenizer, kv_cfg=kv_cfg, sampling=SamplingConfig(temperature))
    # a sampled sparse arm: the mismatch its rollouts would carry into RL
    scorer = DenseScorer(parts, temperature) if k > 1 and not kv_cfg.is_dense else None
    res = evaluate_examples(
        parts.params,
        parts.model_cfg,
        parts.tokenizer,
        examples,
        parts.reward,
        sampler,
        k=k,
        seed=seed,
        batch_size=rows,
        max_prompt_len=cfg.data.max_prompt_len,
        on_rollout=scorer,
    )
    rewards = np.array([s["reward"] for s in res["samples"]]).reshape(len(examples), k)
    lengths = np.array([s["length"] for s in res["samples"]])
    responses = [s["response"] for s in res["samples"]]
    out = {
        "name": name,
        "policy": kv_cfg.policy,
        "budget": None if kv_cfg.is_dense else kv_cfg.budget,
        "temperature": temperature,
        "k": k,
        "accuracy": res["accuracy"],
        "kv_saving": res["kv_saving"],
        "lengths": length_stats(lengths, cfg.rollout.max_new_tokens),
        "format": format_stats(parts.task, responses),
        "nonfinite_rows": res["nonfinite_rows"],
        "rewards": rewards.tolist(),
        "response_lengths": lengths.tolist(),
        "wall_s": time.perf_counter() - t0,
    }
    if scorer is not None:
        out["mismatch"] = scorer.mismatch()
    if k > 1:
        out["groups"] = group_stats(rewards)
    out["responses"] = responses  # kept for reading (and re-scoring)
    print(
        f"  {name}: accuracy {out['accuracy']:.3f}"
        + (f", mixed groups {out['groups']['mixed']:.3f}" if k > 1 else "")
        + f", mean length {out['lengths']['mean']:.1f}, KV saving {out['kv_saving']:.1%}"
        + (f", k3 {out['mismatch']['kl_k3']:.3f}" if scorer is not None else "")
        + f", {out['wall_s']:.0f} s",
        flush=True,
    )
    return out


def run(args, argv=None, save=lambda run_data: None) -> dict:
    from sparserl_jax import components

    cfg, parts = load(args)
    examples = components.eval_examples(cfg, parts.tokenizer, n=args.prompts)
    budgets = [] if args.dense_only else [cfg.kv.budget] if args.budgets is None else args.budgets
    policy = cfg.kv.policy if not cfg.kv.is_dense else "rkv"
    kvs = [("dense", dataclasses.replace(cfg.kv, policy="none"))] + [
        (f"{policy}@{b}", dataclasses.replace(cfg.kv, policy=policy, budget=b)) for b in budgets
    ]
    seed = cfg.train.seed + 1 if args.seed is None else args.seed
    t0 = time.perf_counter()
    arms = []
    prompt_lens = [len(e.prompt_ids) for e in examples]
    run_data = {
        "command": shlex.join(["python", "experiments/real/calibrate.py", *(sys.argv[1:] if argv is None else argv)]),
        "note": args.note,
        "task": cfg.data.task,
        "task_options": dict(cfg.data.task_options),
        "checkpoint": os.path.basename(os.path.normpath(cfg.model.checkpoint)),
        "prompts": args.prompts,
        "samples": args.samples,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "temperature": cfg.rollout.temperature,
        "kv": {
            "policy": policy,
            "budgets": budgets,
            "buffer": cfg.kv.buffer,
            "window": cfg.kv.window,
            "selection": cfg.kv.selection,
            "compress_prompt": cfg.kv.compress_prompt,
        },
        "prompt_tokens": {
            "mean": float(np.mean(prompt_lens)),
            "min": int(min(prompt_lens)),
            "max": int(max(prompt_lens)),
        },
        "example_prompt": examples[0].prompt,
        "first_label": examples[0].label,
        "seed": seed,
        "cores": len(os.sched_getaffinity(0)),
        "wall_s": 0.0,
        "arms": arms,
    }
    # the commit and tree at the run's start: the first save below writes into the tree
    start = figprov.provenance(os.sched_getaffinity(0), None)
    for mode in args.arms:
        temp, k = (0.0, 1) if mode == "greedy" else (cfg.rollout.temperature, args.samples)
        for kv_name, kv_cfg in kvs:
            arms.append(
                measure_arm(
                    cfg,
                    parts,
                    examples,
                    name=f"{mode} {kv_name}",
                    kv_cfg=kv_cfg,
                    temperature=temp,
                    k=k,
                    seed=seed,
                    rows=args.rows_per_call,
                )
            )
            dense_greedy = arms[0] if arms[0]["name"] == "greedy dense" else None
            if k == 1 and dense_greedy is not None and arms[-1] is not dense_greedy:
                # how often eviction changes the greedy answer text
                arms[-1]["same_as_dense"] = float(
                    np.mean([x == y for x, y in zip(arms[-1]["responses"], dense_greedy["responses"])])
                )
            run_data["wall_s"] = time.perf_counter() - t0
            run_data["provenance"] = {**start, "wall_s": round(run_data["wall_s"], 1)}
            save(run_data)  # after every arm: a stopped run keeps the arms it finished
    return run_data


# ----------------------------------------------------------------------------- report


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _arm(r: dict, name: str) -> dict | None:
    return next((a for a in r["arms"] if a["name"] == name), None)


def _budget(a: dict) -> str:
    return f"{a['policy']}@{a['budget']}"


def _acc(a: dict | None) -> str:
    """accuracy, and (mixed-group fraction) for a sampled arm"""
    if a is None:
        return "-"
    return f"{a['accuracy']:.3f}" + (f" ({a['groups']['mixed']:.2f})" if "groups" in a else "")


def _accs(arms: list[dict]) -> str:
    return "<br>".join(f"{_budget(a)}: {_acc(a)}" for a in arms) or "-"


def _options(r: dict) -> str:
    """The task options of a run; a changed instruction is quoted (the default is not shown)."""
    from sparserl_jax.data.tasks import TASKS

    default = getattr(TASKS.get(r["task"]), "instruction", None)
    return (
        ", ".join(
            f'{k}="{v}"' if k == "instruction" else f"{k}={v}"
            for k, v in r["task_options"].items()
            if not (k == "instruction" and v == default)
        )
        or "defaults"
    )


def _run_span(numbers: list[int]) -> str:
    """'Run 3. ' or 'Runs 1-8. ': the runs a sentence speaks of (consecutive: the earliest ones)."""
    return f"Run {numbers[0]}. " if len(numbers) == 1 else f"Runs {numbers[0]}-{numbers[-1]}. "


def render(runs: list[dict], results_json: str | None = None) -> str:
    first = runs[0]
    legacy = [i for i, r in enumerate(runs, 1) if "provenance" not in r]
    lines = [
        f"# Calibration: {first['task']} on {first['checkpoint']}",
        "",
        *([_run_span(legacy) + figprov.provenance_line({}, results_json), ""] if legacy else []),
        "Held-out task prompts (the evaluation seed stream) in the checkpoint's chat template, e.g.",
        "",
        "```",
        first["example_prompt"],
        "```",
        "",
        f"Target before RL: greedy accuracy in {TARGET[0]:.0%}-{TARGET[1]:.0%} with many sampled groups "
        "of mixed rewards (a prompt whose samples are all right or all wrong gives GRPO no signal), "
        "responses long enough for eviction to bite, and a sparse budget with a KV saving >= 40%. "
        "Greedy = temperature 0; sampled = the rollout temperature, k responses per prompt; mixed = "
        "the fraction of prompts whose k rewards are not all equal. KV saving = 1 - kept / dense "
        "entries behind each generated token.",
        "",
        "## Every setting tried",
        "",
        "| run | task options | max new | prompts | greedy dense | greedy sparse | sampled dense (mixed) "
        "| sampled sparse (mixed) | mean length (dense greedy / sampled) | KV saving | in target |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(runs, 1):
        gd, sd = _arm(r, "greedy dense"), _arm(r, "sampled dense")
        sparse = [a for a in r["arms"] if a["policy"] != "none"]
        greedy_sparse = [a for a in sparse if a["k"] == 1]
        ok = gd is not None and TARGET[0] <= gd["accuracy"] <= TARGET[1]
        cells = [
            str(i),
            _options(r),
            str(r["max_new_tokens"]),
            str(r["prompts"]),
            _acc(gd),
            _accs(greedy_sparse),
            _acc(sd),
            _accs([a for a in sparse if a["k"] > 1]),
            " / ".join(f"{a['lengths']['mean']:.0f}" if a else "-" for a in (gd, sd)),
            "<br>".join(f"{_budget(a)}: {_pct(a['kv_saving'])}" for a in (greedy_sparse or sparse)) or "-",
            "yes" if ok else "no",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += study_table(runs)
    for i, r in enumerate(runs, 1):
        kv = r["kv"]
        lines += [
            "",
            f"## Run {i}: {_options(r)}",
            "",
            f"Command: `{r['command']}`",
            "",
            *([figprov.provenance_line(r), ""] if "provenance" in r else []),
            *([r["note"], ""] if r["note"] else []),
            f"{r['prompts']} prompts ({r['prompt_tokens']['mean']:.1f} tokens on average, "
            f"{r['prompt_tokens']['min']}-{r['prompt_tokens']['max']}), responses up to "
            f"{r['max_new_tokens']} tokens, sampled at temperature {r['temperature']} with "
            f"{r['samples']} per prompt, seed {r['seed']}; "
            + (
                f"sparse: {kv['policy']} at budget(s) {kv['budgets']} + buffer {kv['buffer']}, window "
                f"{kv['window']}, {kv['selection']} selection, "
                f"compress_prompt={str(kv['compress_prompt']).lower()}"
                if kv["budgets"]
                else "dense only"
            )
            + f". Wall time {r['wall_s']:.0f} s on {r['cores']} core(s).",
            "",
            "| arm | accuracy | mixed groups | all right / all wrong | pass@k | KV saving | mean length "
            "| p10 / p25 / p50 / p75 / p90 / max | at cap | >= 128 tokens | boxed | answer found "
            "| greedy text = dense |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for a in r["arms"]:
            g, L = a.get("groups"), a["lengths"]
            lines.append(
                f"| {a['name']} | {a['accuracy']:.3f} | {_pct(g['mixed']) if g else '-'} | "
                f"{(_pct(g['all_right']) + ' / ' + _pct(g['all_wrong'])) if g else '-'} | "
                f"{_pct(g['pass_at_k']) if g else '-'} | {_pct(a['kv_saving'])} | {L['mean']:.1f} | "
                f"{L['p10']:.0f} / {L['p25']:.0f} / {L['p50']:.0f} / {L['p75']:.0f} / {L['p90']:.0f} / "
                f"{L['max']} | {_pct(L['at_cap'])} | {_pct(L['ge_128'])} | {_pct(a['format']['boxed'])} | "
                f"{_pct(a['format']['answer_found'])} | {_pct(a.get('same_as_dense'))} |"
            )
        gd = _arm(r, "greedy dense")
        if gd:
            lines += [
                "",
                f"First greedy dense response (label {r['first_label']}, reward {gd['rewards'][0][0]:.0f}):",
                "",
                "```",
                gd["responses"][0].strip(),
                "```",
            ]
    return "\n".join(lines) + "\n"


def study_candidates(r: dict) -> list[dict]:
    """The numbers STUDY_TARGETS read, one dict per sampled sparse arm of run `r` (with its sampled
    dense arm); none for a run without both."""
    sd = _arm(r, "sampled dense")
    if sd is None:
        return []
    out = []
    for a in r["arms"]:
        if a["k"] > 1 and a["policy"] != "none" and "mismatch" in a:
            out.append(
                {
                    "arm": a,
                    "dense_reward": sd["accuracy"],
                    "dense_mixed": sd["groups"]["mixed"],
                    "sparse_reward": a["accuracy"],
                    "budget": a["budget"],
                    "prompt_max": r["prompt_tokens"]["max"],
                    "kv_saving": a["kv_saving"],
                    "k3": a["mismatch"]["kl_k3"],
                    "dense_length": sd["lengths"]["mean"],
                }
            )
    return out


def study_table(runs: list[dict]) -> list[str]:
    """The collapse study's calibration: every sampled run against STUDY_TARGETS."""
    rows = []
    for i, r in enumerate(runs, 1):
        for c in study_candidates(r):
            a, m = c["arm"], c["arm"]["mismatch"]
            met = [name for name, _, test in STUDY_TARGETS if test(c)]
            missed = [name for name, _, _ in STUDY_TARGETS if name not in met]
            rows.append(
                f"| {i} | {_options(r)}; T={r['temperature']}, k={r['samples']}, {r['prompts']} prompts, "
                f"max new {r['max_new_tokens']} | {_budget(a)} + {r['kv']['buffer']} (prompt <= {c['prompt_max']}"
                f"{'; the prompt compressed at prefill' if r['kv'].get('compress_prompt') else ''}) "
                f"| {c['dense_reward']:.3f} ({c['dense_mixed']:.2f}) | {_acc(a)} | {_pct(c['kv_saving'])} "
                f"| {c['k3']:.3f} | {_pct(m['token_reject'])} / {_pct(m['seq_reject'])} | {m['xi_p5']:.3f} "
                f"| {c['dense_length']:.0f} / {a['lengths']['mean']:.0f} "
                f"| {'all' if not missed else 'missed: ' + ', '.join(missed)} |"
            )
    if not rows:
        return []
    return [
        "",
        "## The collapse study's setting",
        "",
        "Targets declared before any RL run of the study (STUDY_TARGETS): "
        + "; ".join(f"**{name}** ({what})" for name, what, _ in STUDY_TARGETS)
        + ". Rewards are avg@1 of k "
        "samples per prompt at the rollout temperature (mixed: the fraction of prompts whose k rewards differ); "
        "k3, SARS rejection (the authors' token band [0.5, 1.5] and veto 1e-4) and xi p5 (the 5th percentile of "
        "pi_dense / pi_sparse over tokens) score the sparse arm's tokens under the dense model at the same "
        "temperature: what the first RL iteration's corrections see.",
        "",
        "| run | setting | budget + buffer | sampled dense (mixed) | sampled sparse (mixed) | KV saving | k3 "
        "| SARS token / resp. reject | xi p5 | mean length (dense / sparse) | targets |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def writer(out: str, fresh: bool):
    """save(run_data): results.json = the earlier runs (none with `fresh`) + this one, and
    results.md rendered from them. Returns save and the data it writes."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "results.json")
    data = {"runs": []}
    if os.path.exists(path) and not fresh:
        with open(path) as f:
            data = json.load(f)
    earlier = list(data["runs"])

    def save(run_data: dict) -> None:
        data["runs"] = earlier + [run_data]
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
        with open(os.path.join(out, "results.md"), "w") as f:
            f.write(render(data["runs"], path))

    return save, data


def main(argv=None) -> dict:
    args = parse_args(argv)
    from sparserl_jax.config import load_config

    task = load_config(args.config, args.overrides).data.task
    out = args.out or os.path.join(REPO, "experiments", "results", "real", "calibration", str(task))
    if args.rerender:
        path = os.path.join(out, "results.json")
        with open(path) as f:
            data = json.load(f)
        with open(os.path.join(out, "results.md"), "w") as f:
            f.write(render(data["runs"], path))
        return data
    save, data = writer(out, args.fresh)
    run(args, argv, save)
    return data


if __name__ == "__main__":
    from experiments.lib import workers  # imports no JAX

    workers.set_portable_cpu_env()  # the numerics of the project's other CPU experiments
    main()
