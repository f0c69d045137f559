"""The parameter dtype and the compute dtype apart (flax / MaxText naming): the master weights, and
with them the optimizer state, in model.param_dtype (float32); the forward, the backward and the
rollouts in model.dtype (bfloat16 on GPU / TPU) from a copy cast from the master after each update.

Logits, log-softmax, ratios, losses and reductions stay float32 whatever model.dtype (the model's
own casts). With dtype == param_dtype nothing here casts: the compute copy is the master itself,
and every program is the one it was before the two were apart.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp

from sparserl_jax.cli import cpu_flags
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.quant.core import QWeight

Params = dict


# XLA_FLAGS' --xla_cpu_max_isa values below which XLA:CPU has no bfloat16 dot instructions
_NO_BF16_ISAS = ("SSE4_2", "AVX", "AVX2")


def cpu_bf16_dots(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this host's CPU has bfloat16 dot instructions (avx512_bf16 or AMX, Linux's
    /proc/cpuinfo) and XLA_FLAGS does not cap XLA:CPU below them (--xla_cpu_max_isa, as the
    studies' portable CPU numerics do)."""
    isa = re.search(r"--xla_cpu_max_isa=(\w+)", os.environ.get("XLA_FLAGS", ""))
    if isa and isa.group(1).upper() in _NO_BF16_ISAS:
        return False
    flags = cpu_flags(cpuinfo)
    return "avx512_bf16" in flags or "amx_bf16" in flags


def auto_dtype(platform: str | None = None) -> tuple[str, str]:
    """(dtype, why) for model.dtype="auto" on `platform` (None: jax's backend): bfloat16 on a GPU
    or TPU and on a CPU with bfloat16 dot instructions (cpu_bf16_dots), float32 on other CPUs,
    where bfloat16 is emulated in float32 and slower (experiments/results/bench_precision.md)."""
    platform = platform or jax.default_backend()
    if platform != "cpu":
        return "bfloat16", f"{platform}: bfloat16 matrix units"
    if cpu_bf16_dots():
        return "bfloat16", "cpu with bfloat16 dot instructions (avx512_bf16 / amx_bf16)"
    return "float32", "cpu without bfloat16 dot instructions (or XLA_FLAGS caps its ISA below them)"


def auto_accumulation(platform: str) -> str:
    """What model.dot_accumulation="auto" is on `platform` ("cpu", "gpu", "cuda", "rocm", "tpu"):
    float32 on the CPU (XLA:CPU would otherwise widen bfloat16 operands to float32 before every
    product, the bfloat16 dot instructions unused), output elsewhere."""
    return "float32" if platform == "cpu" else "output"


def accumulation(cfg: ModelConfig) -> str:
    """How the projections accumulate (model.dot_accumulation; quant.core.ACCUMULATIONS): "auto"
    reads jax's backend at trace time, as model.attention's auto does, so a program lowered on a
    CPU host for another platform resolves it first (for_platform). Float32 compute is the same
    program either way."""
    if cfg.dot_accumulation != "auto":
        return cfg.dot_accumulation
    return auto_accumulation(jax.default_backend())


def for_platform(cfg: ModelConfig, platform: str) -> ModelConfig:
    """`cfg` with model.dot_accumulation="auto" resolved for `platform`: what a program lowered or
    compiled here for a TPU or a GPU must carry (at trace time auto reads this host's backend)."""
    if cfg.dot_accumulation != "auto":
        return cfg
    return dataclasses.replace(cfg, dot_accumulation=auto_accumulation(platform))


def is_mixed(cfg: ModelConfig) -> bool:
    """Whether the forward reads the weights in another dtype than the master's."""
    return cfg.dtype != cfg.param_dtype


def _is_weight(x) -> bool:
    return isinstance(x, QWeight)


def cast_floats(tree, dtype):
    """`tree` with its floating-point arrays in `dtype`; arrays already in it, integer arrays and
    quantized kernels (QWeight: int8 / fp8 values, float32 scales) are returned as they are."""
    dtype = jnp.dtype(dtype)

    def cast(x):
        if _is_weight(x) or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
            return x
        return x.astype(dtype)

    return jax.tree.map(cast, tree, is_leaf=_is_weight)


def compute_params(params: Params, cfg: ModelConfig) -> Params:
    """The weights as the forward reads them (model.dtype); under jit, a no-op on a compute copy.
    The model's entry points call it, so a master passed in still computes in model.dtype."""
    return cast_floats(params, cfg.dtype)


@functools.lru_cache(maxsize=8)
def _cast_fn(dtype: str):
    return jax.jit(functools.partial(cast_floats, dtype=dtype))


def compute_copy(params: Params, cfg: ModelConfig) -> Params:
    """The compute copy of the master `params` (laid out like them): `params` itself when
    model.dtype is model.param_dtype, else new model.dtype buffers cast by one jitted program."""
    if not is_mixed(cfg):
        return params
    return _cast_fn(cfg.dtype)(params)
