"""Full-sequence causal attention (prompt prefill, scoring, the update) behind one function.

`causal_attention(q, k, v, implementation=model.attention)` over right-padded rows with GQA (N
query heads over K KV heads), a float32 softmax and float32 accumulation, outputs in the inputs'
dtype. Right padding needs no mask: padded keys come after every real query, so causality already
hides them from real rows (padded rows' outputs are garbage nobody reads). The implementations:

  xla        jax.nn.dot_product_attention's XLA path: materialises float32 [T, T] scores and
             probabilities per layer (and keeps them for the backward pass). Every platform.
  cudnn      cuDNN's fused attention through the same call: a GPU and bfloat16 only.
  blockwise  FlashAttention in plain JAX, every platform (the CPU's memory-linear path): an online
             softmax over key blocks inside a loop over query blocks, key blocks above the causal
             diagonal skipped, and a custom VJP that recomputes each block from the saved output
             and log-sum-exp (FlashAttention-2's backward). No buffer of [T, T] in either pass;
             the largest is one block's [B, N, BLOCK, BLOCK] scores. Rows of at most
             MATERIALISED_UP_TO tokens take the xla path (bit for bit), a bounded [T, T].
  splash     TPU's Pallas kernel (jax.experimental.pallas.ops.tpu.splash_attention), causal mask,
             GQA native. Picked where the program is lowered (lax.platform_dependent): a CPU can
             lower or compile it for a TPU; lowered for any other platform it refuses by name.
  auto       the default, resolved at trace time from jax's backend (or `platform`): a GPU gets
             cuDNN for bfloat16 and xla for float32 (cuDNN takes no float32; a float32 GPU run is
             a short-row smoke, and blockwise stays one setting away), a TPU splash, a CPU
             blockwise. A program traced on a CPU and lowered for a TPU (cross-lowering, a TPU
             topology compiled from a CPU) therefore gets blockwise: name splash there. (Deferring
             auto to lowering time as splash does would trace the Pallas kernel into every CPU
             program, about 0.1 s per layer per trace.)

The one exception: a per-layer boolean `mask` [B, N, T, T] (transformer.forward's `attn_masks`,
replaying what a sparse sampler let each query see) already holds a [T, T] array, and always takes
the materialised xla path whatever `implementation` says.

The materialised path's backward (`backward`, model.attention_backward; xla, and blockwise's short
rows): "autodiff" (default) is jax's autodiff of jax.nn.dot_product_attention: in bfloat16 its
backward products take float32 cotangents, so XLA widens them to float32 products, and the [T, T]
cotangents travel in float32. "compute" is FlashAttention-2's precision, as blockwise's own
backward: every product from compute-dtype operands with float32 accumulation, the probabilities P
and the scores' cotangent dS rounded to the compute dtype before their products (dS = P (dP -
rowsum(dO O)) in float32 first), a custom VJP over the saved float32 P (materialised_attention).
The forward is the same computation either way (one rounding of a float32 accumulation; the
summation order may differ); under float32 compute only the summation order differs.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float

from sparserl_jax.mesh_axes import BATCH, fit_spec
from sparserl_jax.model.config import ATTENTION, ATTENTION_BACKWARDS

# blockwise's query and key block: on a 2-core Xeon, float32, SmolLM2-135M's heads at T = 1024 and 2048,
# forward + backward took the least CPU time at 128 (of 128, 256, 512; 2.7-2.9x less than xla)
BLOCK = 128
# Rows at most this long take the materialised path (xla_attention) under blockwise too: its [T, T] is then
# at most 4 blocks of 256, and every committed CPU result (rows of at most 352 tokens) keeps its bits.
MATERIALISED_UP_TO = 512
SPLASH_TILE = 128  # splash pads the length to a multiple of this (Mosaic's lane width)
SPLASH_BLOCKS = (512, 256, 128)  # splash's block: the largest of these dividing the padded length
# splash's fused backward (one kernel for dq, dk, dv) writes dq as a partial per KV block, [T / block,
# B, N, T, H]: 700 MiB a layer at Qwen2.5-7B, 2 rows of 5120 (TPU compile table); the separate dq
# kernel writes dq once, for a second pass over the blocks
SPLASH_FUSED_BWD = False
_MASKED = float(jnp.finfo(jnp.float32).min)  # a score causality hides (finite: no inf - inf)
_PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu"}
HEAD_AXIS = "tensor"  # the mesh axis splash splits the KV heads (and their query heads) over


def auto_implementation(platform: str, dtype) -> str:
    """What "auto" is on `platform` ("cpu", "gpu", "tpu"; "cuda" / "rocm" read as "gpu") for
    inputs of `dtype`: gpu -> cudnn (bfloat16) or xla (float32), tpu -> splash, cpu -> blockwise."""
    platform = _PLATFORM_ALIASES.get(platform, platform)
    if platform == "gpu":
        return "cudnn" if jnp.dtype(dtype) == jnp.bfloat16 else "xla"
    return "splash" if platform == "tpu" else "blockwise"


def causal_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B T K H"],
    v: Float[Array, "B T K H"],
    mask: Bool[Array, "B N T T"] | None = None,
    implementation: str = "auto",
    *,
    platform: str | None = None,
    block: int = BLOCK,
    mesh: Mesh | None = None,
    backward: str = "autodiff",
) -> Float[Array, "B T N H"]:
    """Causal self-attention by model.attention's `implementation` (the module docstring).
    `platform` ("cpu", "gpu", "tpu") fixes the platform "auto" and "splash" resolve for (None:
    auto reads jax's backend at trace time, splash the platform the program is lowered for);
    `block` is blockwise's block; `mesh` the one q, k and v are sharded on (splash runs per device
    on it: `splash_on_mesh`; XLA's partitioner splits the others). A `mask` always takes the
    materialised path; `backward` (model.attention_backward) is the materialised path's backward."""
    if implementation not in ATTENTION:
        raise ValueError(f"model.attention={implementation!r}: accepted values are {ATTENTION}")
    if backward not in ATTENTION_BACKWARDS:
        raise ValueError(f"model.attention_backward={backward!r}: accepted values are {ATTENTION_BACKWARDS}")
    if mask is not None:
        return xla_attention(q, k, v, mask, backward)
    backend = _PLATFORM_ALIASES.get(jax.default_backend(), jax.default_backend())
    if platform is not None:
        platform = _PLATFORM_ALIASES.get(platform, platform)
        if implementation == "auto":
            implementation = auto_implementation(platform, q.dtype)
        if implementation == "splash" and platform != "tpu":
            raise ValueError(f"model.attention=splash needs a TPU (platform {platform}): set model.attention=blockwise")
    elif implementation == "auto":
        implementation = auto_implementation(backend, q.dtype)
    elif implementation == "splash":  # the platform the program is lowered for picks: a CPU may lower a TPU's
        splash = functools.partial(splash_on_mesh, mesh=mesh)
        return lax.platform_dependent(q, k, v, tpu=splash, default=_refuse_splash)
    if implementation == "cudnn" and backend != "gpu":
        raise ValueError(
            f"model.attention=cudnn needs a GPU (jax's backend here is {backend}): set model.attention=blockwise or xla"
        )
    if implementation == "splash":
        return splash_on_mesh(q, k, v, mesh)
    if implementation == "blockwise":
        return blockwise_attention(q, k, v, block, backward=backward)
    if implementation == "xla":
        return xla_attention(q, k, v, backward=backward)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def xla_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B T K H"],
    v: Float[Array, "B T K H"],
    mask: Bool[Array, "B N T T"] | None = None,
    backward: str = "autodiff",
) -> Float[Array, "B T N H"]:
    """The materialised path: float32 [B, N, T, T] scores, softmax, probabilities in v's dtype;
    its backward jax's autodiff or, with `backward="compute"`, materialised_attention's."""
    if backward == "compute":
        return materialised_attention(q, k, v, mask)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")


