"""Benchmark continuous batching: the static sampler vs the slot engine on a long-tailed workload.

N requests with forced response lengths (most short, a few at the cap; the same lengths for both,
so the comparison is exact) are decoded by
  - the static sampler: batches of Q rows, each decoded until its longest row ends, and
  - the slot engine: Q slots refilled as soon as a response ends (FIFO, no scheduling policy),
with a dense and a sparse (snapkv) cache. Reported: generated tokens/s (wall, after a warm-up run
that compiles everything; any compile time left in a timed run, from sparserl_jax.compile_clock,
is subtracted from both arms alike and its compilations counted: 0 expected), the slot-step bubble
1 - active slot-steps / (Q x steps) and, for the engine, SortedRL's wall-time bubble (Eq. 4 as
rollout/engine.py counts it: insert and harvest host time idle, their device work inside the next
segment's interval, compile apart). Target: when the static bubble is >= 60%, engine slot bubble
<= 10% and tokens/s >= 1.8x.

The "trainer" rows put the same comparison inside training beside it: `Trainer.step` on the
long-tailed task (experiments/configs/long_tail.yaml, from its warm start) with the batch
scheduler (n x rollout.prompts prompts per rollout) and SortedRL on-policy and partial, the same
update batches each, timed as experiments/bench/profile_sorted.py times them (step_timing: compile
counted the same way in every arm): steady-state rollout tokens / rollout time and seconds per
update batch with compile excluded, and the whole run's wall time with compile included.

    taskset -c 0 python experiments/bench/bench_sorted.py
    taskset -c 0 python experiments/bench/bench_sorted.py --requests 64 --slots 8 --max-new 64 --quick \
        --trainer-iterations 0

Not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time

import jax

from experiments.lib import engine_bench
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig


def bench(policy: str, args, model_cfg, params, prompts, plens, limits) -> dict:
    """One cache's row: engine_bench.compare with this script's settings (snapkv window 4)."""
    row, lengths = engine_bench.compare(
        params,
        model_cfg,
        prompts,
        plens,
        limits,
        policy=policy,
        slots=args.slots,
        max_new=args.max_new,
        budget=args.budget,
        buffer=args.buffer,
        window=4,
        segment_chunks=args.segment_chunks,
    )
    if not (lengths["engine"] == limits).all():
        raise RuntimeError(f"policy={policy}: the slot engine did not decode the forced lengths")
    return row


def trainer_bench(iterations: int, smoke: bool = False, runs_dir: str | None = None) -> list[dict]:
    """The trainer rows: profile_sorted's arms through Trainer.step, one process, the same update
    batches each (`iterations`, whole groups of n); `smoke`: figlib's seconds-long settings."""
    from experiments.lib import figlib
    from experiments.lib import sorted_profile as prof

    config = os.path.join(figlib.HERE, "configs", "long_tail.yaml")
    overrides = figlib.smoke_overrides(config) if smoke else []
    study = figlib.Study(
        config, overrides, runs_dir or os.path.join(figlib.REPO, "runs", "profile"), log=lambda *a: None
    )
    rec = prof.Recorder()
    prof.instrument(rec)
    got = {arm: prof.summary(prof.run_arm(arm, study, rec, iterations)) for arm in prof.ARMS}
    base = got.pop("batch")
    key = "tokens_per_s_steady"
    return [
        {
            "arm": arm.removeprefix("sorted_"),
            "static_tokens_per_s": base[key],
            "engine_tokens_per_s": s[key],
            "speedup": s[key] / base[key],
            "static_bubble": base["bubble_slots"],
            "engine_bubble_slots": s["bubble_slots"],
            "engine_bubble_wall": s["bubble_wall"],
            "batch_s_per_update_batch": base["steady_s_per_batch"],
            "sorted_s_per_update_batch": s["steady_s_per_batch"],
            "batch_wall_s": base["wall_s"],
            "sorted_wall_s": s["wall_s"],
            "update_batches": s["update_batches"],
            "batch": base,
            "sorted": s,
        }
        for arm, s in got.items()
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--max-new", type=int, default=512)
    p.add_argument("--short", type=int, nargs=2, default=(16, 64))
    p.add_argument("--long-frac", type=float, default=0.1)
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--buffer", type=int, default=8)
    p.add_argument("--segment-chunks", type=int, default=1)
    p.add_argument("--policies", nargs="+", default=["none", "snapkv"])
    p.add_argument("--quick", action="store_true", help="small model (d_model 64) for a smoke run")
    p.add_argument(
        "--trainer-iterations",
        type=int,
        default=16,
        help="update batches per arm in the trainer rows, whole groups of 4 (0: none)",
    )
    p.add_argument(
        "--trainer-smoke", action="store_true", help="the trainer rows with figlib's smoke settings (seconds-long runs)"
    )
    p.add_argument("--runs-dir", default=None, help="the trainer rows' warm start (default runs/profile)")
    p.add_argument("--out", default="experiments/results/bench_sorted")
    args = p.parse_args(argv)
    dims = (
        dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128)
        if args.quick
        else dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32, d_ff=512)
    )
    model_cfg = ModelConfig.tiny("qwen2", vocab_size=512, max_seq_len=4096, **dims)
    params = tf.init_params(model_cfg, jax.random.key(0))
    limits = engine_bench.workload(
        args.requests, max_new=args.max_new, short=tuple(args.short), long_frac=args.long_frac
    )
    prompts, plens = engine_bench.requests(args.requests, prompt_len=32, vocab=512)
    t0 = time.time()
    rows = [bench(pol, args, model_cfg, params, prompts, plens, limits) for pol in args.policies]
    trainer_rows = (
        trainer_bench(args.trainer_iterations, args.trainer_smoke, args.runs_dir) if args.trainer_iterations else []
    )
    cmd = " ".join(["python"] + [shlex.quote(a) for a in sys.argv])
    meta = {
        "command": cmd,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "args": vars(args),
        "model": {
            k: getattr(model_cfg, k)
            for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size")
        },
        "run_s": time.time() - t0,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows, "trainer_rows": trainer_rows}, f, indent=1)
    print(write_markdown(args.out, {"meta": meta, "rows": rows, "trainer_rows": trainer_rows}))


