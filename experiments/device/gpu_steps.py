"""The device check's steps, each run in its own process by gpu_check.py (STEPS; the sizes they
run at: gpu_sizes.py), and the step's verdict file. The kernel and sampler steps are here; the
update step in gpu_update.py, the engine step (int8 W8A8 and the slot engine) in gpu_engine.py, the
decode trace in gpu_profile.py, one trainer iteration in gpu_iteration.py, the end-to-end one in
gpu_e2e.py, the real-model study's in gpu_study.py.

A step returns (checks, markdown lines, figure, result); a check of kind "must" that does not hold
fails the step, one of kind "goal" (a performance goal) makes it a warning.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback

import jax

from experiments.device import gpu_report  # imports no JAX
from experiments.device.gpu_e2e import step_e2e
from experiments.device.gpu_engine import step_engine
from experiments.device.gpu_iteration import step_iteration
from experiments.device.gpu_profile import step_profile
from experiments.device.gpu_report import check
from experiments.device.gpu_sizes import GIB, SIZES, Sizes, kernel_shapes
from experiments.device.gpu_update import step_update

BANDWIDTH_GOAL = 0.70


# ----------------------------------------------------------------------------- steps


def step_env(sizes: Sizes, ctx: dict, record):
    """Device, memory, versions, the commit (figprov's provenance)."""
    import importlib.metadata as md

    from experiments.lib import figprov, workers

    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    prov = figprov.provenance(workers.available_cores(), None)
    packages = {
        d.metadata["Name"]: d.version
        for d in md.distributions()
        if d.metadata["Name"] and d.metadata["Name"].lower().replace("_", "-").startswith(("jax", "nvidia-"))
    }
    env = {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_", "CUDA_VISIBLE"))}
    result = {
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "platform_version": getattr(device.client, "platform_version", "?"),
        "memory_bytes": stats.get("bytes_limit"),
        "memory_stats": stats,
        "jax": jax.__version__,
        "packages": dict(sorted(packages.items())),
        "environment": env,
        "provenance": prov,
    }
    want = "gpu" if sizes.gpu else "cpu"
    checks = [check("jax backend", result["backend"], want, result["backend"] == want)]
    mem = f", {stats['bytes_limit'] / GIB:.1f} GiB for jax" if stats.get("bytes_limit") else ""
    commit = f"{prov['commit']}{' + uncommitted changes' if prov['uncommitted_changes'] else ''}"
    figure = (
        f"{device.device_kind} x{jax.device_count()}{mem}; jax {jax.__version__}; "
        f"{result['platform_version']}; commit {commit}"
    )
    lines = [
        "| what | value |",
        "|---|---|",
        *(
            f"| {k} | {v} |"
            for k, v in (
                ("device", device.device_kind),
                ("backend", result["backend"]),
                ("devices", jax.device_count()),
                ("memory for jax (bytes_limit)", stats.get("bytes_limit")),
                ("platform", result["platform_version"]),
                ("commit", commit),
                ("cpu", prov["cpu"]),
                ("python", prov["python"]),
                *packages.items(),
                *env.items(),
            )
        ),
    ]
    if result["backend"] != want:
        result["stop"] = (
            f"skipped: jax's backend is {result['backend']}, not {want} (install the CUDA plugin; --smoke runs on CPU)"
        )
    return checks, lines, figure, result


def step_numerics(sizes: Sizes, ctx: dict, record):
    from experiments.device import gpu_kernel_check as gk

    data = gk.numerics(kernel_shapes(sizes), sizes.kernel_batches, sizes.kernel_impl, sizes.block_c, record)
    checks, lines, figure = gk.numerics_summary(data)
    return checks, lines, figure, data


def step_bandwidth(sizes: Sizes, ctx: dict, record):
    from experiments.device import gpu_kernel_check as gk

    data = gk.bandwidth(
        kernel_shapes(sizes),
        sizes.bandwidth_cases,
        sizes.kernel_impl,
        sizes.block_c,
        sizes.copy_mib,
        sizes.timing,
        sizes.kernel_calls,
        record,
    )
    checks, lines, figure = gk.bandwidth_summary(data, BANDWIDTH_GOAL)
    if not sizes.gpu:
        lines.append("\nOn CPU the kernel runs in Pallas interpret mode: its time says nothing of a device's.")
    return checks, lines, figure, data


def step_sampler(sizes: Sizes, ctx: dict, record):
    """experiments/bench/bench_decode.py's rows (its profile, inputs, timing and tables) at each batch:
    R-KV 512 + 128 and dense, compile apart; every row recorded as it finishes."""
    from experiments.lib import decode_bench as bench_decode
    from sparserl_jax import kernels
    from sparserl_jax.model import transformer

    args = bench_decode.parse_args(list(sizes.sampler_argv))
    name, prof = bench_decode.resolve(args)
    # the compute copy (model.dtype), which the trainer's rollouts read
    params = jax.block_until_ready(
        jax.tree.map(
            lambda x: x.astype(prof.model.dtype), transformer.init_params(prof.model, jax.random.key(args.seed))
        )
    )
    rows, t0 = [], time.perf_counter()
    report = {
        "command": "python experiments/bench/bench_decode.py " + " ".join(sizes.sampler_argv) + " --batch B",
        "date": gpu_report.now(),
        "profile": name,
        "platform": kernels.current_platform(),
        "device_kind": jax.devices()[0].device_kind,
        "jax_version": jax.__version__,
        "model": dataclasses.asdict(prof.model),
        "results": rows,
        "setting": dict(
            batch=list(sizes.sampler_batches),
            prompt_len=prof.prompt_len,
            lengths=list(prof.lengths),
            budget=prof.budget,
            buffer=prof.buffer,
            window=prof.window,
            repeats=args.repeats,
            min_seconds=args.min_seconds,
            attn_impl=args.attn_impl,
            quant=["none"],
        ),
    }
    out = os.path.join(ctx["out"], "sampler", "bench_decode.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    for B in sizes.sampler_batches:
        at_b = dataclasses.replace(prof, batch=B)
        prompts, lengths = bench_decode.make_inputs(at_b, jax.random.key(args.seed + 1))
        for policy in args.policies:
            try:
                row = bench_decode.bench_row(
                    params,
                    at_b,
                    policy,
                    prof.lengths[0],
                    prompts,
                    lengths,
                    repeats=args.repeats,
                    min_seconds=args.min_seconds,
                    seed=args.seed,
                    attn_impl=args.attn_impl,
                )
            except Exception as err:  # e.g. the dense cache out of memory: recorded, the next row runs
                row = dict(
                    policy=policy,
                    quant="none",
                    new_tokens=prof.lengths[0],
                    batch=B,
                    error=f"{type(err).__name__}: {gpu_report.one_line(str(err))}",
                )
            rows.append(row)
            bench_decode.add_speedups(rows)
            report.update(acceptance=bench_decode.acceptance(rows, at_b), total_s=time.perf_counter() - t0)
            bench_decode.write(report, out)
            record({"rows": rows})
    errors = [f"{r['policy']} B={r['batch']}: {r['error']}" for r in rows if "error" in r]
    by = {(r["policy"], r["batch"]): r for r in rows if "error" not in r}
    speedups = {
        B: by[("rkv", B)]["tokens_per_s"] / by[("none", B)]["tokens_per_s"]
        for B in sizes.sampler_batches
        if ("rkv", B) in by and ("none", B) in by
    }
    checks = [
        check("every row decodes", "all" if not errors else "; ".join(errors)[:300], "no error", not errors),
        check(
            "R-KV tokens/s over dense at every batch (the paper's claim at long generations)",
            ", ".join(f"B={B}: {s:.2f}x" for B, s in speedups.items()) or "n/a",
            ">= 1",
            bool(speedups) and min(speedups.values()) >= 1.0,
            kind="goal",
        ),
    ]
    m = prof.model
    lines = [
        f"{report['command']} (experiments/bench/bench_decode.py's rows): random {m.dtype} weights "
        f"(L={m.n_layers}, D={m.d_model}, N/K={m.n_heads}/{m.n_kv_heads}, V={m.vocab_size}), prompt "
        f"{prof.prompt_len} tokens, {prof.lengths[0]} new tokens (no EOS), R-KV budget {prof.budget} + "
        f"buffer {prof.buffer}, attention {args.attn_impl}; one timed call after an AOT compile. "
        "Its tables: sampler/bench_decode.md.",
        "",
        "| batch | policy | tokens/s | ms / step | compile s | KV slots | KV MiB | x dense |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            err = gpu_report.one_line(r["error"], 120)
            lines.append(f"| {r['batch']} | {r['policy']} | error: {err} | | | | | |")
            continue
        x = r.get("speedup_vs_dense")
        lines.append(
            f"| {r['batch']} | {r['policy']} | {r['tokens_per_s']:.0f} | {r['step_ms']:.2f} | "
            f"{r['compile_s']:.1f} | {r['kv_capacity']} | {r['kv_bytes'] / 2**20:.0f} | "
            f"{'-' if x is None else f'{x:.2f}'} |"
        )
    figure = (
        "; ".join(
            f"B={B}: R-KV {by[('rkv', B)]['tokens_per_s']:.0f} vs dense "
            f"{by[('none', B)]['tokens_per_s']:.0f} tok/s ({speedups[B]:.2f}x)"
            for B in speedups
        )
        or "no dense/R-KV pair ran"
    )
    compiles = [r["compile_s"] for r in rows if "compile_s" in r]
    if compiles:
        figure += f"; compile {min(compiles):.0f}-{max(compiles):.0f} s"
    return checks, lines, figure, {"rows": rows, "speedups": speedups}


def step_study(sizes: Sizes, ctx: dict, record):
    """The real-model collapse study's cost on the device (gpu_study.py: it imports the study's
    script, which the other steps do without)."""
    from experiments.device import gpu_study

    return gpu_study.step_study(sizes, ctx, record)


STEPS = {
    "env": step_env,
    "numerics": step_numerics,
    "bandwidth": step_bandwidth,
    "sampler": step_sampler,
    "engine": step_engine,
    "profile": step_profile,
    "update": step_update,
    "iteration": step_iteration,
    "e2e": step_e2e,
    "study": step_study,
}


def run_step(name: str, out: str, mode: str, deadline: float, fail: bool = False) -> int:
    """Run one step and write DIR/steps/<name>.json: "running" with what it has measured so far,
    then its verdict (ok / warn / fail), checks, figure, markdown and result. An exception fails
    the step with one line (its type and message); `fail` raises one after the step has run (its
    figures kept), the guard's test."""
    path = os.path.join(out, "steps", f"{name}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    t0 = time.perf_counter()

    def record(partial: dict) -> None:
        gpu_report.write_json(path, {"status": "running", "seconds": time.perf_counter() - t0, "result": partial})

    record({})
    done = {}
    try:
        checks, lines, figure, result = STEPS[name](SIZES[mode], {"out": out, "deadline": deadline}, record)
        done = {"figure": figure, "checks": checks, "markdown": lines, "result": result}
        if fail:
            raise RuntimeError(f"forced failure (--fail {name}), raised after the step ran")
    except Exception as err:  # recorded with one line; the runner goes on with the next step
        traceback.print_exc()
        data = {
            "status": "fail",
            "error": f"{type(err).__name__}: {gpu_report.one_line(str(err))}",
            "traceback": traceback.format_exc()[-4000:],
            "seconds": time.perf_counter() - t0,
            "result": (gpu_report.read_json(path) or {}).get("result"),
            **done,
        }
        gpu_report.write_json(path, data)
        return 1
    failed = [c for c in checks if not c["passed"] and c["kind"] == "must"]
    missed = [c for c in checks if not c["passed"] and c["kind"] == "goal"]
    data = {"status": "fail" if failed else "warn" if missed else "ok", "seconds": time.perf_counter() - t0, **done}
    if failed:
        data["error"] = "; ".join(f"check fails: {c['name']}: {c['value']} (limit {c['limit']})" for c in failed)
    if isinstance(result, dict) and result.get("stop"):
        data["stop"] = result["stop"]
    gpu_report.write_json(path, data)
    return 1 if failed else 0