def _grouped_heads(x: Float[Array, "B T N H"], K: int) -> Float[Array, "B K G T H"]:
    """Query-side heads (q, o, dO) head-major, grouped by their KV head (head n reads KV head n // G)."""
    B, T, N, H = x.shape
    return x.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)


def _token_major(x: Float[Array, "B K G T H"]) -> Float[Array, "B T N H"]:
    B, K, G, T, H = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, H)


def _materialised_forward(q, k, v, mask):
    """(o [B, T, N, H] in q's dtype, P [B, K, G, T, T] float32): the query heads grouped by their
    KV head, scores and softmax in float32, P @ V from P rounded to v's dtype with float32
    accumulation. Every product runs head-major ([B, K, G, T, H] x [B, K, S, H], the operands
    transposed once here): left to pick from [B, T, N, H] operands, XLA:CPU computed the scores
    transposed and moved the [T, T] arrays twice (the bfloat16 micro-batch's attention forward 2.0x
    and forward + backward 1.7x slower, bench_attention_backward's shape)."""
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    qh = _grouped_heads(q, K)
    kh, vh = (x.transpose(0, 2, 1, 3) for x in (k, v))  # [B, K, S, H]
    s = jnp.einsum("bkgth,bksh->bkgts", qh, kh, preferred_element_type=jnp.float32) / math.sqrt(H)
    allowed = jnp.tril(jnp.ones((T, T), bool))
    if mask is not None:
        allowed = allowed & mask.reshape(B, K, G, T, T)
    p = jax.nn.softmax(jnp.where(allowed, s, _MASKED), axis=-1)
    oh = jnp.einsum("bkgts,bksh->bkgth", p.astype(v.dtype), vh, preferred_element_type=jnp.float32)
    return _token_major(oh.astype(q.dtype)), p


