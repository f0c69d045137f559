"""Pallas (Mosaic TPU) decode attention over a fill-limited slot cache.

The grid runs over (batch b, KV head k, split s, tile t); t walks `block_c` slots sequentially
("arbitrary") while VMEM scratch carries the online-softmax state (acc, m, l) of the G query
heads that read KV head k. fill sits in SMEM by scalar prefetch, so the K/V index maps clamp a
dead tile (start >= fill[b]) onto the last live one: the pipeline sees an unchanged block index
and issues no DMA, and the body is skipped with pl.when. Each split writes a normalised partial
(o_s, lse_s) merged by `combine_splits`; splits default to 1 on TPU (the grid runs in order on
one TensorCore, so split-K only helps to feed megacore's second core when B * K is small).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from sparserl_jax.kernels.decode_attention_gpu import MASK_VALUE, SQUEEZED, combine_splits

LANES = 128  # m and l are kept lane-replicated ([Gp, 128]) as Mosaic prefers lane-dense tiles.

# --- jax-version guards ----------------------------------------------------------------------
# Mosaic compiler params: `TPUCompilerParams` up to jax 0.6, `CompilerParams` after.
_MosaicParams = getattr(pltpu, "CompilerParams", None) or pltpu.TPUCompilerParams
# VMEM scratch: `pltpu.VMEM(shape, dtype)`; newer releases also spell it pltpu.MemorySpace.VMEM.
_VMEM = getattr(pltpu, "VMEM", None) or pltpu.MemorySpace.VMEM


def tpu_interpret_mode():
    """The `interpret=` value that runs a TPU kernel on CPU with TPU semantics.

    `pltpu.InterpretParams()` (jax >= 0.5) simulates SMEM/VMEM, DMAs and scalar prefetch; on
    releases without it the generic interpreter (`True`) also handles scalar prefetch grids.
    """
    params = getattr(pltpu, "InterpretParams", None)
    return params() if params is not None else True


def _sublanes(dtype) -> int:
    """Rows per native tile: 8 for 32-bit, 16 for 16-bit dtypes."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def pick_block_c(C: int, dtype, block_c: int | None) -> int:
    """Slots per tile: the whole cache when it fits one 512-slot tile, else a sublane multiple.

    Large tiles amortise the ~0.35 us per grid step; C need not be a multiple (the edge tile is
    padded by Pallas and masked here).
    """
    if block_c is None:
        block_c = 512
    if block_c >= C:
        return C  # a block equal to the full dim is always a legal Mosaic block
    sub = _sublanes(dtype)
    if block_c % sub:
        name = jnp.dtype(dtype).name
        raise ValueError(f"block_c={block_c} must be a multiple of {sub} for {name} caches")
    return block_c


