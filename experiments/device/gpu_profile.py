"""The device check's `profile` step: a jax.profiler trace of the sampler's decode on the sampler
step's model (bench_decode.py's profile, random weights in model.dtype), per batch, cache (R-KV,
dense) and with the agreement's top candidates recorded or not (rollout.agreement_k): where a
decode step's time goes, for TensorBoard's profile plugin or Perfetto.

Each case compiles apart, then one call of sizes.profile_steps new tokens (that many decode steps)
runs inside the trace, written to DIR/profile/<case>/; its wall time per step is beside it (the
trace's own overhead included). A case that raises is recorded with its error and the next runs.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax

from experiments.device import gpu_report
from experiments.device.gpu_report import check
from experiments.device.gpu_sizes import Sizes

POLICIES = ("rkv", "none")  # R-KV and dense


def case_name(batch: int, policy: str, k: int) -> str:
    return f"b{batch}_{'dense' if policy == 'none' else policy}_k{k}"


def _files(folder: str) -> int:
    return sum(len(names) for _, _, names in os.walk(folder))


def step_profile(sizes: Sizes, ctx: dict, record):
    """Every (batch, cache, candidates) case traced; DIR/profile/profile.json rewritten after each."""
    from experiments.lib import decode_bench as bench_decode
    from sparserl_jax.model import transformer
    from sparserl_jax.rollout.sampling import AGREEMENT_K

    args = bench_decode.parse_args([*sizes.sampler_argv, "--lengths", str(sizes.profile_steps)])
    _, prof = bench_decode.resolve(args)
    m, steps = prof.model, sizes.profile_steps
    params = jax.block_until_ready(  # the compute copy (model.dtype), which rollouts read
        jax.tree.map(lambda x: x.astype(m.dtype), transformer.init_params(m, jax.random.key(args.seed)))
    )
    root = os.path.join(ctx["out"], "profile")
    os.makedirs(root, exist_ok=True)
    rows = []
    for B in sizes.profile_batches:
        at_b = dataclasses.replace(prof, batch=B)
        prompts_BxP, lengths_B = bench_decode.make_inputs(at_b, jax.random.key(args.seed + 1))
        for policy in POLICIES:
            for k in (AGREEMENT_K, 0):
                name = case_name(B, policy, k)
                folder = os.path.join(root, name)
                row = dict(case=name, batch=B, policy=policy, agreement_k=k, trace=os.path.relpath(folder, ctx["out"]))
                t0 = time.perf_counter()
                try:
                    r = bench_decode.bench_row(
                        params,
                        at_b,
                        policy,
                        steps,
                        prompts_BxP,
                        lengths_B,
                        repeats=1,
                        min_seconds=0,
                        seed=args.seed,
                        attn_impl=args.attn_impl,
                        agreement_k=k,
                        trace_dir=folder,
                    )
                    row.update(step_ms=r["step_ms"], wall_s=r["wall_s"], compile_s=r["compile_s"])
                except Exception as err:  # recorded, the next case runs
                    row["error"] = f"{type(err).__name__}: {gpu_report.one_line(str(err))}"
                row["seconds"] = time.perf_counter() - t0
                row["trace_files"] = _files(folder) if os.path.isdir(folder) else 0
                rows.append(row)
                gpu_report.write_json(os.path.join(root, "profile.json"), {"steps": steps, "rows": rows})
                record({"rows": rows})
    return (*summary(rows, prof, steps, args.attn_impl), {"steps": steps, "rows": rows})


def summary(rows: list[dict], prof, steps: int, attn_impl: str):
    """(checks, markdown lines, figure) of the traced cases."""
    m = prof.model
    bad = [f"{r['case']}: {r.get('error', 'no trace written')}" for r in rows if "error" in r or not r["trace_files"]]
    ran = {(r["batch"], r["policy"], r["agreement_k"]): r["step_ms"] for r in rows if "error" not in r}
    ratios = {}  # ms / step with the candidates off over on, per batch and cache (<= 1: they cost time)
    for (b, p, k), ms in ran.items():
        if k and (b, p, 0) in ran:
            ratios[f"B={b} {'dense' if p == 'none' else p}"] = ran[(b, p, 0)] / ms
    checks = [
        check("every case ran and wrote a trace", "all" if not bad else "; ".join(bad)[:300], "no error", not bad),
        check(
            "candidates off not slower than on (ms / step, off / on)",
            ", ".join(f"{c}: {x:.2f}" for c, x in ratios.items()) or "n/a",
            "<= 1",
            bool(ratios) and max(ratios.values()) <= 1.0,
            kind="goal",
        ),
    ]
    lines = [
        f"Random {m.dtype} weights (L={m.n_layers}, D={m.d_model}, N/K={m.n_heads}/{m.n_kv_heads}, "
        f"V={m.vocab_size}), prompt {prof.prompt_len} tokens, {steps} new tokens (decode steps) per call, "
        f"R-KV {prof.budget} + {prof.buffer}, attention {attn_impl}; one traced call after an AOT compile "
        "(jax.profiler.trace; open a folder with TensorBoard's profile plugin or ui.perfetto.dev). At this "
        "length R-KV may not yet compress: the trace shows its decode step, not its eviction's cost.",
        "",
        "| case | batch | cache | top candidates | ms / step | compile s | trace (files) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cache = "dense" if r["policy"] == "none" else r["policy"]
        if "error" in r:
            err = gpu_report.one_line(r["error"], 120)
            lines.append(f"| {r['case']} | {r['batch']} | {cache} | {r['agreement_k']} | error: {err} | | |")
            continue
        lines.append(
            f"| {r['case']} | {r['batch']} | {cache} | {r['agreement_k']} | {r['step_ms']:.2f} | "
            f"{r['compile_s']:.1f} | {r['trace']} ({r['trace_files']}) |"
        )
    figure = "; ".join(f"{r['case']} {r['step_ms']:.2f} ms/step" for r in rows if "error" not in r) or "no case ran"
    return checks, lines, figure
