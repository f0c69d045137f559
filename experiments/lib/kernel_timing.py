"""Timing a decode-attention call on a device: the median seconds per call, a plain copy's
bandwidth to compare a kernel's against, and random decode inputs at given shapes. Shared by the
kernel benchmark (bench/bench_kernel.py) and the device check's kernel step
(device/gpu_kernel_check.py)."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def time_fn(fn, args, *, iters: int, repeats: int, warmup: int) -> float:
    """Median over repeats of the mean seconds per call (each repeat blocks once at its end)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t0) / iters)
    return statistics.median(per_call)


def copy_bandwidth(mib: int, **timing) -> float:
    """Bytes read + written per second by an elementwise x + 1 over a `mib` MiB float32 array."""
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    seconds = time_fn(jax.jit(lambda a: a + 1.0), (x,), **timing)
    return 2 * x.nbytes / seconds


def make_inputs(B, N, K, C, H, dtype, fill_frac, ragged, seed):
    kq, kk, kv, kf = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, N, H), dtype)
    k = jax.random.normal(kk, (B, K, C, H), dtype)
    v = jax.random.normal(kv, (B, K, C, H), dtype)
    target = max(1, round(fill_frac * C))
    if ragged:
        fill = jax.random.randint(kf, (B,), 1, min(C, 2 * target) + 1)
    else:
        fill = jnp.full((B,), min(C, target), jnp.int32)
    return q, k, v, fill.astype(jnp.int32)