@jax.custom_vjp
def materialised_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B T K H"],
    v: Float[Array, "B T K H"],
    mask: Bool[Array, "B N T T"] | None = None,
) -> Float[Array, "B T N H"]:
    """xla_attention's computation with FlashAttention-2's backward over the saved float32 P
    (model.attention_backward="compute", the module docstring): dV = P^T dO and dP = dO V^T from
    P and dO in the compute dtype, dS = P (dP - rowsum(dO O)) / sqrt(H) in float32 rounded to the
    compute dtype, dQ = dS K and dK = dS^T Q; every product accumulated in float32."""
    return _materialised_forward(q, k, v, mask)[0]


def _materialised_fwd(q, k, v, mask):
    o, p = _materialised_forward(q, k, v, mask)
    return o, (q, k, v, o, p)  # the mask acts through P: its zeros


def _materialised_bwd(res, do):
    q, k, v, o, p = res
    H = q.shape[-1]
    K = k.shape[2]
    qh, oh, doh = (_grouped_heads(x, K) for x in (q, o, do))  # [B, K, G, T, H], head-major as the forward's
    kh, vh = (x.transpose(0, 2, 1, 3) for x in (k, v))
    dvh = jnp.einsum("bkgts,bkgth->bksh", p.astype(do.dtype), doh, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bkgth,bksh->bkgts", doh, vh, preferred_element_type=jnp.float32)
    delta = jnp.sum(doh.astype(jnp.float32) * oh.astype(jnp.float32), axis=-1)  # rowsum(dO * O), [B, K, G, T]
    ds = (p * (dp - delta[..., None]) / math.sqrt(H)).astype(q.dtype)
    dqh = jnp.einsum("bkgts,bksh->bkgth", ds, kh, preferred_element_type=jnp.float32)
    dkh = jnp.einsum("bkgts,bkgth->bksh", ds, qh, preferred_element_type=jnp.float32)
    dk, dv = (x.transpose(0, 2, 1, 3) for x in (dkh, dvh))
    return _token_major(dqh).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None  # no cotangent for the mask


materialised_attention.defvjp(_materialised_fwd, _materialised_bwd)


# ----------------------------------------------------------------------------- blockwise


def blockwise_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B T K H"],
    v: Float[Array, "B T K H"],
    block: int = BLOCK,
    materialised_up_to: int = MATERIALISED_UP_TO,
    backward: str = "autodiff",
) -> Float[Array, "B T N H"]:
    """Memory-linear causal attention (FlashAttention-2 in jnp): forward and backward hold one
    [B, N, block, block] block of scores at a time, the length padded at the end to a multiple
    of `block` (padded keys come after every real query). Rows of at most `materialised_up_to`
    tokens are the materialised computation itself (xla_attention, bit for bit, with its
    `backward`)."""
    if block < 1:
        raise ValueError(f"blockwise attention block={block} must be >= 1")
    if q.shape[1] <= materialised_up_to:
        return xla_attention(q, k, v, backward=backward)
    return _blockwise(q, k, v, block)


