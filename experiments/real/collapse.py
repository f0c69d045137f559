"""Sparse-RL's central claim on a real LLM: does naive sparse-rollout training collapse on
SmolLM2-135M-Instruct, and does Sparse-RL (SARS + IBR) prevent it? (Sparse-RL Table 1 / Fig. 3)

  python -m sparserl_jax.fetch smollm2-135m-instruct --out checkpoints/smollm2-135m
  python experiments/real/collapse.py --commit-records     # setting rkv64: 3 arms x 3 seeds
  python experiments/real/collapse.py --setting rkv48      # the larger mismatch (only if rkv64 has no collapse)
  python experiments/real/collapse.py --render-only        # results.md from the records present
  python experiments/real/collapse.py --replot experiments/results/real/collapse/rkv64
  python experiments/real/collapse.py --replay naive/seed0   # does this machine give a recorded run?

Every run is a single-core process (experiments/lib/workers.py), one per core. A study takes longer
than one machine is held here, so each run leaves a record the moment it finishes
(experiments/lib/run_records.py: <out>/records/<arm>-seed<k>.json, committed with --commit-records);
the same command on another machine trains only the planned runs without a record (a run
directory kept on the machine resumes from its checkpoint). results.md and the figure show the
runs recorded so far and state no verdict until every planned run is there. The untrained model
and the dense arm evict nothing, so both settings plan the same runs for them: a setting's study
copies the other's record of such a run (run_records.adopt; the records table names its source)
and trains only its two sparse arms. The plan below was fixed before the first run and is written
into every results.md beside the outcome.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

import numpy as np

from experiments.lib import figlib, run_records, run_replay, workers
from experiments.real.collapse_plan import (  # noqa: F401  (the study's plan, re-exported for its readers)
    ARMS,
    CONFIG,
    DEFAULT_SETTING,
    EVAL_EVERY,
    EVAL_PROMPTS,
    HORIZON_GAIN,
    ITERATIONS,
    PERSIST_K3,
    PERSIST_QUESTION,
    PLAN,
    RKV48Q_PLAN,
    SEEDS,
    SETTINGS,
    SMOKE_KV,
    Setting,
    overrides,
    plan,
    plan_counts,
    untrained,
)
from experiments.real.smoke import SMOKE_BATCH
from sparserl_jax.config import to_dict

RUNS = os.path.join(figlib.REPO, "runs", "real_collapse")

CURVES = (  # (metric(s), y label, title): short enough for a panel of half a paper column
    (("eval/accuracy",), "accuracy (greedy)", "held-out, dense inf."),
    (("reward/mean",), "mean reward", "train reward"),
    (("mismatch/kl_k3",), "k3 per token (nats)", "mismatch vs pi_old"),
    (("sars/token_reject_rate", "sars/seq_reject_rate"), "SARS, fraction", "rejected (tok -, resp --)"),
    (("xi/p5", "xi/p95"), "pi_old / pi_sampler", "xi p5 (--), p95 (-)"),
    (("kv/saving",), "fraction of entries", "KV saving"),
    (("response/length_mean",), "tokens", "response length"),
    (("loss/entropy",), "nats", "policy entropy"),
)


def _job(job) -> str:
    """Worker: train (or resume) one run, evaluate the untrained model where it is one, and write
    (and commit, if asked) its record the moment it finishes."""
    config, base, runs_dir, records_dir, name, over, n_eval, commit = job
    start = figlib.provenance(workers.available_cores(), None)  # the commit at the run's start
    t0 = time.perf_counter()
    study = figlib.Study(config, base, runs_dir)
    run = study.train(name, [*over, "train.progress=true"])
    evals = {}
    if run.cfg.train.iterations == 0:
        t_eval = time.perf_counter()
        res = run.evaluate({"policy": "none"}, n=n_eval)
        evals["0"] = {
            "accuracy": res["accuracy"],
            "n": n_eval,
            "mean_length": res["mean_length"],
            "seconds": time.perf_counter() - t_eval,
        }
    for i, x in enumerate(run.history, 1):
        if "eval/accuracy" in x:
            evals[str(i)] = {"accuracy": x["eval/accuracy"], "n": run.cfg.train.eval_prompts}
    config_tree = to_dict(run.cfg)
    config_tree["train"]["out_dir"] = None  # the machine's run directory: not part of the record
    path = run_records.write(
        records_dir,
        {
            "name": name,
            "overrides": list(over),
            "config_key": figlib.config_key(run.cfg),
            "config": config_tree,
            "history": run.history,
            "evals": evals,
            "provenance": {**start, "wall_s": round(time.perf_counter() - t0, 1)},
            "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        },
    )
    if commit:
        run_records.commit(
            path,
            f"real-model collapse study: the record of {name} ({_setting_of(records_dir)}), "
            f"{len(run.history)} iterations",
        )
    return path


def _setting_of(records_dir: str) -> str:
    return os.path.basename(os.path.dirname(os.path.abspath(records_dir)))


def base_overrides(args, setting: Setting) -> list[str]:
    it = 2 if args.smoke else args.iterations
    every = 1 if args.smoke else args.eval_every
    extra = ["rollout.max_new_tokens=16", *SMOKE_BATCH, "rl.update.compile_ahead=false"] if args.smoke else []
    return [
        f"train.iterations={it}",
        f"train.eval_every={every}",
        "train.eval_kv=dense",
        "train.eval_temperature=0",
        f"train.eval_prompts={args.eval_prompts}",
        "train.eval_batch_size=32",
        f"train.save_every={1 if args.smoke else 5}",
        "train.keep_checkpoints=2",
        *extra,
        *args.overrides,
    ]


def run(args, study) -> dict:
    """Train the planned runs that have no record yet (one single-core worker per core), then
    gather every record there is: the results hold what is recorded, complete or not."""
    setting = SETTINGS[args.setting]
    args.eval_prompts = args.eval_prompts or (4 if args.smoke else EVAL_PROMPTS)
    records_dir = args.records or os.path.join(args.out, "records")
    # this study's own base overrides (its --smoke shrinks the real config; no SFT runs here)
    base = base_overrides(args, setting)
    study.overrides, study.base = base, figlib.load_config([study.config], base)
    jobs = plan(args.seeds, setting, args.smoke)
    unknown = sorted(set(args.only or ()) - {name for name, _ in jobs})
    if unknown:  # before anything is adopted, replayed or trained
        raise ValueError(f"--only {' '.join(unknown)}: not a planned run of seeds {args.seeds}")
    keys = {name: figlib.config_key(study.resolve(o)) for name, o in jobs}
    # a run planned by both settings (the untrained model, dense rollouts: no eviction) is one run:
    # the other setting's record of it is copied here, not trained again
    others = [
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(records_dir))), s, "records") for s in SETTINGS
    ]
    for path in run_records.adopt(records_dir, keys.items(), others):
        print(f"adopted {os.path.basename(path)} from another setting's records (the same config)", flush=True)
        if args.commit_records:
            run_records.commit(
                path, f"real-model collapse study: {os.path.basename(path)} adopted ({args.setting}): the same run"
            )
    if args.replay:  # a recorded run's first iterations again on this machine, then the render
        r = run_replay.replay(study, records_dir, args.replay, args.replay_iterations, args.out, args.commit_records)
        print(f"replay of {args.replay}: " + run_replay.outcome(r), flush=True)
    missing = run_records.missing(records_dir, keys.items())
    todo = [] if args.render_only or args.replay else [n for n in missing if not args.only or n in args.only]
    print(
        f"{len(jobs) - len(missing)} of {len(jobs)} planned runs recorded in {records_dir}; "
        f"{'training ' + ', '.join(todo) if todo else 'nothing to train'}",
        flush=True,
    )
    t0 = time.perf_counter()
    workers.parallel_map(
        _job,
        [
            (args.config, base, args.runs_dir, records_dir, n, o, args.eval_prompts, args.commit_records)
            for n, o in jobs
            if n in todo
        ],
        study.cores,
    )
    records = {name: run_records.read(records_dir, name, keys[name]) for name, _ in jobs}
    study.arms.update(
        {
            name: {"overrides": r["overrides"], "run": r["config_key"], "config": r["config"]}
            for name, r in records.items()
            if r is not None
        }
    )  # arms.json
    return {
        **collect(records, args.seeds),
        "setting": args.setting,
        "eval_prompts": args.eval_prompts,
        "iterations": study.base.train.iterations,
        "train_wall_s": time.perf_counter() - t0,
        "cores": len(study.cores),
        "plan": PLAN + ("\n\n" + setting.plan if setting.plan else ""),
        "trained_now": todo,
    }


def collect(records: dict[str, dict | None], seeds) -> dict:
    """Results, histories and per-run provenance from the records present (a seed's arm needs the
    untrained model's record of that seed)."""
    before = {s: r["evals"]["0"] for s in seeds if (r := records[f"untrained/seed{s}"]) is not None}
    results, histories = {}, {}
    for arm in ARMS:
        recs = [(s, records[f"{arm}/seed{s}"]) for s in seeds if s in before]
        recs = [(s, r) for s, r in recs if r is not None]
        results[arm] = [row(r["history"], s, before[s]["accuracy"]) for s, r in recs]
        histories[arm] = [r["history"] for _, r in recs]
    runs = {
        name: {
            "commit": r["provenance"]["commit"],
            **{k: r["provenance"][k] for k in ("library_commit",) if k in r["provenance"]},
            "uncommitted_changes": r["provenance"]["uncommitted_changes"],
            "cpu": r["provenance"]["cpu"],
            "jax": r["provenance"]["jax"],
            "wall_s": r["provenance"]["wall_s"],
            "finished": r["finished"],
            **({"adopted_from": r["adopted_from"]} if "adopted_from" in r else {}),
        }
        for name, r in records.items()
        if r is not None
    }
    return {
        "seeds": list(seeds),
        "results": results,
        "histories": histories,
        "untrained": {str(s): v for s, v in before.items()},
        "runs": runs,
        "planned_runs": len(records),
        "recorded_runs": len(runs),
    }


def row(h: list[dict], seed: int, untrained_acc: float) -> dict:
    evals = {i + 1: x["eval/accuracy"] for i, x in enumerate(h) if "eval/accuracy" in x}
    final = evals[len(h)]
    return {
        "seed": seed,
        "warm_start": 0,
        "untrained_acc": untrained_acc,
        "dense_acc": final,
        "evals": {str(k): v for k, v in evals.items()},
        "collapsed": bool(figlib.collapsed(final, untrained_acc)),
        "collapse_iteration": figlib.reward_collapse_iteration(h),
        "seconds_per_iteration": figlib.seconds_per_iteration(h),  # the first compiles
        **figlib.summarize_history(h),
        # SARS over every iteration, as the table's other whole-run columns (summarize_history's
        # reject rates are last-quarter means)
        "token_reject_run": figlib.run_mean(h, "sars/token_reject_rate"),
        "seq_reject_run": figlib.run_mean(h, "sars/seq_reject_rate"),
        **question_summary(h),
    }


QUESTION_KEYS = ("evicted", "numbers_evicted", "number_lost", "reward_number_lost", "reward_numbers_kept")


def logged_mean(h: list[dict], key: str) -> float | None:
    """The mean of `key` over the iterations that logged it (None when none did)."""
    vals = [x[key] for x in h if key in x]
    return float(np.mean(vals)) if vals else None


def question_summary(h: list[dict]) -> dict:
    """A run's question/* (rollout/question.py) over the run and its last quarter, and whether its
    mismatch persisted by the plan's rule (None for a run that logged no question/*: dense)."""
    tail = h[-max(len(h) // 4, 1) :]
    out = {}
    for k in QUESTION_KEYS:
        out[f"question_{k}"] = logged_mean(h, f"question/{k}")
        out[f"question_{k}_last25"] = logged_mean(tail, f"question/{k}")
    out["k3_last25"] = logged_mean(tail, "mismatch/kl_k3")
    out["persisted"] = persisted(out["k3_last25"], out["question_evicted_last25"])
    return out


def persisted(k3: float | None, question_evicted: float | None) -> bool | None:
    """The plan's persistence rule on a sparse run's last-quarter means (None: not logged)."""
    if k3 is None or question_evicted is None:
        return None
    return k3 >= PERSIST_K3 and question_evicted >= PERSIST_QUESTION


# ----------------------------------------------------------------------------- render


def verdicts(data: dict) -> tuple[list[str], list[figlib.Comparison]]:
    res, n = data["results"], data["eval_prompts"]
    comps = figlib.compare_arms(
        res,
        (("naive", "dense"), ("sparse_rl", "dense"), ("sparse_rl", "naive")),
        {"dense_acc": "final held-out accuracy"},
        n,
    )
    by = {(c.a, c.b): c.sign for c in comps}
    coll = {arm: sum(r["collapsed"] for r in rows) for arm, rows in res.items()}
    k = len(data["seeds"])
    gain = float(np.mean([r["dense_acc"] - r["untrained_acc"] for r in res["dense"]]))
    learned = gain >= HORIZON_GAIN
    if not learned:
        claim = (
            f"**no verdict**: the dense arm gained {gain:+.3f} in {data['iterations']} iterations, below the "
            f"horizon's {HORIZON_GAIN:.2f} (the plan: a model that does not learn shows neither collapse nor "
            "stability; the next study doubles the horizon)"
        )
    elif coll["naive"] == k and coll["dense"] == 0:
        claim = "**supported**"
    elif coll["naive"] == 0 and by["naive", "dense"] == 0:
        claim = "**refuted** in this setting and budget (no seed collapses; naive ties dense)"
    else:
        claim = "**open**"
    if not learned:
        srl = "**no verdict** (the horizon, above)"
    elif coll["sparse_rl"] == 0 and by["sparse_rl", "dense"] >= 0:
        srl = "**supported**" + ("" if coll["naive"] else " (trivially: nothing collapses here)")
    else:
        srl = "**not supported**"
    ratio = figlib.ratio_of_means(*([r["dense_acc"] for r in res[arm]] for arm in ("sparse_rl", "dense")))
    lines = [
        f"- Collapse (accuracy rule): dense {coll['dense']} of {k}, naive {coll['naive']} of {k}, "
        f"Sparse-RL {coll['sparse_rl']} of {k}; reward rule: "
        + ", ".join(
            f"{arm} {sum(r['collapse_iteration'] is not None for r in rows)} of {k}" for arm, rows in res.items()
        )
        + ".",
        f"- Horizon: the dense arm gained {gain:+.3f} of held-out accuracy (mean over {k} seeds; expected >= "
        f"{HORIZON_GAIN:.2f}).",
        f"- Naive sparse training collapses (paper: yes, Fig. 3): {claim}.",
        f"- Sparse-RL keeps training stable at the level of dense (paper: ~97% of dense accuracy, Table 1): "
        f"{srl}; here {ratio:.0%} of dense (mean final accuracy, {k} seeds).",
    ]
    if SETTINGS[data["setting"]].persistence:
        kept, n_sparse = persistence_count(res)
        lines.append(
            f"- The mismatch persisted (plan: k3 >= {PERSIST_K3} and question evicted >= {PERSIST_QUESTION:.0%} over "
            f"the last quarter) in {kept} of {n_sparse} sparse runs"
            + (
                ": the verdicts above are read where the eviction persisted."
                if n_sparse - kept < 4
                else f"; it faded in {n_sparse - kept}, so by the plan this setting cannot answer the question and "
                "the declared next setting (budget 32, calibrated first) runs."
            )
        )
    return lines, comps


SPARSE_ARMS = ("naive", "sparse_rl")


def persistence_count(res: dict) -> tuple[int, int]:
    """(sparse runs whose mismatch persisted, sparse runs)."""
    rows = [r for arm in SPARSE_ARMS for r in res.get(arm, [])]
    return sum(bool(r.get("persisted")) for r in rows), len(rows)


def persistence_lines(data: dict) -> list[str]:
    """Per sparse run: the plan's persistence rule and the question's eviction, beside the dense
    arm's train reward on the same prompts (same seed)."""
    res = data["results"]
    dense_h = {r["seed"]: h for r, h in zip(res.get("dense", []), data["histories"].get("dense", []))}

    def f(x, spec=".3f"):
        return "-" if x is None else format(x, spec)

    body = []
    for arm in SPARSE_ARMS:
        for r, h in zip(res.get(arm, []), data["histories"].get(arm, [])):
            d = dense_h.get(r["seed"])
            verdict = {None: "not logged", True: "persisted", False: "faded"}[r.get("persisted")]
            body.append(
                [
                    f"{arm} seed {r['seed']}",
                    f"{f(r.get('k3_last25'))} / {f(r.get('question_evicted_last25'), '.1%')}",
                    verdict,
                    f"{f(r.get('question_evicted'), '.1%')} / {f(r.get('question_numbers_evicted'), '.1%')}",
                    f"{f(r.get('question_number_lost'), '.1%')} / {f(r.get('question_number_lost_last25'), '.1%')}",
                    f"{f(r.get('question_reward_number_lost'))} / {f(r.get('question_reward_numbers_kept'))}",
                    f(figlib.run_mean(h, "reward/mean")),
                    "-" if d is None else f(figlib.run_mean(d, "reward/mean")),
                ]
            )
    if not body:
        return ["Persistence and mechanism: no sparse run recorded yet."]
    return [
        f"**Persistence and mechanism** (the plan's rule: k3 >= {PERSIST_K3} and question evicted >= "
        f"{PERSIST_QUESTION:.0%}, last-quarter means; rollout/question.py). Question evicted: the fraction of "
        "the prompt's (position, layer, KV head) entries gone at each response's end; numbers: prompt tokens "
        "holding a digit; lost: a number token held in at most half of its entries. Rewards are train "
        "rewards averaged over the iterations (lost / kept: over the iterations where the group was not empty); "
        "the dense arm's at the same seed is on the same prompts." + ("" if dense_h else " No dense run recorded yet."),
        "",
        *figlib.md_table(
            [
                "run",
                "k3 / question evicted, last25",
                "mismatch",
                "question / numbers evicted",
                "responses that lost a number (run / last25)",
                "reward: lost / kept a number",
                "train reward",
                "dense train reward, same prompts",
            ],
            body,
        ),
    ]


def render(data: dict, base, command: str) -> figlib.Rendered:
    setting = SETTINGS[data["setting"]]
    res, n = data["results"], data["eval_prompts"]
    fmt = figlib.fmt
    complete = data["recorded_runs"] == data["planned_runs"]
    points = sorted({p for rows in res.values() for r in rows for p in r["evals"]}, key=int)
    columns = (
        ("train reward last25", "train_reward_last25", ".3f"),
        ("mismatch k3", "mismatch_kl_k3", ".3f"),
        ("SARS token reject", "token_reject_run", ".1%"),
        ("SARS resp. reject", "seq_reject_run", ".1%"),
        ("KV saving", "train_kv_saving", ".1%"),
        ("KV saving last25", "train_kv_saving_last25", ".1%"),
        ("response length last25", "length_last25", ".0f"),
        ("s / iteration", "seconds_per_iteration", ".0f"),
    )
    body = []
    for arm, rows in res.items():
        if not rows:
            continue
        its = [r["collapse_iteration"] for r in rows]
        at = ", ".join("-" if i is None else str(i) for i in its)
        m = len(rows)
        body.append(
            [
                f"{arm} ({ARMS[arm][2]})",
                ", ".join(str(r["seed"]) for r in rows),
                fmt([r["untrained_acc"] for r in rows]),
                *(fmt([r["evals"][p] for r in rows if p in r["evals"]]) for p in points),
                f"{sum(r['collapsed'] for r in rows)} of {m}",
                f"{sum(i is not None for i in its)} of {m} ({at})",
                *figlib.stat_cells(rows, columns),
            ]
        )
    status = f"**{data['recorded_runs']} of {data['planned_runs']} planned runs recorded**" + (
        "."
        if complete
        else ": the study is not finished, so no verdict is stated (each finished run's "
        "record is committed as it finishes; the same command trains only the missing runs)."
    )
    lines = [data["plan"], "", f"**Setting {data['setting']}**: {setting.label}; {setting.why}.", "", status, ""]
    if data["untrained"]:
        lines += [
            "The untrained model (iteration 0, greedy, dense inference, "
            f"{n} prompts): "
            + ", ".join(
                f"seed {s} {v['accuracy']:.3f} (mean length {v['mean_length']:.0f})"
                for s, v in sorted(data["untrained"].items())
            )
            + ".",
            "",
        ]
    if body:
        lines += figlib.md_table(
            [
                "arm",
                "seeds",
                "held-out acc. it 0",
                *(f"it {p}" for p in points),
                "collapsed (acc. rule)",
                "collapsed (reward rule, at)",
                *figlib.headers(columns),
            ],
            body,
        )
        lines += [
            "",
            "Training-time columns: last25 = the mean over the last quarter of the iterations, the others over "
            "every iteration; KV saving = 1 - kept entries / a dense cache's (0 when every response ends "
            "within the budget: a policy whose responses shorten stops evicting).",
        ]
    if setting.persistence:
        lines += ["", *persistence_lines(data)]
    if complete:
        vlines, comps = verdicts(data)
        lines += [
            *figlib.comparison_lines(
                comps,
                "Mean ± sample std over seeds. Paired differences of the final "
                "held-out accuracy (same seed: same prompts and draws):",
            ),
            "",
            "**Verdicts** (by the plan's rules):",
            "",
            *vlines,
        ]
    lines += ["", *cost_lines(data), "", *record_lines(data)]
    if data.get("replays"):
        lines += ["", *run_replay.lines(data["replays"])]
    fig = figure(data)
    caption = (
        f"Figure: {setting.label} on SmolLM2-135M-Instruct (chat arithmetic), runs recorded so far per arm; lines: "
        "mean over seeds, bands: ± one sample std over seeds (clipped to each metric's range); held-out "
        f"accuracy (greedy) on {n} prompts under dense inference at iterations 0, {EVAL_EVERY}, {data['iterations']} "
        "(points; the grey dotted line: half the untrained model's, the collapse threshold). Grey band in the "
        "KV-saving panel: the paper's 35-53% fewer KV entries (Sparse-RL Table 1)."
    )
    return figlib.Rendered(
        f"Sparse-RL's collapse claim on SmolLM2-135M: {data['setting']}", "\n".join(lines), {"collapse": fig}, caption
    )


def cost_lines(data: dict) -> list[str]:
    """What the study costs here: seconds per iteration (median after the first) and per
    evaluation, and the whole plan at that rate on one core."""
    per_it = [r["seconds_per_iteration"] for rows in data["results"].values() for r in rows]
    evals = [v["seconds"] for v in data["untrained"].values() if "seconds" in v]
    if not per_it:
        return ["Cost: no finished training run recorded yet."]
    it_s, eval_s = float(np.median(per_it)), float(np.median(evals)) if evals else float("nan")
    n_runs, n_evals = plan_counts(len(data["seeds"]), data["iterations"])
    total_h = (n_runs * data["iterations"] * it_s + n_evals * eval_s) / 3600
    adopted = [name for name, r in data["runs"].items() if r.get("adopted_from")]
    adopted_runs = [name for name in adopted if not name.startswith("untrained/")]
    adopted_evals = len(adopted) - len(adopted_runs) + len(adopted_runs) * (data["iterations"] // EVAL_EVERY)
    own_h = total_h - (len(adopted_runs) * data["iterations"] * it_s + adopted_evals * eval_s) / 3600
    own = (
        f"; {len(adopted)} of its runs are adopted from another setting's records (the same runs), so this "
        f"setting trains {n_runs - len(adopted_runs)} runs, about {own_h:.1f} core-hours ({own_h / 2:.1f} h)"
        if adopted
        else ""
    )
    return [
        f"Cost here (one CPU core a run): {it_s:.0f} s an iteration (median over the recorded runs, the "
        f"first iteration's compile excluded), {eval_s:.0f} s an evaluation of {data['eval_prompts']} prompts; "
        f"the whole plan ({n_runs} runs x {data['iterations']} iterations, {n_evals} evaluations) "
        f"{total_h:.1f} core-hours, {total_h / 2:.1f} h on this 2-core machine{own}. " + gpu_cost_sentence()
    ]


GPU_RESULTS = os.path.join(figlib.HERE, "results", "gpu")


def gpu_cost_sentence(results: str = GPU_RESULTS) -> str:
    """What the device check's `study` step measured of this plan on each GPU it ran on (the
    committed experiments/results/gpu/<device>/<check>/steps/study.json), or how to measure it."""
    found = []
    for path in sorted(glob.glob(os.path.join(results, "*", "*", "steps", "study.json"))):
        with open(path) as f:
            step = json.load(f)
        r = step.get("result") or {}
        if step.get("status") != "ok" or "plan" not in r:
            continue
        device = os.path.basename(os.path.dirname(os.path.dirname(os.path.dirname(path))))
        its = ", ".join(f"{arm} {a['iteration_s']:.1f} s" for arm, a in r["arms"].items())
        found.append(
            f"{device} ({os.path.relpath(path, figlib.REPO)}): an iteration {its}, an evaluation "
            f"{r['plan']['eval_s']:.1f} s, the whole plan {r['plan']['total_s'] / 60:.0f} min (random weights answer "
            "to the response cap: an upper bound)"
        )
    if not found:
        return (
            "On a GPU: not measured yet (`python experiments/device/gpu_check.py --steps env study` measures this "
            "config's iterations and evaluation on a device; docs/running-on-gpu-tpu.md)."
        )
    return "On a GPU, the device check's `study` step: " + "; ".join(found) + "."


def record_lines(data: dict) -> list[str]:
    """Each recorded run's provenance: where and from which commit it ran."""
    rows = [
        [
            name,
            r["finished"],
            r["commit"]
            + (f" (sparserl_jax from {r['library_commit']})" if r.get("library_commit") else "")
            + (" (uncommitted changes)" if r["uncommitted_changes"] else "")
            + (f"; the same run as {r['adopted_from']}" if r.get("adopted_from") else ""),
            r["cpu"],
            r["jax"],
            f"{r['wall_s'] / 60:.0f} min",
        ]
        for name, r in sorted(data["runs"].items())
    ]
    return [
        "Records (experiments/results/real/collapse/<setting>/records/, one per finished run):",
        "",
        *figlib.md_table(["run", "finished", "commit at its start", "CPU", "jax", "wall time"], rows),
    ]


def figure(data: dict):
    res, hists = data["results"], data["histories"]
    fig, axes = figlib.panels(4, 8.5, width=figlib.PANEL_W)  # one paper column
    colours = dict(zip(ARMS, ("tab:blue", "tab:red", "tab:green")))
    for ax, (keys, ylabel, title) in zip(axes, CURVES):
        for arm, hs in hists.items():
            if not hs:
                continue
            for j, key in enumerate(keys):
                style = "-" if j == len(keys) - 1 or len(keys) == 1 else "--"
                if key == "eval/accuracy":
                    pts = sorted({0, *(int(p) for r in res[arm] for p in r["evals"])})
                    vals = np.array(
                        [[r["untrained_acc"] if p == 0 else r["evals"][str(p)] for p in pts] for r in res[arm]]
                    )
                    m, s = vals.mean(0), vals.std(0, ddof=1) if len(vals) > 1 else np.zeros(len(pts))
                    ax.errorbar(pts, m, yerr=s, color=colours[arm], marker="o", ms=3, capsize=2, label=ARMS[arm][2])
                    continue
                x, m, s = figlib.curve(hs, key)
                if np.isnan(m).all():
                    continue
                figlib.mean_line(
                    ax, x, m, s, colours[arm], 0.0, None, style, lw=1.1, label=ARMS[arm][2] if j == 0 else None
                )
        untrained_accs = [r["untrained_acc"] for rows in res.values() for r in rows]
        if keys[0] == "eval/accuracy" and untrained_accs:
            ax.axhline(0.5 * np.mean(untrained_accs), color="grey", ls=":", lw=1)
        if keys[0] == "kv/saving":
            ax.axhspan(0.35, 0.53, color="grey", alpha=0.2, lw=0)
        ax.set_title(title, fontsize=7)
        ax.set(xlabel="iteration", ylabel=ylabel, xlim=(0, data["iterations"]))
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(f"SmolLM2-135M, {data['setting']}: {data['recorded_runs']} of {data['planned_runs']} runs", fontsize=8)
    handles = {label: h for ax in axes for h, label in zip(*ax.get_legend_handles_labels())}
    if handles:  # one legend for the figure, below the panels
        fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=2, frameon=False, fontsize=7)
    return fig


def arguments(p) -> None:
    p.add_argument("--setting", default=DEFAULT_SETTING, choices=list(SETTINGS))
    p.add_argument("--iterations", type=int, default=ITERATIONS)
    p.add_argument("--eval-every", type=int, default=EVAL_EVERY)
    p.add_argument(
        "--records",
        help="where each finished run's record goes (default <out>/records): "
        "planned runs with a matching record are not trained again",
    )
    p.add_argument(
        "--commit-records",
        action="store_true",
        help="git-commit each record the moment its run finishes (a study spanning machines)",
    )
    p.add_argument(
        "--render-only", action="store_true", help="train nothing: results.md and the figure from the records present"
    )
    p.add_argument(
        "--replay",
        metavar="RUN",
        help="train the recorded run RUN (e.g. naive/seed0) again for its first --replay-iterations and compare "
        "with its record exactly (experiments/lib/run_replay.py), then render; nothing else trains",
    )
    p.add_argument("--replay-iterations", type=int, default=2)
    p.add_argument(
        "--only",
        nargs="+",
        metavar="RUN",
        help="train only these missing planned runs (e.g. sparse_rl/seed2): one study spread over "
        "processes pinned to separate cores (taskset), each starting when its core frees",
    )


FIGURE = figlib.Figure(
    "real/collapse",
    __doc__,
    run,
    render,
    arguments=arguments,
    seeds=SEEDS,
    default_config=CONFIG,
    eval_prompts=True,
    beside=run_replay.replays,
)


def main(argv=None) -> dict:
    """FIGURE.main, writing each setting to experiments/results/real/collapse/<setting> by default."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--out" not in argv and "--replot" not in argv:
        setting = argv[argv.index("--setting") + 1] if "--setting" in argv else DEFAULT_SETTING
        argv += ["--out", os.path.join(figlib.HERE, "results", "real", "collapse", setting)]
    if "--runs-dir" not in argv and "--replot" not in argv:
        argv += ["--runs-dir", RUNS]
    return FIGURE.main(argv)


if __name__ == "__main__":
    main()