def _tile_kernel(
    fill_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    lse_ref,
    acc_ref,
    m_ref,
    l_ref,
    *,
    scale,
    block_c,
    tiles_per_split,
    capacity,
):
    """One grid step: fold tile t of split s into the (acc, m, l) scratch of (b, k)."""
    b, s, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    live = jnp.minimum(fill_ref[b], capacity)
    start = (s * tiles_per_split + t) * block_c

    @pl.when(t == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
        l_ref[...] = jnp.zeros_like(l_ref)

    @pl.when(start < live)
    def _fold():
        q_GxH = q_ref[...]
        exact = lax.Precision.HIGHEST if q_GxH.dtype == jnp.float32 else None
        valid_1xC = start + lax.broadcasted_iota(jnp.int32, (1, block_c), 1) < live
        # The edge tile past C holds unspecified values: zero V there (0 * NaN would poison acc).
        valid_Cx1 = start + lax.broadcasted_iota(jnp.int32, (block_c, 1), 0) < live
        v_CxH = jnp.where(valid_Cx1, v_ref[...], jnp.zeros((), v_ref.dtype))
        s_GxC = (
            lax.dot_general(
                q_GxH,
                k_ref[...],
                (((1,), (1,)), ((), ())),
                precision=exact,
                preferred_element_type=jnp.float32,
            )
            * scale
        )
        s_GxC = jnp.where(valid_1xC, s_GxC, MASK_VALUE)
        m_prev_GxL = m_ref[...]
        m_next_GxL = jnp.maximum(m_prev_GxL, jnp.max(s_GxC, axis=1, keepdims=True))
        alpha_GxL = jnp.exp(m_prev_GxL - m_next_GxL)
        p_GxC = jnp.exp(s_GxC - m_next_GxL[:, :1])
        l_ref[...] = alpha_GxL * l_ref[...] + jnp.sum(p_GxC, axis=1, keepdims=True)
        m_ref[...] = m_next_GxL
        pv_GxH = lax.dot_general(
            p_GxC.astype(v_CxH.dtype),
            v_CxH,
            (((1,), (0,)), ((), ())),
            precision=exact,
            preferred_element_type=jnp.float32,
        )
        acc_ref[...] = acc_ref[...] * alpha_GxL[:, :1] + pv_GxH

    @pl.when(t == tiles_per_split - 1)
    def _finish():
        l_GxL = l_ref[...]
        has_GxL = l_GxL > 0.0
        l_safe_GxL = jnp.where(has_GxL, l_GxL, 1.0)
        o_ref[...] = acc_ref[...] / l_safe_GxL[:, :1]
        lse_ref[...] = jnp.where(has_GxL, m_ref[...] + jnp.log(l_safe_GxL), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("scale", "block_c", "num_splits", "interpret"))
def decode_attention_tpu(
    q: Float[Array, "B N H"],
    k: Float[Array, "B K C H"],
    v: Float[Array, "B K C H"],
    fill: Int[Array, " B"],
    scale: float | None = None,
    *,
    block_c: int | None = None,
    num_splits: int = 1,
    interpret=False,
) -> tuple[Float[Array, "B N H"], Float[Array, "B N"]]:
    """Pallas/Mosaic decode attention; same contract as `decode_attention_ref`.

    interpret: False on a TPU; `tpu_interpret_mode()` (or True) runs it on CPU.
    """
    B, N, H = q.shape
    K, C = k.shape[1], k.shape[2]
    if N % K:
        raise ValueError(f"query heads N={N} must be a multiple of KV heads K={K}")
    G = N // K
    sub = _sublanes(q.dtype)
    Gp = -(-G // sub) * sub
    bc = pick_block_c(C, k.dtype, block_c)
    n_tiles = -(-C // bc)
    S = max(1, min(num_splits, n_tiles))
    T = -(-n_tiles // S)
    S = -(-n_tiles // T)
    scale = H**-0.5 if scale is None else float(scale)
    q_BxKxGpxH = jnp.pad(q.reshape(B, K, G, H), ((0, 0), (0, 0), (0, Gp - G), (0, 0)))

    def kv_index(b, h, s, t, fill_ref):
        # Clamp dead tiles onto the last live tile: same block index, so no new DMA.
        last_live = jnp.maximum(lax.div(jnp.minimum(fill_ref[b], C) + bc - 1, bc) - 1, 0)
        return b, h, jnp.minimum(s * T + t, last_live), 0

    kv_spec = pl.BlockSpec((SQUEEZED, SQUEEZED, bc, H), kv_index)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(B, K, S, T),
        in_specs=[
            pl.BlockSpec((SQUEEZED, SQUEEZED, Gp, H), lambda b, h, s, t, f: (b, h, 0, 0)),
            kv_spec,
            kv_spec,
        ],
        out_specs=[
            pl.BlockSpec((SQUEEZED,) * 3 + (Gp, H), lambda b, h, s, t, f: (b, h, s, 0, 0)),
            pl.BlockSpec((SQUEEZED,) * 3 + (Gp, LANES), lambda b, h, s, t, f: (b, h, s, 0, 0)),
        ],
        scratch_shapes=[
            _VMEM((Gp, H), jnp.float32),
            _VMEM((Gp, LANES), jnp.float32),
            _VMEM((Gp, LANES), jnp.float32),
        ],
    )
    kernel = functools.partial(_tile_kernel, scale=scale, block_c=bc, tiles_per_split=T, capacity=C)
    o_BxKxSxGpxH, lse_BxKxSxGpxL = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((B, K, S, Gp, H), jnp.float32),
            jax.ShapeDtypeStruct((B, K, S, Gp, LANES), jnp.float32),
        ],
        compiler_params=_MosaicParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="sparse_kv_decode_attention_tpu",
    )(fill.astype(jnp.int32), q_BxKxGpxH, k, v)
    if S == 1:  # nothing to merge
        o_BxKxGpxH, lse_BxKxGp = o_BxKxSxGpxH[:, :, 0], lse_BxKxSxGpxL[:, :, 0, :, 0]
    else:
        o_BxKxGpxH, lse_BxKxGp = combine_splits(o_BxKxSxGpxH, lse_BxKxSxGpxL[..., 0])
    o_BxNxH = o_BxKxGpxH[:, :, :G].reshape(B, N, H).astype(q.dtype)
    return o_BxNxH, lse_BxKxGp[:, :, :G].reshape(B, N)
