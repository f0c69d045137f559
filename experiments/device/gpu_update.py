"""The device check's update step: one jitted update (rl/update.py) at a real config's shapes, per
model.attention: tokens/s, model FLOP utilisation, whether the step moves the weights, and the
device's peak memory beside the dry run's plan."""

from __future__ import annotations

import functools
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.device import gpu_report
from experiments.device.gpu_report import check
from experiments.device.gpu_sizes import GIB, HERE, Sizes
from sparserl_jax.model.config import matmul_params

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