def _to_blocks(x_BxTxAxH, n_kv: int, block: int):
    """[B, T, A, H] -> [B, K, A // K, Tp, H] (Tp: T padded up to a multiple of `block`)."""
    B, T, A, H = x_BxTxAxH.shape
    Tp = -(-T // block) * block
    x = jnp.pad(x_BxTxAxH, ((0, 0), (0, Tp - T), (0, 0), (0, 0)))
    return x.reshape(B, Tp, n_kv, A // n_kv, H).transpose(0, 2, 3, 1, 4)


def _from_blocks(x_BxKxGxTpxH, T: int, dtype):
    B, K, G, Tp, H = x_BxKxGxTpxH.shape
    return x_BxKxGxTpxH.transpose(0, 3, 1, 2, 4).reshape(B, Tp, K * G, H)[:, :T].astype(dtype)


def _causal(i, j, block: int) -> Bool[Array, "Q C"]:
    """Query block i may see key block j's position c where i * block + q >= j * block + c."""
    pos = jnp.arange(block)
    return (i * block + pos)[:, None] >= (j * block + pos)[None, :]


def _scores(q_i, k_j, i, j, block: int, scale: float):
    """One block's float32 scores [B, K, G, Q, C], causality applied."""
    s = jnp.einsum("bkgqh,bkch->bkgqc", q_i, k_j, preferred_element_type=jnp.float32) * scale
    return jnp.where(_causal(i, j, block), s, _MASKED)


def _blockwise_forward(q, k, v, block: int):
    """(o [B, K, G, Tp, H] in q's dtype, lse [B, K, G, Tp] float32): a loop over query blocks,
    each an online softmax over the key blocks at or below the diagonal (0 .. i)."""
    n_kv, scale = k.shape[2], 1.0 / math.sqrt(q.shape[-1])
    q5, k5, v5 = (_to_blocks(x, n_kv, block) for x in (q, k, v))
    k4, v4 = k5[:, :, 0], v5[:, :, 0]  # [B, K, Tp, H]
    B, K, G, Tp, H = q5.shape

    def query_block(i):
        q_i = lax.dynamic_slice_in_dim(q5, i * block, block, axis=3)

        def key_block(j, carry):
            m, l, acc = carry
            k_j = lax.dynamic_slice_in_dim(k4, j * block, block, axis=2)
            v_j = lax.dynamic_slice_in_dim(v4, j * block, block, axis=2)
            s = _scores(q_i, k_j, i, j, block, scale)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.exp(s - m_new[..., None])
            rescale = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgqc,bkch->bkgqh", p.astype(v.dtype), v_j, preferred_element_type=jnp.float32)
            return m_new, l * rescale + p.sum(axis=-1), acc * rescale[..., None] + pv

        init = (
            jnp.full((B, K, G, block), _MASKED, jnp.float32),
            jnp.zeros((B, K, G, block), jnp.float32),
            jnp.zeros((B, K, G, block, H), jnp.float32),
        )
        m, l, acc = lax.fori_loop(0, i + 1, key_block, init)  # key blocks above the diagonal: never visited
        return (acc / l[..., None]).astype(q.dtype), m + jnp.log(l)

    o_blocks, lse_blocks = lax.map(query_block, jnp.arange(Tp // block))  # [nb, B, K, G, block(, H)]
    o = jnp.moveaxis(o_blocks, 0, 3).reshape(B, K, G, Tp, H)
    return o, jnp.moveaxis(lse_blocks, 0, 3).reshape(B, K, G, Tp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _blockwise(q, k, v, block: int):
    o, _ = _blockwise_forward(q, k, v, block)
    return _from_blocks(o, q.shape[1], q.dtype)


def _blockwise_fwd(q, k, v, block: int):
    o5, lse = _blockwise_forward(q, k, v, block)
    o = _from_blocks(o5, q.shape[1], q.dtype)
    return o, (q, k, v, o, lse)


def _blockwise_bwd(block: int, res, do):
    """FlashAttention-2's backward: a loop over key blocks j, each visiting the query blocks at or
    below the diagonal (j .. nb - 1) and recomputing p = exp(s - lse); dq accumulates in float32."""
    q, k, v, o, lse = res
    T, n_kv, scale = q.shape[1], k.shape[2], 1.0 / math.sqrt(q.shape[-1])
    q5, o5, do5 = (_to_blocks(x, n_kv, block) for x in (q, o, do))
    k4, v4 = (_to_blocks(x, n_kv, block)[:, :, 0] for x in (k, v))
    B, K, G, Tp, H = q5.shape
    nb = Tp // block
    delta = jnp.einsum("bkgth,bkgth->bkgt", do5.astype(jnp.float32), o5.astype(jnp.float32))  # rowsum(dO * O)

    def key_block(dq, j):
        k_j = lax.dynamic_slice_in_dim(k4, j * block, block, axis=2)
        v_j = lax.dynamic_slice_in_dim(v4, j * block, block, axis=2)

        def query_block(i, carry):
            dq, dk_j, dv_j = carry
            q_i, do_i = (lax.dynamic_slice_in_dim(x, i * block, block, axis=3) for x in (q5, do5))
            lse_i, delta_i = (lax.dynamic_slice_in_dim(x, i * block, block, axis=3) for x in (lse, delta))
            p = jnp.exp(_scores(q_i, k_j, i, j, block, scale) - lse_i[..., None])  # 0 where masked
            dv_j = dv_j + jnp.einsum("bkgqc,bkgqh->bkch", p.astype(do.dtype), do_i, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgqh,bkch->bkgqc", do_i, v_j, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta_i[..., None]) * scale).astype(q.dtype)
            dq_i = jnp.einsum("bkgqc,bkch->bkgqh", ds, k_j, preferred_element_type=jnp.float32)
            dq = lax.dynamic_update_slice_in_dim(
                dq, lax.dynamic_slice_in_dim(dq, i * block, block, axis=3) + dq_i, i * block, axis=3
            )
            dk_j = dk_j + jnp.einsum("bkgqc,bkgqh->bkch", ds, q_i, preferred_element_type=jnp.float32)
            return dq, dk_j, dv_j

        zeros = jnp.zeros((B, K, block, H), jnp.float32)
        dq, dk_j, dv_j = lax.fori_loop(j, nb, query_block, (dq, zeros, zeros))
        return dq, (dk_j, dv_j)

    dq, (dk_blocks, dv_blocks) = lax.scan(key_block, jnp.zeros((B, K, G, Tp, H), jnp.float32), jnp.arange(nb))
    dk, dv = (jnp.moveaxis(x, 0, 2).reshape(B, K, 1, Tp, H) for x in (dk_blocks, dv_blocks))
    return _from_blocks(dq, T, q.dtype), _from_blocks(dk, T, k.dtype), _from_blocks(dv, T, v.dtype)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


# ----------------------------------------------------------------------------- splash (TPU)


def splash_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B T K H"],
    v: Float[Array, "B T K H"],
    *,
    interpret: bool = False,
) -> Float[Array, "B T N H"]:
    """TPU's splash attention kernel (make_splash_mha: GQA native, N query heads over K KV heads)
    with a causal mask, per row (vmap over B). The length is padded up to a multiple of
    SPLASH_TILE at the end; q is scaled by 1 / sqrt(H) here (the kernel scales nothing).
    `interpret` runs the kernel in Pallas interpret mode (any platform, slow: tests)."""
    B, T, N, H = q.shape
    Tp = -(-T // SPLASH_TILE) * SPLASH_TILE
    pad = ((0, 0), (0, Tp - T), (0, 0), (0, 0))
    q = (q.astype(jnp.float32) * (1.0 / math.sqrt(H))).astype(q.dtype)
    q_t, k_t, v_t = (jnp.pad(x, pad).transpose(0, 2, 1, 3) for x in (q, k, v))  # [B, heads, Tp, H]
    kernel = _splash_kernel(N, Tp, interpret)
    return jax.vmap(kernel)(q_t, k_t, v_t).transpose(0, 2, 1, 3)[:, :T]


def splash_on_mesh(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B T K H"],
    v: Float[Array, "B T K H"],
    mesh: Mesh | None,
    *,
    interpret: bool = False,
) -> Float[Array, "B T N H"]:
    """splash_attention run per device under shard_map on `mesh`: a Pallas call is a custom call
    that XLA's partitioner cannot split, so fed rows sharded over data x fsdp it would gather the
    whole batch onto every device. Rows over data x fsdp and KV heads (with the query heads that
    read them) over tensor, each axis where it divides (mesh_axes.fit_spec; heads stay whole
    unless tensor divides K); attention is independent per (row, KV head), so no collective. No
    mesh, one device, or inside a shard_map already (its arrays are local): the kernel directly."""
    if mesh is None or mesh.size == 1 or jax.sharding.get_abstract_mesh().manual_axes:
        return splash_attention(q, k, v, interpret=interpret)
    rows, heads = fit_spec(P(BATCH, HEAD_AXIS), (q.shape[0], k.shape[2]), dict(mesh.shape), what="splash attention")
    spec = P(rows, None, heads)
    per_device = functools.partial(splash_attention, interpret=interpret)
    return jax.shard_map(per_device, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(q, k, v)


@functools.lru_cache(maxsize=32)
def _splash_kernel(n_heads: int, length: int, interpret: bool):
    """The kernel for N heads over a padded length (its mask processed once, in NumPy, and cached
    across traces)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    b = next(b for b in SPLASH_BLOCKS if length % b == 0)
    dq_blocks = {} if SPLASH_FUSED_BWD else {"block_q_dq": b, "block_kv_dq": b}
    sizes = splash.BlockSizes(
        block_q=b,
        block_kv=b,
        block_kv_compute=b,
        block_q_dkv=b,
        block_kv_dkv=b,
        block_kv_dkv_compute=b,
        use_fused_bwd_kernel=SPLASH_FUSED_BWD,
        **dq_blocks,
    )
    mask = splash.MultiHeadMask([splash.CausalMask((length, length)) for _ in range(n_heads)])
    with jax.ensure_compile_time_eval():  # its mask tables: concrete constants, not one trace's tracers
        return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


_splash_refused = Primitive("splash_needs_a_tpu")
_splash_refused.def_abstract_eval(lambda x: x)


def _refuse_lowering(ctx, x):
    raise ValueError(
        f"model.attention=splash needs a TPU: this program is lowered for {', '.join(ctx.module_context.platforms)} "
        "(set model.attention=auto or blockwise)"
    )


mlir.register_lowering(_splash_refused, _refuse_lowering)


def _refuse_splash(q, k, v):
    """splash's branch for every platform but a TPU: lowering it raises the error above (a
    constant's primitive, so differentiating or batching the program never reaches it)."""
    return jnp.broadcast_to(_splash_refused.bind(jnp.zeros((), q.dtype)), q.shape)
