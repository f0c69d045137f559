"""The device check's steps, each run in its own process by gpu_check.py: what it measures at
each size (full and quick on a GPU, smoke on CPU at toy shapes), and the step's verdict file.

A step returns (checks, markdown lines, figure, result); a check of kind "must" that does not hold
fails the step, one of kind "goal" (a performance goal) makes it a warning.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from sparserl_jax.experiments import gpu_report  # imports no JAX
from sparserl_jax.experiments.gpu_report import check

HERE = os.path.dirname(os.path.abspath(__file__))

REAL = os.path.join(HERE, "configs", "real")
DEFAULT_CONFIG = os.path.join(HERE, "configs", "walk_key_rkv.yaml")  # the default experiment's
GIB = 1024**3
BANDWIDTH_GOAL = 0.70
# Dense bf16 tensor-core peak FLOP/s by device kind (vendor data sheets; substring of device_kind).
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What every step measures at one size."""

    gpu: bool  # full and quick: the device must be a GPU; smoke: CPU
    kernel_heads: tuple[str, ...]  # real configs whose heads the kernel runs at (empty: TOY_HEADS)
    kernel_batches: tuple[int, ...]
    kernel_impl: str  # "pallas" on the device, "interpret" on CPU
    block_c: int | None  # None: the kernel's default tile
    bandwidth_cases: tuple[tuple[str, int, float], ...]  # (heads, batch, fill fraction)
    copy_mib: int
    timing: dict  # bench_kernel.time_fn's iters, repeats, warmup
    kernel_calls: int  # kernel calls per timed program
    sampler_argv: tuple[str, ...]  # experiments/bench_decode.py's arguments, less --batch and --out
    sampler_batches: tuple[int, ...]
    update_configs: tuple[str, ...]
    update_arch: str | None
    update_overrides: tuple[str, ...]
    update_steps: int
    update_attention: tuple[str, ...]  # the model.attention values the update step measures, in order
    e2e_overrides: tuple[str, ...] | None  # the resume check's (None: default.py's --smoke overrides)
    run_default: bool  # also `python experiments/default.py --smoke` (minutes even at its smoke size)


TOY_HEADS = {"toy-gqa4": (8, 2, 16, 40, "bfloat16")}  # N, K, H, C (not a tile multiple), dtype
MODELS = ("qwen2.5-1.5b", "qwen2.5-7b")
_GPU = dict(
    gpu=True,
    kernel_heads=MODELS,
    kernel_impl="pallas",
    block_c=None,
    copy_mib=1024,
    kernel_calls=16,
    sampler_argv=("--profile", "gpu", "--lengths", "4096", "--policies", "rkv", "none", "--min-seconds", "0"),
    # Qwen2.5-1.5B with one GPU's overlay at the authors' micro-batch of 4 responses
    update_configs=(os.path.join(REAL, "qwen2.5-1.5b.yaml"), os.path.join(REAL, "mesh", "1gpu.yaml")),
    update_arch=os.path.join(REAL, "arch", "qwen2.5-1.5b.json"),
    update_overrides=(
        "rollout.prompts=1",
        "rollout.samples=8",
        "rollout.rows_per_call=0",
        "rl.update.minibatch_size=8",
        "rl.update.micro_batch_size=4",
        "rl.update.score_batch_size=4",
        "rl.optim.lr=1e-6",
    ),
    update_steps=2,
    # cuDNN's fused attention first: the device's peak memory is a high-water mark over the step's
    # process, so the variant expected to hold less is measured before the one that holds more
    update_attention=("cudnn", "xla"),
    e2e_overrides=None,
)

