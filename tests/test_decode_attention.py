"""Pallas decode-attention kernels (GPU/Triton and TPU/Mosaic, in interpret mode on CPU) against
the jnp reference, the dispatcher's settings, and lowering of both kernels for their hardware."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_lowering import lower

from sparserl_jax import kernels
from sparserl_jax.kernels import decode_attention_gpu as gpu
from sparserl_jax.kernels import decode_attention_tpu as tpu
from sparserl_jax.kernels.decode_attention_ref import decode_attention_ref

needs_triton = pytest.mark.skipif(
    not gpu.TRITON_AVAILABLE, reason="this jax has no Pallas Triton (deprecated since jax 0.11)"
)

# (o atol/rtol, lse atol) per input dtype. bf16: the kernels feed p in bf16 to the p.v matmul
# (the reference keeps float32) and o is rounded to bf16.
TOL = {jnp.float32: (2e-5, 2e-5), jnp.bfloat16: (2e-2, 1e-4)}


_POOL = 1 << 17  # one compiled jax.random draw per seed; shapes are cut from it in numpy


def _normal_pool(seed):
    return np.asarray(jax.random.normal(jax.random.key(seed), (_POOL,), jnp.float32))


def _inputs(B, N, K, C, H, dtype, fill, seed):
    """Fresh normal q, k, v from jax.random.key(seed), cut from one fixed-size draw so that new
    shapes cost no XLA compile (the interpreter's compile is the budget of this file)."""
    n_q, n_kv = B * N * H, B * K * C * H
    assert n_q + 2 * n_kv <= _POOL
    pool = _normal_pool(seed)
    q = pool[:n_q].reshape(B, N, H)
    k = pool[n_q : n_q + n_kv].reshape(B, K, C, H)
    v = pool[n_q + n_kv : n_q + 2 * n_kv].reshape(B, K, C, H)
    as_dtype = lambda x: jnp.asarray(x.astype(jnp.dtype(dtype)))  # noqa: E731
    return as_dtype(q), as_dtype(k), as_dtype(v), jnp.asarray(fill, jnp.int32)


_ref = jax.jit(decode_attention_ref, static_argnames=("scale",))


def _check(out, ref, dtype):
    (o, lse), (o_ref, lse_ref) = out, ref
    assert o.dtype == o_ref.dtype and o.shape == o_ref.shape
    assert lse.dtype == jnp.float32 and lse.shape == lse_ref.shape
    o, o_ref = np.asarray(o, np.float32), np.asarray(o_ref, np.float32)
    lse, lse_ref = np.asarray(lse), np.asarray(lse_ref)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    o_tol, lse_tol = TOL[dtype]
    np.testing.assert_allclose(o, o_ref, atol=o_tol, rtol=o_tol)
    np.testing.assert_allclose(lse, lse_ref, atol=lse_tol, rtol=lse_tol)


# B, N, K (G = N // K = 2, 4, 8; G = 1 in the random-fill test), C, H, dtype, fill, block_c,
# num_splits, scale. No C is a multiple of block_c; fills include 1 and C; several splits,
# some of them dead (past the fill).
CASES = [
    (2, 4, 2, 80, 128, jnp.bfloat16, [80, 37], 32, 3, None),
    (1, 4, 1, 72, 64, jnp.bfloat16, [33], 16, None, 0.3),
    (2, 16, 2, 56, 128, jnp.float32, [17, 1], 16, 4, None),
]
CASE_IDS = ["G2-H128-bf16", "G4-H64-bf16-scale", "G8-H128-f32"]


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gpu_kernel_matches_reference(case):
    B, N, K, C, H, dtype, fill, block_c, num_splits, scale = case
    q, k, v, fill = _inputs(B, N, K, C, H, dtype, fill, seed=C)
    out = gpu.decode_attention_gpu(q, k, v, fill, scale, block_c=block_c, num_splits=num_splits, interpret=True)
    _check(out, _ref(q, k, v, fill, scale), dtype)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_tpu_kernel_matches_reference_under_tpu_interpreter(case):
    """pltpu.InterpretParams simulates TPU memory spaces, scalar prefetch and DMA on CPU."""
    B, N, K, C, H, dtype, fill, block_c, num_splits, scale = case
    q, k, v, fill = _inputs(B, N, K, C, H, dtype, fill, seed=C + 1)
    out = tpu.decode_attention_tpu(
        q,
        k,
        v,
        fill,
        scale,
        block_c=block_c,
        num_splits=num_splits or 1,
        interpret=tpu.tpu_interpret_mode(),
    )
    _check(out, _ref(q, k, v, fill, scale), dtype)


@needs_triton
@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    fill=st.lists(st.integers(1, 50), min_size=2, max_size=2),
    seed=st.integers(0, 2**16),
)
def test_kernels_over_random_fills(fill, seed):
    """G = 1, float32, H = 64. Fills are runtime data: one compiled kernel per backend serves
    every draw (the TPU kernel here under the generic interpreter)."""
    q, k, v, fill = _inputs(2, 2, 2, 50, 64, jnp.float32, fill, seed)
    ref = _ref(q, k, v, fill)
    _check(gpu.decode_attention_gpu(q, k, v, fill, block_c=16, num_splits=2, interpret=True), ref, jnp.float32)
    _check(tpu.decode_attention_tpu(q, k, v, fill, block_c=16, num_splits=2, interpret=True), ref, jnp.float32)


