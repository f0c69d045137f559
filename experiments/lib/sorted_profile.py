"""Profile SortedRL inside training: where `Trainer.step` spends its time, per iteration, counted
the same way for every arm.

Runs the arms of fig_sortedrl (the batch scheduler with n x rollout.prompts prompts per rollout,
SortedRL on-policy and partial) on the long-tailed workload (experiments/configs/long_tail.yaml)
from the same warm start, one process, one arm after the other, the same number of update batches
each (--iterations, whole groups of n), every step timed by step_timing (its wall time and the
compile time inside it, from jax.monitoring's compile spans, each second counted once). Each
iteration's rollout (the rollout source's `next`) is split into
  compile   jit tracing, lowering and XLA compilation inside the rollout,
  decode    device decode: the engine's segments (dispatch and wait; the static sampler's
            generate call),
  insert    prefill of new / resumed requests and their scatter into slots (and the insert
            buckets' warm-up),
  harvest   copies of finished (and, at a harvest, unfinished) responses to the host, releases,
  host      the rest of the rollout (scheduler bookkeeping, group loading, prompt padding,
            Finished -> Rollout): the rollout's wall time less the four above, each of them with
            the compile inside it taken out once (>= 0 up to timer noise),
and, inside decode, the idle slot-seconds / Q of the segments' waits (at each segment's
occupancy, 1 - active / (Q x steps)) run while the scheduler's queue was empty (drain: grouped loading's tail, or on-policy prompts held
back) and of the others (idle: slots that finished mid-segment and wait for the host). The engine
runs with its `sync` flag (each insert and harvest blocked on), so each call's device time lands
in that call (its bubble accounting moves it back into the next segment, as without sync).

Fair numbers per arm (step_timing.account): the whole run's wall time with compile (every arm
compiles once) and without it, and the steady state (the update batches after the first group)
per update batch with compile excluded, with the XLA compilations it held (0 expected).

    taskset -c 1 python experiments/bench/profile_sorted.py --label fair
    python experiments/bench/profile_sorted.py --label smoke --iterations 4 --smoke --out /tmp/profile

Results: experiments/results/profile_sorted.{json,md} (one entry per --label). Not a test.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import shlex
import sys
import tempfile
import time

import jax
import numpy as np

from experiments.lib import figlib, figprov, step_timing
from sparserl_jax import compile_clock
from sparserl_jax.config import load_config
from sparserl_jax.rollout import engine as engine_mod
from sparserl_jax.train import Trainer

N_GROUP = 4
ARMS = {  # name -> overrides on top of the warm start ({P}: n x rollout.prompts, {I}: iterations)
    "batch": ("rl.mode=dense", "kv.policy=none", "rollout.prompts={P}", "train.iterations={I}"),
    "sorted_on_policy": (
        "rl.mode=dense",
        "kv.policy=none",
        "rollout.scheduler=sorted",
        f"sorted.group_batches={N_GROUP}",
        "sorted.mode=on_policy",
        "sorted.requeue=hold",  # the rule the committed profiles and bench_sorted's trainer rows measured
        "train.iterations={I}",
    ),
    "sorted_partial": (
        "rl.mode=sparse_rl",
        "kv.policy=none",
        "rollout.scheduler=sorted",
        f"sorted.group_batches={N_GROUP}",
        "sorted.mode=partial",
        "train.iterations={I}",
    ),
}
PARTS = ("compile", "decode", "insert", "harvest", "host")
ACCOUNTING = "compile_clock"  # entries recorded with this file's accounting (meta["accounting"])


class Recorder:
    """Per-iteration rollout parts, filled by wrappers around the engine's host methods: each
    call's wall time less the compile inside it (calls made inside a wrapped call count in it)."""

    def __init__(self):
        self.trainer = None
        self.depth = 0
        self.reset()

    def reset(self):
        self.t = collections.defaultdict(float)
        self.n = collections.defaultdict(int)

    def wrap(self, cls, name, part):
        fn, rec = getattr(cls, name), self

        def timed(self_, *args, **kwargs):
            if rec.depth:  # inside another wrapped call: counted there
                return fn(self_, *args, **kwargs)
            queue_empty = rec._queue_empty()
            self_.sync = True  # block on each insert and harvest: its device time lands in it
            since, s0, tic = compile_clock.Since(), dict(vars(self_.stats)), time.perf_counter()
            rec.depth += 1
            try:
                out = fn(self_, *args, **kwargs)
            finally:
                rec.depth -= 1
            dt = time.perf_counter() - tic - since.seconds
            if part == "insert" and not rec.n[part]:
                rec.t["first_insert"] += dt  # the first device call after the update
            rec.t[part] += dt
            rec.n[part] += 1
            if name == "segment_wait":  # the waited time's idle slots, at the segment's occupancy
                s1 = vars(self_.stats)
                active = s1["active_slot_steps"] - s0["active_slot_steps"]
                slot_steps = s1["slot_steps"] - s0["slot_steps"]
                rec.t["drain" if queue_empty else "idle"] += (1.0 - active / max(slot_steps, 1)) * dt
            return out

        setattr(cls, name, timed)

    def _queue_empty(self) -> bool:
        s = getattr(self.trainer.source, "scheduler", None) if self.trainer is not None else None
        return s is not None and not s.queue