SIZES = {
    "full": Sizes(
        **_GPU,
        kernel_batches=(1, 8, 64, 256),
        bandwidth_cases=tuple((m, b, f) for m in MODELS for b in (64, 256) for f in (1.0, 0.5)),
        timing=dict(iters=20, repeats=5, warmup=2),
        sampler_batches=(64, 256),
        run_default=True,
    ),
    "quick": Sizes(
        **_GPU,
        kernel_batches=(1, 256),
        bandwidth_cases=tuple((m, 256, 1.0) for m in MODELS),
        timing=dict(iters=20, repeats=3, warmup=2),
        sampler_batches=(64,),
        run_default=False,
    ),
    "smoke": Sizes(
        gpu=False,
        kernel_heads=(),
        kernel_batches=(3,),
        kernel_impl="interpret",
        block_c=16,
        bandwidth_cases=(("toy-gqa4", 4, 1.0),),
        copy_mib=4,
        timing=dict(iters=2, repeats=2, warmup=1),
        kernel_calls=2,
        sampler_argv=(
            "--profile",
            "cpu",
            "--n-layers",
            "1",
            "--prompt-len",
            "8",
            "--lengths",
            "24",
            "--budget",
            "8",
            "--buffer",
            "8",
            "--window",
            "2",
            "--policies",
            "rkv",
            "none",
            "--min-seconds",
            "0",
        ),
        sampler_batches=(2,),
        update_configs=(os.path.join(HERE, "configs", "smoke.yaml"),),
        update_arch=None,
        update_overrides=(
            "rollout.prompts=1",
            "rollout.samples=4",
            "rl.update.minibatch_size=4",
            "rl.update.micro_batch_size=2",
            "rl.optim.lr=1e-6",
            "model.arch.n_layers=1",
        ),
        update_steps=2,
        update_attention=("xla",),
        e2e_overrides=(
            "sft.steps=0",
            "sft.curriculum.steps=0",
            "train.eval_prompts=2",
            "rollout.prompts=1",
            "rollout.samples=2",
            "rollout.max_new_tokens=24",
            "kv.budget=12",
            "kv.buffer=4",
            "rl.update.minibatch_size=2",
            "rl.update.micro_batch_size=2",
            "rl.update.length_bucket=0",
            "rl.update.reuse_old_forward=false",
            "model.arch.n_layers=1",
            "train.iterations=2",
        ),
        run_default=False,
    ),
}


def kernel_shapes(sizes: Sizes) -> dict:
    """{label: (N, K, H, C, dtype)}: the real configs' heads and R-KV slots (budget + buffer), as
    tests/test_lowering.py lowers them, or the toy heads."""
    if not sizes.kernel_heads:
        return dict(TOY_HEADS)
    from sparserl_jax.config import load_config
    from sparserl_jax.dryrun import model_config

    shapes = {}
    for name in sizes.kernel_heads:
        cfg = load_config([os.path.join(REAL, f"{name}.yaml")])
        m, _ = model_config(cfg, os.path.join(REAL, "arch", f"{name}.json"))
        shapes[name] = (m.n_heads, m.n_kv_heads, m.head_dim, cfg.kv.budget + cfg.kv.buffer, m.dtype)
    return shapes


# ----------------------------------------------------------------------------- steps


def step_env(sizes: Sizes, ctx: dict, record):
    """Device, memory, versions, the commit (figprov's provenance)."""
    import importlib.metadata as md

    from sparserl_jax.experiments import figprov, workers

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
    from sparserl_jax.experiments import gpu_kernel_check as gk

    data = gk.numerics(kernel_shapes(sizes), sizes.kernel_batches, sizes.kernel_impl, sizes.block_c, record)
    checks, lines, figure = gk.numerics_summary(data)
    return checks, lines, figure, data


def step_bandwidth(sizes: Sizes, ctx: dict, record):
    from sparserl_jax.experiments import gpu_kernel_check as gk

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
    """experiments/bench_decode.py's rows (its profile, inputs, timing and tables) at each batch:
    R-KV 512 + 128 and dense, compile apart; every row recorded as it finishes."""
    from sparserl_jax import kernels
    from sparserl_jax.experiments import bench_decode
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
        "command": "python experiments/bench_decode.py " + " ".join(sizes.sampler_argv) + " --batch B",
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
        f"{report['command']} (experiments/bench_decode.py's rows): random {m.dtype} weights "
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


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def update_batch(rows: int, T: int, P: int, V: int, key):
    """A rollout batch (rl/batch.py) of full-width rows: random tokens, every position after the
    prompt a response token, every recorded log-prob -log V (a random model's), advantages +-1."""
    t = jnp.arange(T)[None, :]
    logp = jnp.full((rows, T), -math.log(V), jnp.float32)
    return {
        "tokens": jax.random.randint(key, (rows, T), 0, V, jnp.int32),
        "response_mask": jnp.broadcast_to((t >= P - 1) & (t < T - 1), (rows, T)),
        "advantages": jnp.where(jnp.arange(rows) % 2 == 0, 1.0, -1.0).astype(jnp.float32),
        "sampler_logp": logp,
        "old_logp": logp,
        "ref_logp": logp,
    }