def test_combine_splits_ignores_dead_splits_and_empty_rows():
    o_s = _normal_pool(1)[:24].reshape(1, 1, 3, 2, 4)  # split 1 dead, query row 1 empty
    lse_s = np.array([[[[0.5, -np.inf], [-np.inf, -np.inf], [1.5, -np.inf]]]], np.float32)
    o, lse = map(np.asarray, jax.jit(gpu.combine_splits)(o_s, lse_s))
    w = np.exp([0.5, 1.5]) / np.exp([0.5, 1.5]).sum()
    # two weighted terms: each weight's exp and normalisation, the product and the sum round,
    # a few u of |o_s| <= 2.5 (< 1e-6); lse = 1.81 is max + log(1 + e^-1): a few roundings too
    np.testing.assert_allclose(o[0, 0, 0], w[0] * o_s[0, 0, 0, 0] + w[1] * o_s[0, 0, 2, 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse[0, 0, 0], np.logaddexp(0.5, 1.5), rtol=1e-6)
    assert lse[0, 0, 1] == -np.inf and (o[0, 0, 1] == 0).all()


def test_dispatcher_xla_and_auto_on_cpu():
    q, k, v, fill = _inputs(2, 4, 2, 40, 64, jnp.float32, [5, 40], seed=3)
    ref = decode_attention_ref(q, k, v, fill)
    assert kernels.current_platform(q) == "cpu"
    for impl in ("xla", "auto"):
        o, lse = kernels.decode_attention(q, k, v, fill, impl=impl)  # eager: same ops as ref
        np.testing.assert_array_equal(np.asarray(o), np.asarray(ref[0]))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref[1]))
    jitted = jax.jit(kernels.decode_attention, static_argnames=("impl",))
    _check(jitted(q, k, v, fill, impl="auto"), ref, jnp.float32)


def test_dispatcher_rejects_bad_settings():
    q, k, v, fill = _inputs(1, 2, 1, 16, 16, jnp.float32, [3], seed=4)
    with pytest.raises(ValueError, match=r"impl='triton'.*'auto', 'xla', 'pallas', 'interpret'"):
        kernels.decode_attention(q, k, v, fill, impl="triton")
    with pytest.raises(ValueError, match=r"impl='pallas' needs platform"):
        kernels.decode_attention(q, k, v, fill, impl="pallas")
    q24 = jnp.ones((1, 2, 24))
    reason = "head_dim=24" if gpu.TRITON_AVAILABLE else "pallas.triton"
    with pytest.raises(ValueError, match=reason):
        kernels.decode_attention(
            q24, jnp.ones((1, 1, 16, 24)), jnp.ones((1, 1, 16, 24)), fill, impl="pallas", platform="gpu"
        )


@needs_triton
def test_dispatcher_interpret_under_jit_and_vmap():
    """jit(vmap(dispatcher)): pallas_call's batching rule adds a grid axis for the mapped dim."""
    V, B, N, K, C, H = 2, 2, 4, 2, 40, 64
    q, k, v, _ = _inputs(V * B, N, K, C, H, jnp.float32, [1], seed=5)
    q, k, v = (x.reshape(V, B, *x.shape[1:]) for x in (q, k, v))
    fill = jnp.array([[1, 40], [23, 9]], jnp.int32)
    # One split (no combine step); fill 1 leaves two dead tiles in it.
    run = functools.partial(kernels.decode_attention, impl="interpret", block_c=16, num_splits=1)
    out = jax.jit(jax.vmap(run))(q, k, v, fill)
    _check(out, jax.jit(jax.vmap(decode_attention_ref))(q, k, v, fill), jnp.float32)


def _lowered_text(fn, *args, platform):
    return lower(jax.jit(fn), platform, *args)


@needs_triton
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernels_lower_for_gpu_and_tpu(dtype):
    """Lowering runs Pallas's Triton and Mosaic rules (tile sizes, primitives) with no device;
    Qwen2.5-1.5B-like heads (N=12, K=2, H=128) and a capacity that is not a block multiple."""
    shapes = jax.ShapeDtypeStruct
    args = (
        shapes((4, 12, 128), dtype),
        shapes((4, 2, 600, 128), dtype),
        shapes((4, 2, 600, 128), dtype),
        shapes((4,), jnp.int32),
    )
    for impl in ("pallas", "auto"):
        on_gpu = functools.partial(kernels.decode_attention, impl=impl, platform="gpu")
        assert "__gpu$xla.gpu.triton" in _lowered_text(on_gpu, *args, platform="cuda")
    on_tpu = functools.partial(kernels.decode_attention, impl="auto", platform="tpu")
    assert "tpu_custom_call" in _lowered_text(on_tpu, *args, platform="tpu")
    # head_dim 24 cannot be tiled by Triton: "auto" falls back to the XLA reference.
    odd = (
        shapes((4, 12, 24), dtype),
        shapes((4, 2, 64, 24), dtype),
        shapes((4, 2, 64, 24), dtype),
        shapes((4,), jnp.int32),
    )
    on_gpu = functools.partial(kernels.decode_attention, impl="auto", platform="gpu")
    assert "__gpu$xla.gpu.triton" not in _lowered_text(on_gpu, *odd, platform="cuda")