def instrument(rec: Recorder) -> None:
    """Time the engine's host methods (SlotEngine is built inside each trainer's source)."""
    eng = engine_mod.SlotEngine
    for name, part in (
        ("segment_start", "decode"),
        ("segment_wait", "decode"),
        ("insert", "insert"),
        ("warm_up", "insert"),
        ("harvest_start", "harvest"),
        ("harvest_read", "harvest"),
        ("release_all", "harvest"),
    ):
        rec.wrap(eng, name, part)


def iterations_per_arm(update_batches: int) -> int:
    """--iterations rounded up to whole groups of n update batches."""
    return N_GROUP * max(-(-update_batches // N_GROUP), 1)


def run_arm(name: str, study: figlib.Study, rec: Recorder, update_batches: int) -> list[dict]:
    base = study.base
    batches = iterations_per_arm(update_batches)
    per_iter = N_GROUP if name == "batch" else 1
    extra = [o.format(P=N_GROUP * base.rollout.prompts, I=batches // per_iter) for o in ARMS[name]]
    out_dir = tempfile.mkdtemp(prefix=f"profile_{name}_")
    cfg = load_config(
        [study.config],
        study.overrides
        + [
            f"model.init_from={study.warm_start_dir()}",
            *figlib.FROM_WARM_START,
            "train.progress=false",
            f"train.out_dir={out_dir}",
            *extra,
        ],
    )
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    trainer.start()
    rec.trainer = trainer
    rows = []
    with step_timing.timed_steps():
        for i in range(cfg.train.iterations):
            rec.reset()
            m = trainer.step()
            trainer.iteration += 1
            roll = m["time/rollout_wall_s"]
            r = {
                "iteration": i + 1,
                "update_batches": per_iter,
                "group": m.get("sorted/group", float(i)),
                **{k: m[k] for k in step_timing.KEYS},
                "score_s": m["time/score_s"],
                "update_s": m["time/update_s"],
                "tokens": float(m["response/length_mean"]) * trainer.batch_rows,
                "bubble_slots": m["rollout/bubble_slots"],
                "bubble_wall": m["rollout/bubble_wall"],
                "reward": m["reward/mean"],
                "discarded": m.get("sorted/discarded_token_fraction", 0.0),
                "compile_s": m["time/rollout_compile_s"],
            }
            for part in ("insert", "first_insert", "harvest", "drain", "idle"):
                r[f"{part}_s"] = rec.t[part]
            for part in ("decode", "insert", "harvest"):
                r[f"n_{part}"] = rec.n[part]
            if name == "batch":  # one generate call: decode is the rest, idle slots its bubble
                r["decode_s"] = roll - r["compile_s"]
                r["idle_s"] = r["decode_s"] * m["rollout/bubble_slots"]
                r["n_decode"] = 1
            else:
                r["decode_s"] = rec.t["decode"]
            r["host_s"] = roll - sum(r[f"{p}_s"] for p in PARTS if p != "host")
            rows.append(r)
            print(
                f"[{name}] it {i + 1}: " + " ".join(f"{k}={v:.3g}" for k, v in r.items() if isinstance(v, float)),
                flush=True,
            )
    return rows


def summary(rows: list[dict]) -> dict:
    """Totals over the run, the fair numbers (step_timing.account) and the steady state's
    rollout throughput (tokens / rollout time, compile excluded)."""
    per_iter = rows[0]["update_batches"]
    fair = step_timing.account(rows, per_iter, N_GROUP)
    steady = rows[N_GROUP // per_iter :] or rows
    tot = lambda k, rs=rows: float(sum(r[k] for r in rs))  # noqa: E731
    steady_roll = tot("time/rollout_wall_s", steady) - tot("time/rollout_compile_s", steady)
    s = {
        "iterations": len(rows),
        **fair,
        "tokens": tot("tokens"),
        "rollout_s": tot("time/rollout_wall_s"),
        "rollout_compile_s": tot("compile_s"),
        "tokens_per_s_steady": tot("tokens", steady) / max(steady_roll, 1e-9),
        "bubble_slots": float(np.mean([r["bubble_slots"] for r in rows])),
        "bubble_wall": float(np.mean([r["bubble_wall"] for r in rows])),
        "reward": float(np.mean([r["reward"] for r in rows])),
    }
    for p in ("decode", "insert", "harvest", "host", "drain", "idle", "score", "update", "first_insert"):
        s[f"{p}_s"] = tot(f"{p}_s")
    return s


def markdown(data: dict) -> str:
    lines = [
        "# SortedRL in training: time profile",
        "",
        "Every arm trains the same number of update batches from the same warm start and is "
        "timed the same way (experiments/lib/step_timing.py): each step's wall time and the "
        "compile time inside it (jax.monitoring compile spans, each second counted once). "
        "Wall s: the whole run's steps with compile (every arm compiles once) and without it; "
        "steady s / batch: a step's time per update batch after the first group (the first n "
        "update batches; the batch arm's first iteration), compile excluded, with the XLA "
        "compilations it held (0 expected); steady tok/s: those update batches' rollout tokens "
        "/ their rollout time without compile. The rollout split (totals over the run): compile "
        "(inside the rollout), decode (engine segments / static generate), insert (prefill + "
        "scatter), harvest (copies to host), host (the rest), each without the compile inside "
        "it; drain and idle are the idle slot-seconds / Q of the segment waits (at each segment's "
        "occupancy) with the queue empty and not empty; 1st insert: each rollout's first insert, the first device call "
        "after the update. The engine runs with sync=True here (each insert and harvest "
        "blocked on), which fig_sortedrl's runs do not.",
        "",
    ]
    old = [label for label, e in data.items() if e["meta"].get("accounting") != ACCOUNTING]
    if old:
        lines += [
            f"Entries {', '.join(old)} of profile_sorted.json were recorded with the earlier "
            "accounting (compile as a sum of event durations, counting nested traces twice, "
            "and the batch arm's window holding an update recompile): not shown.",
            "",
        ]
    for label, entry in data.items():
        if label in old:
            continue
        meta = entry["meta"]
        lines += [
            f"## {label}",
            "",
            f"`{meta['command']}` ({meta['date']}, {meta['commit']}, {meta['device']}, jax {meta['jax']})",
            "",
            "| arm | update batches | wall s | wall s (no compile) | compile s | compiles | "
            "steady s / batch | steady rollout s / batch | steady compiles | steady tok/s | "
            "vs batch | bubble slots | bubble wall | reward |",
            "|" + "---|" * 14,
        ]
        base = entry["arms"].get("batch", {}).get("summary")
        for arm, a in entry["arms"].items():
            s = a["summary"]
            ratio = "—" if not base else f"{s['tokens_per_s_steady'] / base['tokens_per_s_steady']:.2f}x"
            lines.append(
                f"| {arm} | {s['update_batches']} | {s['wall_s']:.1f} | {s['wall_s_no_compile']:.1f} | "
                f"{s['compile_s']:.1f} | {s['compiles']:.0f} | {s['steady_s_per_batch']:.3f} | "
                f"{s['steady_rollout_s_per_batch']:.3f} | {s['steady_compiles']:.0f} | "
                f"{s['tokens_per_s_steady']:.0f} | {ratio} | {s['bubble_slots']:.1%} | "
                f"{s['bubble_wall']:.1%} | {s['reward']:.3f} |"
            )
        lines += [
            "",
            "The rollout split, totals over the run (s):",
            "",
            "| arm | rollout | compile | decode | insert (1st) | harvest | host | drain | idle | score | update |",
            "|" + "---|" * 11,
        ]
        for arm, a in entry["arms"].items():
            s = a["summary"]
            lines.append(
                f"| {arm} | {s['rollout_s']:.2f} | {s['rollout_compile_s']:.2f} | {s['decode_s']:.2f} | "
                f"{s['insert_s']:.2f} ({s['first_insert_s']:.2f}) | {s['harvest_s']:.2f} | "
                f"{s['host_s']:.2f} | {s['drain_s']:.2f} | {s['idle_s']:.2f} | {s['score_s']:.2f} | "
                f"{s['update_s']:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--label", required=True, help="the entry to (re)write, e.g. fair")
    p.add_argument("--config", default=os.path.join(figlib.HERE, "configs", "long_tail.yaml"))
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument(
        "--iterations", type=int, default=24, help="update batches per arm (rounded up to whole groups of 4)"
    )
    p.add_argument("--smoke", action="store_true", help="figlib's smoke settings (seconds-long runs)")
    p.add_argument("--runs-dir", default=os.path.join(figlib.REPO, "runs", "profile"))
    p.add_argument("--out", default=os.path.join(figlib.HERE, "results", "profile_sorted"))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    overrides = list(args.overrides) + (figlib.smoke_overrides(args.config, args.overrides) if args.smoke else [])
    study = figlib.Study(args.config, overrides, args.runs_dir, log=lambda *a: None)
    study.warm_start_dir()
    rec = Recorder()
    instrument(rec)
    arms = {}
    for name in args.arms:
        rows = run_arm(name, study, rec, args.iterations)
        arms[name] = {"rows": rows, "summary": summary(rows)}
    meta = {
        "command": " ".join(["python"] + [shlex.quote(a) for a in sys.argv]),
        "commit": figprov.commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "affinity": sorted(os.sched_getaffinity(0)),
        "accounting": ACCOUNTING,
    }
    path = args.out + ".json"
    data = json.load(open(path)) if os.path.exists(path) else {}
    data[args.label] = {"meta": meta, "arms": arms}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(data))
    print(markdown({args.label: data[args.label]}))
    return data[args.label]
