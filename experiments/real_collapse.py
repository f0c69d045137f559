"""Sparse-RL's central claim on a real LLM: does naive sparse-rollout training collapse on
SmolLM2-135M-Instruct, and does Sparse-RL (SARS + IBR) prevent it? (Sparse-RL Table 1 / Fig. 3)

  python -m sparserl_jax.fetch smollm2-135m-instruct --out checkpoints/smollm2-135m
  python experiments/real_collapse.py                         # setting rkv48: 3 arms x 3 seeds, resumable
  python experiments/real_collapse.py --setting streaming32   # the larger-mismatch setting
  python experiments/real_collapse.py --replot experiments/results/real/collapse/rkv48

Every run is a single-core process (experiments/workers.py), one per core, resumable after a
kill (the trainer's exact resume; finished runs are reused). The plan below was fixed before the
first run and is written into every results.md beside the outcome.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import figlib  # noqa: E402
import numpy as np  # noqa: E402
import workers  # noqa: E402

CONFIG = os.path.join(figlib.HERE, "configs", "real", "smollm2_chat_arithmetic.yaml")
RUNS = os.path.join(figlib.REPO, "runs", "real_collapse")

ITERATIONS = 20
EVAL_EVERY = 10
EVAL_PROMPTS = 128
SEEDS = (0, 1, 2)


@dataclasses.dataclass(frozen=True)
class Setting:
    """A sparse-rollout setting: its KV overrides (shared by both sparse arms) and why it is here."""

    label: str
    kv: tuple[str, ...]
    why: str


SETTINGS = {
    "rkv48": Setting(
        "R-KV, budget 48 + buffer 16",
        ("kv.policy=rkv", "kv.budget=48", "kv.buffer=16"),
        "the calibrated config's eviction: k3 KL 0.15 per token between sampler and pi_old and 23% "
        "of the tokens rejected by SARS in the 4-iteration study (experiments/results/real/rl), "
        "55-57% of the KV entries saved"),
    "streaming32": Setting(
        "StreamingLLM, budget 32 + buffer 16",
        ("kv.policy=streaming", "kv.budget=32", "kv.buffer=16"),
        "run only if nothing collapses under rkv48: the largest mismatch of the eviction table "
        "(experiments/results/real/eviction: k3 KL 0.20, 26% SARS token rejection, 59% saving at "
        "budget 32), a sink + recent window that drops the question from the cache mid-response"),
}
ARMS = {  # name -> (rl.mode, sparse rollouts?, label)
    "dense": ("dense", False, "dense rollouts"),
    "naive": ("naive_sparse", True, "sparse rollouts, no correction"),
    "sparse_rl": ("sparse_rl", True, "sparse rollouts + Sparse-RL (SARS + IBR)"),
}

PLAN = f"""\
**Plan, fixed before the runs.** Base: experiments/configs/real/smollm2_chat_arithmetic.yaml (chat
arithmetic, 4 prompts x 4 samples an iteration at temperature 0.7, up to 256 new tokens, lr 1e-5,
beta 1e-4, one optimizer step an iteration). Arms: dense rollouts (rl.mode=dense), sparse rollouts
trained as if on-policy (naive_sparse) and sparse rollouts with Sparse-RL (sparse_rl: SARS + IBR at
the authors' settings), the two sparse arms under the setting's KV eviction. Seeds {list(SEEDS)} per arm
(train.seed: prompts, sampling). {ITERATIONS} iterations a run.
Evaluation: held-out accuracy (greedy decoding on {EVAL_PROMPTS} prompts never trained on, the same
prompts at every point of a seed) under dense inference (the policy itself), at iterations 0 (the
untrained model, per seed), {EVAL_EVERY} and {ITERATIONS}; its binomial SE is sqrt(p (1 - p) / {EVAL_PROMPTS})
(0.04 at p = 0.27, the calibrated greedy accuracy) and a difference of two evaluations has SE
sqrt(p1 (1 - p1) / n + p2 (1 - p2) / n) (figlib.diff_se). Amended once, after the untrained model's
first evaluations and before any RL result: the plan first evaluated avg@1 sampled at the rollout
temperature, which gave the untrained model 0.10 and 0.05 (seeds 0 and 1): a collapse threshold of
3-6 correct prompts of 128, under the noise of one evaluation; greedy decoding (26.6% in the
calibration) leaves a halving 3 SE to show.
Collapse rule (one for every arm): a run has collapsed when its final held-out accuracy is below half
of the untrained model's at its seed (figlib.collapsed with the untrained model as the warm start);
the train-reward rule (figlib.reward_collapse_iteration: the 5-iteration moving average of the train
reward below half its first value) is reported beside it for every run.
Hypothesis (the paper's claim): naive sparse training collapses while dense does not, and Sparse-RL
does not collapse and stays level with dense.
Verdicts: the collapse claim is **supported** if the naive arm collapses at every seed and dense at
none, **refuted** (in this setting and budget) if the naive arm collapses at no seed while its final
accuracy ties dense by the tie rule (every seed's difference within 2 SE), **open** otherwise (mixed
seeds, or no collapse but a clear drop). Sparse-RL's claim is **supported** if it collapses at no seed
and ties or beats dense at every seed, **not supported** if it collapses at any seed or is behind dense
by the tie rule. If nothing collapses within the budget under rkv48, the same study runs under
streaming32 (the larger mismatch), and each setting gets its own verdict."""

CURVES = (  # (metric(s), y label, title)
    (("eval/accuracy",), "accuracy (avg@1)", "held-out accuracy, dense inference"),
    (("reward/mean",), "mean reward", "training reward (new prompts)"),
    (("mismatch/kl_k3",), "KL k3 per token (nats)", "mismatch: sampler vs pi_old"),
    (("sars/token_reject_rate", "sars/seq_reject_rate"), "fraction rejected", "SARS rejection (tokens —, responses --)"),
    (("xi/p5", "xi/p95"), "xi = pi_old / pi_sampler", "IBR weight spread (xi p5 --, p95 —)"),
    (("kv/saving",), "fraction of KV entries", "KV saving (rollouts)"),
    (("response/length_mean",), "tokens", "response length"),
    (("loss/entropy",), "nats", "policy entropy"),
)


SMOKE_KV = ("kv.budget=16", "kv.buffer=4")  # --smoke: a cache that evicts within 16 new tokens


def overrides(setting: Setting, arm: str, seed: int, smoke: bool = False) -> list[str]:
    mode, sparse, _ = ARMS[arm]
    kv = [*setting.kv, *(SMOKE_KV if smoke else ())] if sparse else ["kv.policy=none"]
    return [f"rl.mode={mode}", *kv, f"train.seed={seed}"]


def untrained(seed: int) -> list[str]:
    return ["rl.mode=dense", "kv.policy=none", f"train.seed={seed}", "train.iterations=0"]


def _job(job) -> str:
    """Worker: train (or resume, or reuse) one run; the untrained model is evaluated here."""
    config, base, runs_dir, name, over, n_eval = job
    run = figlib.Study(config, base, runs_dir).train(name, [*over, "train.progress=true"])
    if run.cfg.train.iterations == 0:
        run.evaluate({"policy": "none"}, n=n_eval)
    return run.out_dir


def base_overrides(args) -> list[str]:
    it = 2 if args.smoke else args.iterations
    every = 1 if args.smoke else args.eval_every
    extra = ["rollout.max_new_tokens=16", "rollout.prompts=2", "rollout.samples=2", "data.max_prompt_len=160",
             "rl.update.minibatch_size=4", "rl.update.micro_batch_size=2",
             "rl.update.score_batch_size=4"] if args.smoke else []
    return [f"train.iterations={it}", f"train.eval_every={every}", "train.eval_kv=dense", "train.eval_temperature=0",
            f"train.eval_prompts={args.eval_prompts}", "train.eval_batch_size=32",
            f"train.save_every={1 if args.smoke else 5}", "train.keep_checkpoints=2", *extra, *args.overrides]


def run(args, study) -> dict:
    setting = SETTINGS[args.setting]
    args.eval_prompts = args.eval_prompts or (4 if args.smoke else EVAL_PROMPTS)
    # this study's own base overrides (its --smoke shrinks the real config; no SFT runs here)
    base = base_overrides(args)
    study.overrides, study.base = base, figlib.load_config([study.config], base)
    jobs = [(f"untrained/seed{s}", untrained(s)) for s in args.seeds]
    jobs += [(f"{arm}/seed{s}", overrides(setting, arm, s, args.smoke)) for s in args.seeds for arm in ARMS]
    t0 = time.perf_counter()
    workers.parallel_map(_job, [(args.config, base, args.runs_dir, n, o, args.eval_prompts) for n, o in jobs],
                         study.cores)
    wall = time.perf_counter() - t0
    before = {s: study.train(f"untrained/seed{s}", untrained(s)).evaluate({"policy": "none"}, n=args.eval_prompts)
              for s in args.seeds}
    results, histories = {}, {}
    for arm in ARMS:
        runs = [study.train(f"{arm}/seed{s}", overrides(setting, arm, s, args.smoke)) for s in args.seeds]
        histories[arm] = [r.history for r in runs]
        results[arm] = [row(r, s, before[s]["accuracy"]) for r, s in zip(runs, args.seeds)]
    return {"setting": args.setting, "seeds": list(args.seeds), "results": results, "histories": histories,
            "untrained": {str(s): before[s] for s in args.seeds}, "eval_prompts": args.eval_prompts,
            "iterations": study.base.train.iterations, "train_wall_s": wall, "cores": len(study.cores),
            "plan": PLAN}


def row(run: figlib.Run, seed: int, untrained_acc: float) -> dict:
    h = run.history
    evals = {i + 1: x["eval/accuracy"] for i, x in enumerate(h) if "eval/accuracy" in x}
    final = evals[len(h)]
    return {
        "seed": seed, "warm_start": 0, "untrained_acc": untrained_acc, "dense_acc": final,
        "evals": {str(k): v for k, v in evals.items()},
        "collapsed": bool(figlib.collapsed(final, untrained_acc)),
        "collapse_iteration": figlib.reward_collapse_iteration(h),
        "seconds_per_iteration": figlib.seconds_per_iteration(h),  # the first compiles
        **figlib.summarize(run),
    }


# ----------------------------------------------------------------------------- render


def verdicts(data: dict) -> tuple[list[str], list[figlib.Comparison]]:
    res, n = data["results"], data["eval_prompts"]
    comps = figlib.compare_arms(res, (("naive", "dense"), ("sparse_rl", "dense"), ("sparse_rl", "naive")),
                                {"dense_acc": "final held-out accuracy"}, n)
    by = {(c.a, c.b): c.sign for c in comps}
    coll = {arm: sum(r["collapsed"] for r in rows) for arm, rows in res.items()}
    k = len(data["seeds"])
    if coll["naive"] == k and coll["dense"] == 0:
        claim = "**supported**"
    elif coll["naive"] == 0 and by["naive", "dense"] == 0:
        claim = "**refuted** in this setting and budget (no seed collapses; naive ties dense)"
    else:
        claim = "**open**"
    if coll["sparse_rl"] == 0 and by["sparse_rl", "dense"] >= 0:
        srl = "**supported**" + ("" if coll["naive"] else " (trivially: nothing collapses here)")
    else:
        srl = "**not supported**"
    ratio = figlib.ratio_of_means(*([r["dense_acc"] for r in res[arm]] for arm in ("sparse_rl", "dense")))
    lines = [
        f"- Collapse (accuracy rule): dense {coll['dense']} of {k}, naive {coll['naive']} of {k}, "
        f"Sparse-RL {coll['sparse_rl']} of {k}; reward rule: "
        + ", ".join(f"{arm} {sum(r['collapse_iteration'] is not None for r in rows)} of {k}"
                    for arm, rows in res.items()) + ".",
        f"- Naive sparse training collapses (paper: yes, Fig. 3): {claim}.",
        f"- Sparse-RL keeps training stable at the level of dense (paper: ~97% of dense accuracy, Table 1): "
        f"{srl}; here {ratio:.0%} of dense (mean final accuracy, {k} seeds).",
    ]
    return lines, comps


def render(data: dict, base, command: str) -> figlib.Rendered:
    setting = SETTINGS[data["setting"]]
    res, n, k = data["results"], data["eval_prompts"], len(data["seeds"])
    fmt = figlib.fmt
    points = sorted({p for rows in res.values() for r in rows for p in r["evals"]}, key=int)
    columns = (("train reward last25", "train_reward_last25", ".3f"), ("mismatch k3", "mismatch_kl_k3", ".3f"),
               ("SARS token reject", "token_reject_rate", ".1%"), ("SARS resp. reject", "seq_reject_rate", ".1%"),
               ("KV saving", "train_kv_saving", ".1%"), ("s / iteration", "seconds_per_iteration", ".0f"))
    body = []
    for arm, rows in res.items():
        its = [r["collapse_iteration"] for r in rows]
        at = ", ".join("-" if i is None else str(i) for i in its)
        body.append([f"{arm} ({ARMS[arm][2]})", str(k), fmt([r["untrained_acc"] for r in rows]),
                     *(fmt([r["evals"][p] for r in rows]) for p in points),
                     f"{sum(r['collapsed'] for r in rows)} of {k}", f"{sum(i is not None for i in its)} of {k} ({at})",
                     *figlib.stat_cells(rows, columns)])
    lines = [data["plan"], "", f"**Setting {data['setting']}**: {setting.label}; {setting.why}.", "",
             *figlib.md_table(["arm", "seeds", "held-out acc. it 0", *(f"it {p}" for p in points),
                               "collapsed (acc. rule)", "collapsed (reward rule, at)", *figlib.headers(columns)], body)]
    vlines, comps = verdicts(data)
    lines += [*figlib.comparison_lines(comps, "Mean ± sample std over seeds. Paired differences of the final "
                                       "held-out accuracy (same seed: same prompts and draws):"),
              "", "**Verdicts** (by the plan's rules):", "", *vlines]
    fig = figure(data)
    caption = (
        f"Figure: {setting.label} on SmolLM2-135M-Instruct (chat arithmetic), {k} seeds per arm; lines: "
        "mean over seeds, bands: ± one sample std over seeds (clipped to each metric's range); held-out "
        f"accuracy (greedy) on {n} prompts under dense inference at iterations 0, {EVAL_EVERY}, {data['iterations']} "
        "(points; the grey dotted line: half the untrained model's, the collapse threshold). Grey band in the "
        "KV-saving panel: the paper's 35-53% fewer KV entries (Sparse-RL Table 1). Training runs: "
        f"{data['cores']} single-core processes, wall time {data['train_wall_s'] / 60:.0f} min (finished runs reused).")
    return figlib.Rendered(f"Sparse-RL's collapse claim on SmolLM2-135M: {data['setting']}", "\n".join(lines),
                           {"collapse": fig}, caption)


def figure(data: dict):
    res, hists = data["results"], data["histories"]
    fig, axes = figlib.panels(4, 9.0)
    colours = dict(zip(ARMS, ("tab:blue", "tab:red", "tab:green")))
    for ax, (keys, ylabel, title) in zip(axes, CURVES):
        for arm, hs in hists.items():
            for j, key in enumerate(keys):
                style = "-" if j == len(keys) - 1 or len(keys) == 1 else "--"
                if key == "eval/accuracy":
                    pts = sorted({0, *(int(p) for r in res[arm] for p in r["evals"])})
                    vals = np.array([[r["untrained_acc"] if p == 0 else r["evals"][str(p)] for p in pts]
                                     for r in res[arm]])
                    m, s = vals.mean(0), vals.std(0, ddof=1) if len(vals) > 1 else np.zeros(len(pts))
                    ax.errorbar(pts, m, yerr=s, color=colours[arm], marker="o", ms=3, capsize=2,
                                label=ARMS[arm][2])
                    continue
                x, m, s = figlib.curve(hs, key)
                if np.isnan(m).all():
                    continue
                figlib.mean_line(ax, x, m, s, colours[arm], 0.0, None, style, lw=1.1,
                                 label=ARMS[arm][2] if j == 0 else None)
        if keys[0] == "eval/accuracy":
            half = 0.5 * np.mean([r["untrained_acc"] for rows in res.values() for r in rows])
            ax.axhline(half, color="grey", ls=":", lw=1)
        if keys[0] == "kv/saving":
            ax.axhspan(0.35, 0.53, color="grey", alpha=0.2, lw=0)
        ax.set(title=title, xlabel="iteration", ylabel=ylabel)
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(f"Sparse-RL on SmolLM2-135M, {SETTINGS[data['setting']].label}: {len(data['seeds'])} seeds per arm")
    figlib.band_legend_below(fig, axes[-1], ncol=3)
    return fig


def arguments(p) -> None:
    p.add_argument("--setting", default="rkv48", choices=list(SETTINGS))
    p.add_argument("--iterations", type=int, default=ITERATIONS)
    p.add_argument("--eval-every", type=int, default=EVAL_EVERY)


FIGURE = figlib.Figure(
    "real/collapse", __doc__, run, render, arguments=arguments, seeds=SEEDS, default_config=CONFIG,
    eval_prompts=True)


def main(argv=None) -> dict:
    """FIGURE.main, writing each setting to experiments/results/real/collapse/<setting> by default."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--out" not in argv and "--replot" not in argv:
        setting = argv[argv.index("--setting") + 1] if "--setting" in argv else "rkv48"
        argv += ["--out", os.path.join(figlib.HERE, "results", "real", "collapse", setting)]
    if "--runs-dir" not in argv and "--replot" not in argv:
        argv += ["--runs-dir", RUNS]
    return FIGURE.main(argv)


if __name__ == "__main__":
    main()