def write_markdown(out: str, data: dict) -> str:
    """<out>.md from the saved numbers (python -c to redo it from <out>.json)."""
    meta, rows, trainer_rows = data["meta"], data["rows"], data.get("trainer_rows", [])
    args = argparse.Namespace(**meta["args"])
    lines = [
        "# Continuous batching benchmark: static sampler vs slot engine",
        "",
        f"{meta['device']}, jax {meta['jax']}, {meta['date']}",
        f"`{meta['command']}`",
        "",
        f"{args.requests} requests, Q = {args.slots} slots (static: batches of {args.slots}), forced "
        f"lengths: {args.long_frac:.0%} at the cap {args.max_new}, the rest uniform in "
        f"[{args.short[0]}, {args.short[1]}] ({rows[0]['tokens']} tokens); model {meta['model']}; "
        f"sparse: snapkv budget {args.budget} + buffer {args.buffer}; engine segments of "
        f"{args.segment_chunks} x {args.buffer} steps. Wall time after a warm-up run; run time "
        f"{meta['run_s']:.0f} s. Static bubble = 1 - tokens / (Q x steps) per batch (its wall form is "
        "the same with equal step times).",
        "",
        "Engine bubbles are given over the whole run and, in brackets, until the request queue ran "
        "empty (the steady state; after it the last long responses drain alone, which SortedRL's "
        "harvest-and-continue avoids and a FIFO engine does not).",
        "",
        "| cache | static tok/s | engine tok/s | speedup | static bubble | engine bubble (slot-steps) | engine bubble (wall, Eq. 4) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['static_tokens_per_s']:.0f} | {r['engine_tokens_per_s']:.0f} | "
            f"{r['speedup']:.2f}x | {r['static_bubble']:.1%} | {r['engine_bubble_slots']:.1%} "
            f"({r['engine_bubble_slots_until_drain']:.1%}) | {r['engine_bubble_wall']:.1%} "
            f"({r['engine_bubble_wall_until_drain']:.1%}) |"
        )
    if "engine_compiles" in rows[0]:
        lines += [
            "",
            "XLA compilations inside the timed runs (their time is subtracted from both arms): "
            + ", ".join(f"{r['policy']}: static {r['static_compiles']}, engine {r['engine_compiles']}" for r in rows)
            + ".",
        ]
    if trainer_rows:
        if "batch_wall_s" not in trainer_rows[0]:
            lines += [
                "",
                "Trainer rows recorded with the earlier accounting (compile time not counted "
                "alike in every arm): not shown; rerun with --trainer-iterations.",
            ]
            trainer_rows = []
    if trainer_rows:
        n = trainer_rows[0]["update_batches"]
        shape = (
            "figlib's smoke settings: 2 prompts x 4 samples"
            if getattr(args, "trainer_smoke", False)
            else "Q = 64 slots, groups of 4 x 8 prompts x 8 samples"
        )
        lines += [
            "",
            "Trainer rows: `Trainer.step` on experiments/configs/long_tail.yaml (dense KV, "
            f"{n} update batches per arm: the batch arm in {n // 4} iterations of 4 update "
            f"batches; {shape}; every engine call blocked on, as in profile_sorted), every "
            "arm timed the same way (step_timing: "
            "compile time from jax.monitoring). Steady state: the update batches after the "
            "first group (4), compile excluded: tokens/s = their rollout tokens / rollout time, "
            "s / batch = a whole step per update batch; wall s = the whole run's steps with "
            "compile (every arm compiles once); bubbles are per-iteration means.",
            "",
            "| trainer arm | batch tok/s | sorted tok/s | speedup | batch s / batch | sorted s / batch | "
            "batch wall s | sorted wall s | batch bubble | sorted bubble (slot-steps) | "
            "sorted bubble (wall, Eq. 4) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in trainer_rows:
            lines.append(
                f"| trainer {r['arm']} | {r['static_tokens_per_s']:.0f} | {r['engine_tokens_per_s']:.0f} | "
                f"{r['speedup']:.2f}x | {r['batch_s_per_update_batch']:.3f} | "
                f"{r['sorted_s_per_update_batch']:.3f} | {r['batch_wall_s']:.1f} | "
                f"{r['sorted_wall_s']:.1f} | {r['static_bubble']:.1%} | "
                f"{r['engine_bubble_slots']:.1%} | {r['engine_bubble_wall']:.1%} |"
            )
    text = "\n".join(lines) + "\n"
    with open(out + ".md", "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    main()
