"""Pallas (Triton) flash-decoding kernel: one query per sequence against a fill-limited slot cache.

Split-K ("flash-decoding"): the grid runs over (batch b, KV head k, split s of the C slots). Each
program loads the G query heads that read KV head k, walks its split's live tiles of `block_c`
slots with an online softmax in float32, and writes a normalised partial (o_s, lse_s).
`combine_splits` then merges the splits: lse = logsumexp_s lse_s, o = sum_s exp(lse_s - lse) o_s.
Tiles starting at or past fill[b] are never loaded (the tile loop stops at the last live tile),
so the cost follows the live slots, not the capacity C.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

try:  # deprecated in jax 0.11 ("will be removed in a future version"): keep importing without it
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - only on a jax without Pallas Triton
    plgpu = None
TRITON_AVAILABLE = plgpu is not None

# Masked slot score: finite so that exp(mask - m) is 0 without inf - inf NaNs.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
MIN_ROWS = 16  # Triton's tl.dot needs M, N, K >= 16.

# --- jax-version guards: names that moved between Pallas releases ---------------------------
# Triton compiler params: `TritonCompilerParams` up to jax 0.6, `CompilerParams` after. Passing
# them explicitly also selects the Triton backend: since jax 0.10 a bare pallas_call on CUDA
# lowers with Mosaic GPU (jax_pallas_use_mosaic_gpu defaults to True).
_TritonParams = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams", None)
# Masked load/store live in pallas.triton since jax 0.7 (pl.load/pl.store deprecated there).
_load = getattr(plgpu, "load", None) or getattr(pl, "load", None)
_store = getattr(plgpu, "store", None) or getattr(pl, "store", None)
# A squeezed block dim: `pl.squeezed` where it exists, `None` (its older spelling) otherwise.
SQUEEZED = getattr(pl, "squeezed", None)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def unsupported_reason(q: Array, k: Array, block_c: int = 64) -> str | None:
    """Why this kernel cannot run these shapes on a GPU (None when it can).

    Triton tensors need power-of-two sizes and tl.dot needs every dimension >= 16.
    """
    H = q.shape[-1]
    if not TRITON_AVAILABLE:
        return f"jax {jax.__version__} has no jax.experimental.pallas.triton"
    if not (_is_pow2(H) and H >= MIN_ROWS):
        return f"head_dim={H} must be a power of two >= {MIN_ROWS} for the Triton kernel"
    if not (_is_pow2(block_c) and block_c >= MIN_ROWS):
        return f"block_c={block_c} must be a power of two >= {MIN_ROWS}"
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        return f"dtype={q.dtype} must be float32, bfloat16 or float16"
    if k.dtype != q.dtype:
        return f"cache dtype={k.dtype} must equal the query dtype={q.dtype} (one tl.dot type)"
    return None


def plan_splits(B: int, K: int, C: int, block_c: int, num_splits: int | None) -> tuple[int, int]:
    """(num_splits S, tiles per split T): S * T * block_c covers C and no split is empty.

    By default S grows until the grid has ~1024 programs (a few waves on an H100's 132 SMs), so
    small batches still fill the GPU; large batches use one split and skip the combine's work.
    """
    n_tiles = -(-C // block_c)
    if num_splits is None:
        num_splits = max(1, -(-1024 // (B * K)))
    num_splits = max(1, min(num_splits, n_tiles))
    tiles_per_split = -(-n_tiles // num_splits)
    return -(-n_tiles // tiles_per_split), tiles_per_split


def _split_kernel(fill_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, block_c, tiles_per_split, capacity, G):
    """One (b, k, s) program: online softmax over the live tiles of split s (refs are per b, k).

    The q / o / lse blocks have Gp >= G rows (a Triton tile); rows >= G are masked off.
    """
    s = pl.program_id(2)
    live = jnp.minimum(fill_ref[()], capacity)  # slots [0, live) are attended
    split_start = s * (tiles_per_split * block_c)
    # lax.div truncates toward zero; a negative count (split past fill) clips to 0.
    n_live_tiles = jnp.clip(lax.div(live - split_start + block_c - 1, block_c), 0, tiles_per_split)
    Gp, H = q_ref.shape
    row_G = jnp.arange(Gp) < G
    q_GxH = _load(q_ref, mask=row_G[:, None], other=0.0)
    exact = lax.Precision.HIGHEST if q_GxH.dtype == jnp.float32 else None

    def tile(i, carry):
        acc_GxH, m_G, l_G = carry
        start = split_start + i * block_c
        valid_C = start + jnp.arange(block_c) < live
        k_CxH = _load(k_ref.at[pl.ds(start, block_c), :], mask=valid_C[:, None], other=0.0)
        v_CxH = _load(v_ref.at[pl.ds(start, block_c), :], mask=valid_C[:, None], other=0.0)
        s_GxC = (
            lax.dot_general(
                q_GxH,
                k_CxH,
                (((1,), (1,)), ((), ())),
                precision=exact,
                preferred_element_type=jnp.float32,
            )
            * scale
        )
        s_GxC = jnp.where(valid_C[None, :], s_GxC, MASK_VALUE)
        m_new_G = jnp.maximum(m_G, jnp.max(s_GxC, axis=1))
        alpha_G = jnp.exp(m_G - m_new_G)
        p_GxC = jnp.exp(s_GxC - m_new_G[:, None])
        pv_GxH = lax.dot_general(
            p_GxC.astype(v_CxH.dtype),
            v_CxH,
            (((1,), (0,)), ((), ())),
            precision=exact,
            preferred_element_type=jnp.float32,
        )
        acc_GxH = acc_GxH * alpha_G[:, None] + pv_GxH
        return acc_GxH, m_new_G, l_G * alpha_G + jnp.sum(p_GxC, axis=1)

    init = (
        jnp.zeros((Gp, H), jnp.float32),
        jnp.full((Gp,), -jnp.inf, jnp.float32),
        jnp.zeros((Gp,), jnp.float32),
    )
    # Dead tiles (start >= fill) are outside the loop's trip count: never loaded.
    acc_GxH, m_G, l_G = lax.fori_loop(0, n_live_tiles, tile, init)
    has_G = l_G > 0.0
    l_safe_G = jnp.where(has_G, l_G, 1.0)
    _store(o_ref, acc_GxH / l_safe_G[:, None], mask=row_G[:, None])
    _store(lse_ref, jnp.where(has_G, m_G + jnp.log(l_safe_G), -jnp.inf), mask=row_G)


def combine_splits(
    o_BxKxSxGxH: Float[Array, "B K S G H"], lse_BxKxSxG: Float[Array, "B K S G"]
) -> tuple[Float[Array, "B K G H"], Float[Array, "B K G"]]:
    """Merge normalised per-split partials: lse = logsumexp_s lse_s, o = sum_s exp(lse_s - lse) o_s.

    A split with no live slot has lse_s = -inf and weight 0; a row with no live slot at all
    (fill = 0) gets o = 0 and lse = -inf.
    """
    m_BxKxG = jnp.max(lse_BxKxSxG, axis=2)
    m_safe_BxKxG = jnp.where(jnp.isfinite(m_BxKxG), m_BxKxG, 0.0)
    w_BxKxSxG = jnp.exp(lse_BxKxSxG - m_safe_BxKxG[:, :, None])
    total_BxKxG = jnp.sum(w_BxKxSxG, axis=2)
    o_BxKxGxH = (
        jnp.einsum("bksg,bksgh->bkgh", w_BxKxSxG, o_BxKxSxGxH) / jnp.where(total_BxKxG > 0, total_BxKxG, 1.0)[..., None]
    )
    return o_BxKxGxH, m_safe_BxKxG + jnp.log(total_BxKxG)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "block_c", "num_splits", "num_warps", "num_stages", "interpret"),
)
def decode_attention_gpu(
    q: Float[Array, "B N H"],
    k: Float[Array, "B K C H"],
    v: Float[Array, "B K C H"],
    fill: Int[Array, " B"],
    scale: float | None = None,
    *,
    block_c: int = 64,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> tuple[Float[Array, "B N H"], Float[Array, "B N"]]:
    """Split-K Pallas/Triton decode attention; same contract as `decode_attention_ref`.

    block_c: slots per tile (power of two >= 16); num_splits: splits of C per (b, k), None
    picks one from the grid size (see `plan_splits`). C need not be a multiple of block_c.
    """
    B, N, H = q.shape
    K, C = k.shape[1], k.shape[2]
    if N % K:
        raise ValueError(f"query heads N={N} must be a multiple of KV heads K={K}")
    reason = unsupported_reason(q, k, block_c)
    if reason is not None:
        raise ValueError(reason)
    G = N // K
    Gp = max(MIN_ROWS, _next_pow2(G))
    S, T = plan_splits(B, K, C, block_c, num_splits)
    scale = H**-0.5 if scale is None else float(scale)
    kernel = functools.partial(_split_kernel, scale=scale, block_c=block_c, tiles_per_split=T, capacity=C, G=G)
    kv_spec = pl.BlockSpec((SQUEEZED, SQUEEZED, C, H), lambda b, h, s: (b, h, 0, 0))
    # Blocks of Gp rows over arrays of G rows: Triton masks the extra rows (loads and stores).
    o_BxKxSxGxH, lse_BxKxSxG = pl.pallas_call(
        kernel,
        grid=(B, K, S),
        in_specs=[
            pl.BlockSpec((SQUEEZED,), lambda b, h, s: (b,)),
            pl.BlockSpec((SQUEEZED, SQUEEZED, Gp, H), lambda b, h, s: (b, h, 0, 0)),
            kv_spec,
            kv_spec,
        ],
        out_specs=[
            pl.BlockSpec((SQUEEZED,) * 3 + (Gp, H), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((SQUEEZED,) * 3 + (Gp,), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, K, S, G, H), jnp.float32),
            jax.ShapeDtypeStruct((B, K, S, G), jnp.float32),
        ],
        compiler_params=_TritonParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="sparse_kv_decode_attention",
    )(fill.astype(jnp.int32), q.reshape(B, K, G, H), k, v)
    if S == 1:  # nothing to merge
        o_BxKxGxH, lse_BxKxG = o_BxKxSxGxH[:, :, 0], lse_BxKxSxG[:, :, 0]
    else:
        o_BxKxGxH, lse_BxKxG = combine_splits(o_BxKxSxGxH, lse_BxKxSxG)
    return o_BxKxGxH.reshape(B, N, H).astype(q.dtype), lse_BxKxG.reshape(B, N)
