"""Worker for tests/test_tpu_compile.py: splash attention's gradient at one Qwen2.5-1.5B layer's
shape (2 rows of 5120 positions, 12 query heads over 2 KV heads of 128, bfloat16) compiled by
XLA:TPU for one v5p chip on this CPU, with the fused backward kernel and with the separate dQ
kernel (attention.SPLASH_FUSED_BWD): prints each one's temporaries as JSON. Needs libtpu; the
environment must be set before JAX starts, hence a process of its own."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.device import tpu_topology  # noqa: E402

TOPOLOGY = "v5p:2x2x1"
tpu_topology.set_environment(tpu_topology.parse(TOPOLOGY))
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from sparserl_jax.model import attention as attn  # noqa: E402

B, T, N, K, H = 2, 5120, 12, 2, 128


def temp_bytes(fused: bool) -> tuple[int, int]:
    """XLA:TPU's temporaries for the gradient of splash attention's sum, and its Mosaic calls."""
    attn.SPLASH_FUSED_BWD = fused
    attn._splash_kernel.cache_clear()
    chip = SingleDeviceSharding(topologies.get_topology_desc(TOPOLOGY, "tpu").devices[0])
    args = [jax.ShapeDtypeStruct((B, T, n, H), jnp.bfloat16, sharding=chip) for n in (N, K, K)]
    loss = lambda q, k, v: attn.splash_attention(q, k, v).astype(jnp.float32).sum()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    kernels = compiled.as_text().count('custom_call_target="tpu_custom_call"')
    return compiled.memory_analysis().temp_size_in_bytes, kernels


if __name__ == "__main__":
    out = {}
    for fused in (True, False):
        temp, kernels = temp_bytes(fused)
        out["fused" if fused else "separate_dq"] = {"temp_bytes": temp, "mosaic_calls": kernels}
    out["q_bytes"] = B * T * N * H * 2
    print(json.dumps(out))
