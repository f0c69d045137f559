"""Profile SortedRL inside training: where `Trainer.step` spends its rollout time, per iteration.

Runs the arms of fig_sortedrl (the batch scheduler with n x rollout.prompts prompts per rollout,
SortedRL on-policy and partial) on the long-tailed workload (experiments/configs/long_tail.yaml)
from the same warm start, one process, one arm after the other, and splits each iteration's
rollout wall time into
  compile   jit tracing, lowering and XLA compilation (jax.monitoring compile events; counted
            as misses of every jit cache, the engine's and the sampler's),
  decode    device decode: the engine's segments (the static sampler's generate call),
  insert    prefill of new / resumed requests and their scatter into slots,
  harvest   gathers of finished (and, at a harvest, unfinished) responses to the host,
  host      everything else inside the rollout (scheduler bookkeeping, group loading, prompt
            padding, Finished -> Rollout),
and, inside decode, the idle slot-seconds / Q of the segments run while the scheduler's queue
was empty (drain: grouped loading's tail, nothing left to refill with) and of the others
(idle: slots that finished mid-segment and wait for the host). Throughput is total tokens /
total rollout time with compile time excluded. The engine runs with its `sync` flag (every
device call blocked on), so each call's device time lands in that call; compile events inside
nested jit traces may be counted twice in a first iteration (its host column can go negative).

    taskset -c 1 python experiments/profile_sorted.py --label before

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
from jax._src import dispatch

import figlib
from sparserl_jax.config import load_config
from sparserl_jax.rollout import engine as engine_mod
from sparserl_jax.train import Trainer

N_GROUP = 4
ARMS = {  # name -> overrides on top of the warm start
    "batch": ("rl.mode=dense", "kv.policy=none", f"rollout.prompts={{P}}", "train.iterations={I}"),
    "sorted_on_policy": ("rl.mode=dense", "kv.policy=none", "rollout.scheduler=sorted",
                         f"sorted.group_batches={N_GROUP}", "sorted.mode=on_policy"),
    "sorted_partial": ("rl.mode=sparse_rl", "kv.policy=none", "rollout.scheduler=sorted",
                       f"sorted.group_batches={N_GROUP}", "sorted.mode=partial"),
}
COMPILE_EVENTS = (dispatch.JAXPR_TRACE_EVENT, dispatch.JAXPR_TO_MLIR_MODULE_EVENT,
                  dispatch.BACKEND_COMPILE_EVENT)
PARTS = ("compile", "decode", "insert", "harvest", "host")


class Recorder:
    """Per-iteration timers filled by wrappers around the engine's host methods and by the
    jax.monitoring compile events (a compile inside a timed call is moved out of it)."""

    def __init__(self):
        self.trainer = None
        self.in_rollout = False
        self.reset()
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def reset(self):
        self.t = collections.defaultdict(float)
        self.n = collections.defaultdict(int)

    def _on_event(self, event, duration, **_):
        if event in COMPILE_EVENTS:
            where = "compile" if self.in_rollout else "train_compile"
            self.t[where] += duration
            self.n[where] += event == dispatch.BACKEND_COMPILE_EVENT

    def wrap(self, cls, name, part):
        fn = getattr(cls, name)
        rec = self

        def timed(self_, *args, **kwargs):
            queue_empty = rec._queue_empty()
            self_.sync = True  # block on each device call: its device time lands in that call
            c0, s0, t0 = rec.t["compile"], dict(vars(self_.stats)), time.perf_counter()
            out = fn(self_, *args, **kwargs)
            dt = time.perf_counter() - t0 - (rec.t["compile"] - c0)
            if part == "insert" and not rec.n[part]:
                rec.t["first_insert"] += dt  # the first device call after the update
            rec.t[part] += dt
            rec.n[part] += 1
            if part == "decode" and vars(self_.stats)["slot_steps"] > s0["slot_steps"]:
                s1 = vars(self_.stats)
                active = s1["active_slot_steps"] - s0["active_slot_steps"]
                steps = (s1["slot_steps"] - s0["slot_steps"]) / self_.Q
                idle = (1.0 - active / max(self_.Q * steps, 1)) * dt  # idle slot-seconds / Q
                rec.t["drain" if queue_empty else "idle"] += idle
                rec.n["slot_steps"] += int(self_.Q * steps)
                rec.n["active_slot_steps"] += active
            return out

        setattr(cls, name, timed)

    def wrap_rollout(self):
        fn, rec = Trainer.rollout_batch, self

        def rollout_batch(self_, *args, **kwargs):
            rec.in_rollout = True
            try:
                return fn(self_, *args, **kwargs)
            finally:
                rec.in_rollout = False

        Trainer.rollout_batch = rollout_batch

    def _queue_empty(self) -> bool:
        s = self.trainer.source.scheduler if self.trainer is not None else None
        return s is not None and not s.queue


def run_arm(name: str, study: figlib.Study, rec: Recorder, iterations: int) -> list[dict]:
    base = study.base
    extra = [o.format(P=N_GROUP * base.rollout.prompts, I=max(iterations // N_GROUP, 1))
             for o in ARMS[name]]
    if name != "batch":
        extra.append(f"train.iterations={iterations}")
    out_dir = tempfile.mkdtemp(prefix=f"profile_{name}_")
    cfg = load_config([study.config], study.overrides + [
        f"model.init_from={study.warm_start_dir()}", *figlib.FROM_WARM_START, "train.progress=false",
        f"train.out_dir={out_dir}", *extra])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    trainer.start()
    rec.trainer = trainer
    rows = []
    for i in range(cfg.train.iterations):
        rec.reset()
        t0 = time.perf_counter()
        m = trainer.step()
        trainer.iteration += 1
        wall = time.perf_counter() - t0
        t_roll = m["time/rollout_s"]
        r = {"iteration": i + 1, "wall_s": wall, "rollout_s": t_roll,
             "score_s": m["time/score_s"], "update_s": m["time/update_s"],
             "tokens": float(m["response/length_mean"]) * trainer.batch_rows,
             "bubble_slots": m["rollout/bubble_slots"], "bubble_wall": m["rollout/bubble_wall"],
             "reward": m["reward/mean"], "compiles": rec.n["compile"],
             "train_compiles": rec.n["train_compile"],
             "discarded": m.get("sorted/discarded_token_fraction", 0.0),
             "group": m.get("sorted/group", float(i))}
        for part in ("compile", "train_compile", "insert", "first_insert", "harvest", "drain", "idle"):
            r[f"{part}_s"] = rec.t[part]
        for part in ("decode", "insert", "harvest"):
            r[f"n_{part}"] = rec.n[part]
        if name == "batch":  # one generate call: decode is the rest, idle slots its bubble
            r["decode_s"] = t_roll - rec.t["compile"]
            r["idle_s"] = r["decode_s"] * m["rollout/bubble_slots"]
            r["n_decode"] = 1
        else:
            r["decode_s"] = rec.t["decode"]
        r["host_s"] = t_roll - sum(r[f"{p}_s"] for p in PARTS if p != "host")
        rows.append(r)
        print(f"[{name}] it {i + 1}: " + " ".join(f"{k}={v:.3g}" for k, v in r.items()
                                                  if isinstance(v, float)), flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    """Totals over the run with compile excluded, and over the iterations after the first group."""
    tot = lambda k, rs=rows: float(sum(r[k] for r in rs))  # noqa: E731
    first = rows[0]["group"]
    later = [r for r in rows if r["group"] != first] or rows
    roll = tot("rollout_s") - tot("compile_s")
    s = {
        "iterations": len(rows), "tokens": tot("tokens"), "compiles": tot("compiles"),
        "rollout_s": tot("rollout_s"), "compile_s": tot("compile_s"), "rollout_s_no_compile": roll,
        "tokens_per_s": tot("tokens") / max(roll, 1e-9),
        "tokens_per_s_after_first_group": tot("tokens", later) / max(tot("rollout_s", later), 1e-9),
        "wall_s": tot("wall_s"),
        "wall_s_no_compile": tot("wall_s") - tot("compile_s") - tot("train_compile_s"),
        "wall_s_after_first_group": tot("wall_s", later),
        "bubble_slots": float(np.mean([r["bubble_slots"] for r in rows])),
        "bubble_wall": float(np.mean([r["bubble_wall"] for r in rows])),
        "reward": float(np.mean([r["reward"] for r in rows])),
    }
    for p in PARTS + ("drain", "idle", "score", "update", "first_insert"):
        s[f"{p}_s"] = tot(f"{p}_s")
    return s


def markdown(data: dict) -> str:
    lines = ["# SortedRL in training: rollout time profile", "",
             "Per arm, totals over the run (per-iteration rows in profile_sorted.json). Columns: "
             "compile (jit trace + lower + XLA compile), decode (engine segments / static generate), "
             "insert (prefill + scatter), harvest (gathers to host), host (the rest of the rollout); "
             "drain and idle are the idle slot-seconds / Q inside decode with the queue empty "
             "(grouped loading's tail) and not empty (slots waiting for the host); 1st insert: the "
             "rollout's first insert, the first device call after the update (its memory is cold "
             "on this CPU: ~20-40 ms for a ~4 ms prefill). Throughput is total tokens / total rollout "
             "time, over the update batches after the first group (which compiles; the headline "
             "\"vs batch\" ratio) and, in brackets, over the whole run with the measured compile time "
             "subtracted (compile events nested in one trace can be counted twice, so this "
             "form flatters an arm that compiles more). Wall = rollout + score + diagnostics + "
             "update, compile excluded. The engine runs with sync=True here (each insert and "
             "harvest blocked on), which fig_sortedrl's runs do not.", ""]
    for label, entry in data.items():
        meta = entry["meta"]
        lines += [f"## {label}", "", f"`{meta['command']}` ({meta['date']}, {meta['commit']}, "
                  f"{meta['device']}, jax {meta['jax']})", "",
                  "| arm | iters | compiles | compile s | decode s | insert s (1st) | harvest s | host s | "
                  "drain s | idle s | rollout s (no compile) | tokens | tok/s (no compile) | "
                  "tok/s after 1st group | vs batch | wall s (no compile) | bubble slots | "
                  "bubble wall | reward |",
                  "|" + "---|" * 19]
        base = entry["arms"].get("batch", {}).get("summary")
        for arm, a in entry["arms"].items():
            s = a["summary"]
            ratio = ("—" if not base else f"{s['tokens_per_s_after_first_group'] / base['tokens_per_s_after_first_group']:.2f}x "
                     f"({s['tokens_per_s'] / base['tokens_per_s']:.2f}x)")
            lines.append(
                f"| {arm} | {s['iterations']} | {s['compiles']:.0f} | {s['compile_s']:.1f} | "
                f"{s['decode_s']:.2f} | {s['insert_s']:.2f} ({s.get('first_insert_s', float('nan')):.2f}) | "
                f"{s['harvest_s']:.2f} | {s['host_s']:.2f} | "
                f"{s['drain_s']:.2f} | {s['idle_s']:.2f} | {s['rollout_s_no_compile']:.2f} | "
                f"{s['tokens']:.0f} | {s['tokens_per_s']:.0f} | {s['tokens_per_s_after_first_group']:.0f} | "
                f"{ratio} | {s['wall_s_no_compile']:.1f} | "
                f"{s['bubble_slots']:.1%} | {s['bubble_wall']:.1%} | {s['reward']:.3f} |")
        lines += ["", "Per update batch (the batch arm: its iterations / n), after the first group (ms, mean): "
                  "the rollout split and the rest of the step.", "",
                  "| arm | iterations | decode | insert | harvest | host | compile | drain | idle | "
                  "rollout | score | update | wall |", "|" + "---|" * 13]
        for arm, a in entry["arms"].items():
            rows = [r for r in a["rows"] if r["group"] != a["rows"][0]["group"]] or a["rows"]
            per = {}
            for r in rows:  # the batch arm's iteration is n update batches
                for k in ("decode", "insert", "harvest", "host", "compile", "drain", "idle",
                          "rollout", "score", "update", "wall"):
                    per[k] = per.get(k, 0.0) + r[f"{k}_s"] * 1e3
            k_batches = len(rows) * (N_GROUP if arm == "batch" else 1)
            lines.append(f"| {arm} | {len(rows)} | " + " | ".join(
                f"{v / k_batches:.0f}" for v in per.values()) + " |")
        lines.append("")
    return "\n".join(lines)


def instrument(rec: Recorder) -> None:
    """Time the trainer's rollout and the engine's lowest-level host methods (before this
    commit's engine: segment and harvest; after: their start / wait (read) halves)."""
    rec.wrap_rollout()
    eng = engine_mod.SlotEngine
    split = hasattr(eng, "segment_start")
    for name, part in ((("segment_start", "decode"), ("segment_wait", "decode"),
                        ("harvest_start", "harvest"), ("harvest_read", "harvest")) if split else
                       (("segment", "decode"), ("harvest", "harvest"))) + (
                           ("insert", "insert"), ("release_all", "harvest")):
        rec.wrap(eng, name, part)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--label", required=True, help="the entry to (re)write, e.g. before / after")
    p.add_argument("--config", default=os.path.join(figlib.HERE, "configs", "long_tail.yaml"))
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--iterations", type=int, default=24, help="update batches per arm")
    p.add_argument("--runs-dir", default=os.path.join(figlib.REPO, "runs", "profile"))
    p.add_argument("--out", default=os.path.join(figlib.HERE, "results", "profile_sorted"))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    study = figlib.Study(args.config, args.overrides, args.runs_dir, log=lambda *a: None)
    study.warm_start_dir()
    rec = Recorder()
    instrument(rec)
    arms = {}
    for name in args.arms:
        rows = run_arm(name, study, rec, args.iterations)
        arms[name] = {"rows": rows, "summary": summary(rows)}
    commit = os.popen(f"git -C {figlib.REPO} rev-parse --short HEAD").read().strip()
    meta = {"command": " ".join(["python"] + [shlex.quote(a) for a in sys.argv]), "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "affinity": sorted(os.sched_getaffinity(0))}
    path = args.out + ".json"
    data = json.load(open(path)) if os.path.exists(path) else {}
    data[args.label] = {"meta": meta, "arms": arms}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(data))
    print(markdown({args.label: data[args.label]}))


if __name__ == "__main__":
    main()
