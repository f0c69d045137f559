"""A decode step against what the host it runs on can do (experiments/lib/decode_bench.py
--bounds): its compute bound (the step's FLOPs at the host's measured dense-matmul throughput in
the model's dtype) and its bandwidth bound (the bytes a step must read, the weights once and the
cache's filled slots, at the host's measured read bandwidth). Both host figures are measured here,
on the device the benchmark runs on, beside its rows:

  peak       FLOP/s of one [PEAK_M x PEAK_K] x [PEAK_K x PEAK_N] dot in the model's dtype (bfloat16
             operands accumulate in float32, as the model's projections ask XLA:CPU to), median of
             the calls
  bandwidth  bytes/s of a sum over a READ_MIB MiB float32 array (a pure read stream)

A bound is what the step cannot beat on this host, not what it should reach: a decode step's
matmuls have `batch` rows, far from the shapes the peak is measured at.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from experiments.lib.kernel_timing import time_fn
from sparserl_jax.model.config import ModelConfig, matmul_params

PEAK_M, PEAK_K, PEAK_N = 1024, 2048, 2048
READ_MIB = 512
TIMING = dict(iters=3, repeats=5, warmup=1)


def step_flops(m: ModelConfig, batch: int, mean_fill: int) -> float:
    """FLOPs of one decode step: 2 per weight per row, and attention's q.k and p.v over the filled
    slots (2 x 2 x N x H per slot per layer per row)."""
    return 2.0 * batch * matmul_params(m) + 4.0 * batch * m.n_layers * m.n_heads * m.head_dim * mean_fill


def step_bytes(m: ModelConfig, batch: int, mean_fill: int, weight_bytes: int | None = None) -> float:
    """Bytes one decode step must read: the weights once (`weight_bytes`, else the matmul weights
    in the model's dtype) and the cache's filled keys and values."""
    item = jnp.dtype(m.dtype).itemsize
    weights = weight_bytes if weight_bytes is not None else matmul_params(m) * item
    return float(weights) + 2.0 * batch * m.n_layers * m.n_kv_heads * m.head_dim * mean_fill * item


def host_peak_flops(dtype: str) -> float:
    """FLOP/s of the host's dense matmul in `dtype` (module docstring)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    x = jax.random.normal(k1, (PEAK_M, PEAK_K), jnp.float32).astype(dtype)
    w = jax.random.normal(k2, (PEAK_K, PEAK_N), jnp.float32).astype(dtype)
    fn = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    return 2.0 * PEAK_M * PEAK_K * PEAK_N / time_fn(fn, (x, w), **TIMING)


def host_read_bandwidth() -> float:
    """Bytes/s the host reads in a sum over READ_MIB MiB (module docstring)."""
    x = jnp.ones((READ_MIB * 2**20 // 4,), jnp.float32)
    return x.nbytes / time_fn(jax.jit(jnp.sum), (x,), **TIMING)


def host(dtype: str) -> dict:
    return {"peak_flops": host_peak_flops(dtype), "read_bytes_per_s": host_read_bandwidth(), "dtype": dtype}


def row_bounds(step_ms: float, m: ModelConfig, batch: int, mean_fill: int, weight_bytes: int | None, hw: dict) -> dict:
    """The row's FLOPs and bytes a step, its two bounds in ms and the step over each."""
    flops, nbytes = step_flops(m, batch, mean_fill), step_bytes(m, batch, mean_fill, weight_bytes)
    compute_ms = flops / hw["peak_flops"] * 1e3
    bandwidth_ms = nbytes / hw["read_bytes_per_s"] * 1e3
    return {
        "flops": flops,
        "bytes": nbytes,
        "compute_ms": compute_ms,
        "bandwidth_ms": bandwidth_ms,
        "step_over_compute": step_ms / compute_ms,
        "step_over_bound": step_ms / max(compute_ms, bandwidth_ms),
    }