def param_dtype(m) -> str:
    """The master weights' dtype: model.param_dtype where the config has one, else model.dtype."""
    return getattr(m, "param_dtype", m.dtype)


def matmul_params(m) -> int:
    """Parameters in matmuls per token: the blocks' projections and the LM head."""
    attn = m.d_model * m.n_heads * m.head_dim * 2 + 2 * m.d_model * m.n_kv_heads * m.head_dim
    return m.n_layers * (attn + 3 * m.d_model * m.d_ff) + m.vocab_size * m.d_model


def model_flops_per_token(m, T: int) -> float:
    """Training FLOPs per token by PaLM's formula: 6 x matmul params + 12 L N H T (attention
    counted over the whole T x T square; rematerialisation not counted)."""
    return 6 * matmul_params(m) + 12 * m.n_layers * m.n_heads * m.head_dim * T


def peak_flops(device_kind: str) -> float | None:
    return next((f for name, f in PEAK_BF16_FLOPS if name in device_kind), None)


def _sample(params, n: int = 1 << 16):
    """A strided host sample of every leaf (to see whether a step moved the weights), one program."""
    take = jax.jit(lambda p: [x.ravel()[:: max(1, x.size // n)] for x in jax.tree_util.tree_leaves(p)])
    return [np.asarray(x, np.float32) for x in jax.device_get(take(params))]


def step_update(sizes: Sizes, ctx: dict, record):
    """One jitted update step (rl/update.py) at the config's shapes, dtypes and micro-batch, once
    per model.attention in sizes.update_attention (a variant that raises is recorded and the next
    one runs), each with the master weights, the optimizer state and pi_ref (in the compute dtype,
    as the trainer and the dry run hold it) on the device. Memory: XLA's plan of the step, and the
    device's peak beside the dry run's persistent + update phase (the peak is a high-water mark
    over the process: a later variant's reads the earlier ones' too)."""
    checks, lines, figures, variants = [], [], [], []
    many = len(sizes.update_attention) > 1  # label each variant's checks, lines and figure
    for attention in sizes.update_attention:
        done = variants.copy()
        try:
            c, ls, fig, res = _update_variant(sizes, attention, lambda r, done=done: record({"variants": [*done, r]}))
        except Exception as err:  # e.g. cuDNN refusing a shape: recorded, the next variant runs
            msg = f"{type(err).__name__}: {gpu_report.one_line(str(err))}"
            c = [check(f"model.attention={attention}: the step compiles and runs", msg, "no error", False)]
            ls, fig, res = [f"Failed: {msg}"], f"failed ({msg[:80]})", {"attention": attention, "error": msg}
        variants.append(res)
        record({"variants": variants})
        checks += [dict(x, name=f"[{attention}] {x['name']}") for x in c] if many else c
        lines += ([f"### model.attention={attention}", ""] if many else []) + ls + [""]
        figures.append(f"{attention}: {fig}" if many else fig)
        jax.clear_caches()
    return checks, lines[:-1], "; ".join(figures), {"variants": variants}


def _update_variant(sizes: Sizes, attention: str, record):
    """step_update's measurement at one model.attention."""
    from sparserl_jax.config import load_config
    from sparserl_jax.dryrun import dry_run, model_config
    from sparserl_jax.model import transformer
    from sparserl_jax.rl.optim import make_optimizer
    from sparserl_jax.rl.update import make_update_fn

    overrides = [*sizes.update_overrides, f"model.attention={attention}"]
    cfg = load_config(list(sizes.update_configs), overrides)
    m, _ = model_config(cfg, sizes.update_arch)
    device = jax.devices()[0]
    limit = (device.memory_stats() or {}).get("bytes_limit")
    plan = dry_run(cfg, arch=sizes.update_arch, devices=jax.device_count(), device_memory_gib=(limit or 80 * GIB) / GIB)
    rows, P = cfg.rollout.prompts * cfg.rollout.samples, cfg.data.max_prompt_len
    T, u, lr = P + cfg.rollout.max_new_tokens, cfg.rl.update, cfg.rl.optim.lr
    params = transformer.init_params(m, jax.random.key(0))
    ref_params = jax.tree.map(lambda x: x.astype(m.dtype), params)  # pi_ref: only scored
    # the trainer's compute copy of the master weights, where the dtypes differ (as the dry run counts it)
    compute = jax.tree.map(lambda x: x.astype(m.dtype), params) if param_dtype(m) != m.dtype else None
    optimizer = make_optimizer(cfg.rl.optim)
    opt_state = optimizer.init(params)
    batch = update_batch(rows, T, P, m.vocab_size, jax.random.key(1))
    update = make_update_fn(m, cfg.rl, optimizer, donate=u.donate)
    t0 = time.perf_counter()
    compiled = update.lower(params, opt_state, batch).compile()
    compile_s = time.perf_counter() - t0
    analysis = compiled.memory_analysis()
    xla = {k: getattr(analysis, f"{k}_size_in_bytes", None) for k in ("temp", "argument", "output", "alias")}
    param_dtypes = sorted({str(x.dtype) for x in jax.tree_util.tree_leaves(params)})
    before = _sample(params)
    jax.block_until_ready((params, compute, ref_params, opt_state, batch))
    held = (device.memory_stats() or {}).get("bytes_in_use")
    result = {
        "config": [os.path.relpath(c, os.path.dirname(HERE)) for c in sizes.update_configs],
        "overrides": overrides,
        "attention": attention,
        "rows": rows,
        "T": T,
        "micro_batch": u.micro_batch_size,
        "minibatch": u.minibatch_size,
        "remat": u.remat,
        "donate": u.donate,
        "lr": lr,
        "compute_dtype": m.dtype,
        "param_dtype_config": param_dtype(m),
        "compute_copy_held": compute is not None,
        "param_dtypes": param_dtypes,
        "reference_dtypes": sorted({str(x.dtype) for x in jax.tree_util.tree_leaves(ref_params)}),
        "compile_s": compile_s,
        "xla_memory_analysis": xla,
        "bytes_held_before_step": held,
    }
    record(result)
    seconds, metrics = [], None
    for i in range(sizes.update_steps):
        t0 = time.perf_counter()
        params, opt_state, metrics = jax.block_until_ready(compiled(params, opt_state, batch))
        seconds.append(time.perf_counter() - t0)
        if i == 0:
            after = _sample(params)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    moved = np.concatenate([a != b for a, b in zip(after, before)])
    rel = np.concatenate([np.abs(a - b)[a != b] / lr for a, b in zip(after, before)])
    step_s = seconds[-1]
    flops = rows * T * model_flops_per_token(m, T)
    peak = peak_flops(device.device_kind)
    measured = (device.memory_stats() or {}).get("peak_bytes_in_use")
    phases = plan["phase_bytes"]
    predicted = phases["persistent"] + phases["update"]
    result.update(
        step_s=seconds,
        tokens_per_s=rows * T / step_s,
        model_flops=flops,
        model_flops_per_s=flops / step_s,
        peak_flops=peak,
        mfu=None if peak is None else flops / step_s / peak,
        moved_fraction=float(moved.mean()),
        moved_median_delta_over_lr=float(np.median(rel)) if rel.size else 0.0,
        metrics=metrics,
        peak_bytes_in_use=measured,
        dryrun={
            "persistent": phases["persistent"],
            "update_phase": phases["update"],
            "persistent_plus_update": predicted,
            "peak": plan["peak_bytes"],
            "peak_phase": plan["peak_phase"],
            "items": plan["items"],
        },
    )
    record(result)
    finite = math.isfinite(metrics.get("loss", float("nan"))) and metrics.get("skipped", 1.0) == 0.0
    checks = [
        check(
            "loss and gradient finite (step not skipped)",
            f"loss {metrics.get('loss'):.4g}, skipped {metrics.get('skipped'):.0f}",
            "finite, 0",
            finite,
        ),
        check(
            f"weights moved by step 1 at lr {lr:g} (fraction of sampled elements)",
            f"{moved.mean():.3f} (param dtypes {', '.join(param_dtypes)})",
            ">= 0.9",
            moved.mean() >= 0.9,
        ),
    ]
    gib = lambda n: "n/a" if n is None else f"{n / GIB:.2f}"  # noqa: E731
    if measured and held:
        step_bytes = measured - held
        checks.append(
            check(
                "the step's device memory (peak - held before it) within the dry run's update phase",
                f"{gib(step_bytes)} vs {gib(phases['update'])} GiB ({step_bytes / phases['update']:.2f}x)",
                "<= 1.00x",
                step_bytes <= phases["update"],
                kind="goal",
            )
        )
    mfu = "n/a (unknown device peak)" if peak is None else f"{flops / step_s / peak:.1%} of {peak / 1e12:.0f} TFLOP/s"
    lines = [
        f"Config: {' + '.join(result['config'])} with {' '.join(overrides)}; {rows} rows x "
        f"T={T} tokens, micro-batch {u.micro_batch_size}, remat {u.remat}, donate {u.donate}; compute dtype "
        f"{m.dtype}, parameters {', '.join(param_dtypes)} (config param_dtype {result['param_dtype_config']}), "
        f"pi_ref {', '.join(result['reference_dtypes'])}"
        + (f", a {m.dtype} compute copy of the master held beside it" if compute is not None else "")
        + ".",
        "",
        "| what | value |",
        "|---|---|",
        f"| compile (lower + compile) | {compile_s:.1f} s |",
        f"| step time (step {len(seconds)}; all: {', '.join(f'{s:.2f}' for s in seconds)} s) | {step_s:.3f} s |",
        f"| tokens / s | {rows * T / step_s:.0f} |",
        f"| model FLOPs / step (PaLM: 6 x {matmul_params(m) / 1e9:.2f}B matmul params + attention) | {flops:.3e} |",
        f"| model FLOP utilisation | {mfu} |",
        f"| weights moved by step 1 (sampled elements) | {moved.mean():.3f}; median abs change / lr "
        f"{result['moved_median_delta_over_lr']:.2f} |",
        f"| loss, grad norm, skipped | {metrics.get('loss'):.4g}, {metrics.get('grad_norm', float('nan')):.4g}, "
        f"{metrics.get('skipped'):.0f} |",
        f"| device peak (memory_stats peak_bytes_in_use) / held before the step | {gib(measured)} / {gib(held)} GiB |",
        f"| dry run: persistent + update phase / update phase (overall peak, its phase) | {gib(predicted)} / "
        f"{gib(phases['update'])} GiB ({gib(plan['peak_bytes'])} GiB, {plan['peak_phase']}) |",
        f"| XLA's plan of the step: temp / arguments / outputs / aliased | "
        f"{' / '.join(gib(v) for v in xla.values())} GiB |",
        "",
        "Held on the device, as the trainer holds them: the master weights, their compute copy where the "
        "dtypes differ, pi_ref and the optimizer state (the dry run's rows in steps/update.json).",
    ]
    figure = (
        f"{rows * T / step_s:.0f} tok/s, MFU {'n/a' if peak is None else f'{flops / step_s / peak:.1%}'}, "
        f"weights moved {moved.mean():.0%} at lr {lr:g} ({'/'.join(param_dtypes)} params, {m.dtype} compute), "
        + (f"peak {gib(measured)} GiB vs dry run {gib(predicted)} GiB" if measured else "peak n/a on CPU")
        + f", compile {compile_s:.0f} s"
    )
    return checks, lines, figure, result


def resume_check(overrides, work: str, record) -> dict:
    """The default experiment's config at smoke size: a run of n iterations with a checkpoint
    after every one, evaluated under sparse and dense inference; then a copy of it that lost its
    last checkpoint (killed after logging iteration n, before saving it) resumes from iteration
    n - 1, and its iteration n is compared with the uninterrupted run's."""
    from jax.experimental.compilation_cache import compilation_cache

    from sparserl_jax.config import load_config
    from sparserl_jax.metrics_log import read_metrics
    from sparserl_jax.train import Trainer

    compilation_cache.reset_cache()  # the resumed trainer's programs are the first one's: loaded
    jax.config.update("jax_compilation_cache_dir", os.path.join(work, "compile_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    def cfg(run: str):
        return load_config(
            [DEFAULT_CONFIG],
            [*overrides, f"train.out_dir={os.path.join(work, run)}", "train.progress=false", "train.save_every=1"],
        )

    base = cfg("a")
    n = base.train.iterations
    t0 = time.perf_counter()
    trainer = Trainer(base, log=lambda *a, **k: None)
    trainer.run()
    dense_kv = dataclasses.replace(base.kv, policy="none")
    evals = {
        "sparse": trainer.evaluate(n=base.train.eval_prompts)["accuracy"],
        "dense": trainer.evaluate(kv_cfg=dense_kv, n=base.train.eval_prompts)["accuracy"],
    }
    first_s = time.perf_counter() - t0
    record({"uninterrupted_s": first_s, "evaluation": evals})
    shutil.copytree(os.path.join(work, "a"), os.path.join(work, "b"))
    shutil.rmtree(os.path.join(work, "b", "checkpoints", str(n)))
    t0 = time.perf_counter()
    logged = []
    Trainer(cfg("b"), log=lambda *a, **k: logged.append(" ".join(map(str, a)))).run()
    resumed_s = time.perf_counter() - t0
    timing = ("time/", "throughput/")
    a, b = (
        [{k: v for k, v in r.items() if not k.startswith(timing)} for r in read_metrics(os.path.join(work, run))]
        for run in ("a", "b")
    )
    diffs = {
        k: abs(b[-1][k] - a[-1][k]) / max(abs(a[-1][k]), 1e-12)
        for k in a[-1]
        if isinstance(a[-1][k], (int, float)) and k in b[-1]
    }
    worst = max(diffs, key=diffs.get) if diffs else None
    return {
        "iterations": n,
        "steps_a": [r["step"] for r in a],
        "steps_b": [r["step"] for r in b],
        "resumed_line": next((s for s in logged if "resumed" in s), None),
        "evaluation": evals,
        "max_rel_diff": diffs.get(worst, 0.0),
        "worst_metric": worst if diffs.get(worst) else None,
        "metrics_compared": len(diffs),
        "uninterrupted_s": first_s,
        "resumed_s": resumed_s,
        "eval_prompts": base.train.eval_prompts,
        "kv": f"{base.kv.policy} {base.kv.budget}+{base.kv.buffer}",
    }


def summarise_default(out: str) -> dict:
    """Per arm: dense / sparse accuracy and the train rollouts' KV saving, from a default
    experiment's results.json; the warm start's accuracies."""
    with open(os.path.join(out, "results.json")) as f:
        data = json.load(f)
    arms = {
        arm: {k: [r[k] for r in rows] for k in ("dense_acc", "sparse_acc", "train_kv_saving")}
        for arm, rows in data["per_seed"].items()
    }
    return {"arms": arms, "warm_starts": data["warm_starts"], "wall_s": (data.get("provenance") or {}).get("wall_s")}


def run_killing_group(cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
    """(exit code or None past `timeout`, the output's tail) of `cmd` run in its own process
    group, all of which (its worker processes too) is killed past the timeout."""
    proc = subprocess.Popen(
        cmd, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output[-2000:]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, (output or "")[-2000:] + f"\ntimed out after {timeout:.0f} s"


def step_e2e(sizes: Sizes, ctx: dict, record):
    """Training, evaluation, checkpoint and resume of the default experiment at smoke size."""
    overrides = sizes.e2e_overrides
    if overrides is None:  # what `python experiments/default.py --smoke` sets
        from sparserl_jax.experiments import figlib

        overrides = (*figlib.smoke_overrides(DEFAULT_CONFIG), "train.iterations=2")
    work = tempfile.mkdtemp(prefix="gpu_check_e2e_")
    result = {"resume": resume_check(overrides, work, lambda r: record({"resume": r}))}
    record(result)
    r = result["resume"]
    checks = [
        check(
            "the copy resumes from its last checkpoint and logs every iteration once",
            f"steps {r['steps_b']} vs {r['steps_a']}",
            "equal",
            r["steps_a"] == r["steps_b"],
        ),
        check(
            "resumed iteration's metrics vs the uninterrupted run's (max relative difference)",
            f"{r['max_rel_diff']:.2e}" + (f" ({r['worst_metric']})" if r["worst_metric"] else ""),
            "<= 1e-5",
            r["max_rel_diff"] <= 1e-5,
        ),
    ]
    resumed = r["resumed_line"] or "no 'resumed' line logged"
    lines = [
        f"walk_key_rkv.yaml ({r['kv']}) with {' '.join(overrides)}: {r['iterations']} iterations "
        f"with a checkpoint after each, then evaluated on {r['eval_prompts']} prompts "
        f"({r['uninterrupted_s']:.0f} s): "
        f"dense inference {r['evaluation']['dense']:.3f}, sparse {r['evaluation']['sparse']:.3f}. "
        "A copy without "
        f"its last checkpoint resumed ({r['resumed_s']:.0f} s; {resumed}); {r['metrics_compared']} metrics of "
        f"iteration {r['iterations']} compared."
    ]
    figure = (
        f"resume {'exact' if checks[1]['passed'] else 'DIFFERS'} (max rel. diff {r['max_rel_diff']:.1e}); "
        f"eval dense {r['evaluation']['dense']:.2f} / sparse {r['evaluation']['sparse']:.2f}"
    )
    if sizes.run_default:
        out = os.path.join(ctx["out"], "e2e", "default")
        cmd = [
            sys.executable,
            os.path.join(HERE, "default.py"),
            "--smoke",
            "--seeds",
            "0",
            "--warm-starts",
            "0",
            "--out",
            out,
            "--runs-dir",
            os.path.join(work, "runs"),
        ]
        left = ctx["deadline"] - time.time() - 5
        env = {
            **os.environ,
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false",  # its arms share the device
            # and load the programs the resume check compiled (the same config and shapes)
            "JAX_COMPILATION_CACHE_DIR": os.path.join(work, "compile_cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        }
        t0 = time.perf_counter()
        rc, tail = run_killing_group(cmd, env, max(left, 1))
        seconds = time.perf_counter() - t0
        ok = rc == 0 and os.path.exists(os.path.join(out, "results.json"))
        last = tail.splitlines()[-1] if tail.strip() else ""
        default = {
            "command": " ".join(cmd[1:]),
            "returncode": rc,
            "seconds": seconds,
            **(summarise_default(out) if ok else {"error": gpu_report.one_line(last)}),
        }
        result["default"] = default
        if rc is None:  # out of the check's time: a budget to revise, not a wrong result
            checks.append(
                check(
                    "python experiments/default.py --smoke --seeds 0 --warm-starts 0 finishes",
                    f"killed after {seconds:.0f} s",
                    "within the step's budget",
                    False,
                    kind="goal",
                )
            )
        else:
            checks.append(
                check(
                    "python experiments/default.py --smoke --seeds 0 --warm-starts 0",
                    f"exit {rc}",
                    "0, results.json written",
                    ok,
                )
            )
        if ok:
            lines += [
                "",
                f"`{default['command']}`: {seconds:.0f} s; results in e2e/default/results.md.",
                "",
                "| arm | dense acc | sparse acc | train KV saving |",
                "|---|---|---|---|",
            ]
            lines += [
                f"| {arm} | {v['dense_acc'][0]:.3f} | {v['sparse_acc'][0]:.3f} | {v['train_kv_saving'][0]:.1%} |"
                for arm, v in default["arms"].items()
            ]
            figure += f"; default --smoke {seconds:.0f} s, 3 arms trained and evaluated"
        else:
            lines += ["", f"`{default['command']}` failed ({default['error']}); its output: steps/e2e.log"]
            print(tail)
    else:
        lines += [
            "",
            "`python experiments/default.py --smoke` is not run at this size (minutes of CPU: "
            "tests/test_experiments.py runs it).",
        ]
    shutil.rmtree(work, ignore_errors=True)
    return checks, lines, figure, result


def step_study(sizes: Sizes, ctx: dict, record):
    """The real-model collapse study's cost on the device (gpu_study.py: it imports the study's
    script, which the other steps do without)."""
    from sparserl_jax.experiments import gpu_study

    return gpu_study.step_study(sizes, ctx, record)


STEPS = {
    "env": step_env,
    "numerics": step_numerics,
    "bandwidth": step_bandwidth,
    "sampler": step_sampler,
    "update": step_update,
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
