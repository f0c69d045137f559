"""Attention kernels with their jnp references (importable as `sparserl_jax.kernels`).

`decode_attention` is the dispatcher used by the model's decode step: the Pallas kernel on GPU
(Triton) or TPU (Mosaic), the XLA reference on CPU; given a mesh, under shard_map (sharded.py).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from sparserl_jax.kernels import decode_attention_gpu as _gpu
from sparserl_jax.kernels import decode_attention_tpu as _tpu
from sparserl_jax.kernels.decode_attention_ref import decode_attention_ref
from sparserl_jax.kernels.sharded import shard_attention

IMPLS = ("auto", "xla", "pallas", "interpret")
PALLAS_PLATFORMS = ("gpu", "tpu")
_PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu"}
_TRACER = getattr(jax.core, "Tracer", ())


def current_platform(x: Array | None = None) -> str:
    """Platform ("cpu", "gpu", "tpu") of a concrete array's device, else jax's default backend."""
    platform = jax.default_backend()  # under jit (tracers) the default backend runs the call
    if isinstance(x, jax.Array) and not isinstance(x, _TRACER):
        try:
            platform = next(iter(x.devices())).platform
        except jax.errors.ConcretizationTypeError:  # a tracer on a jax without jax.core.Tracer
            pass
    return _PLATFORM_ALIASES.get(platform, platform)


def _pallas(q, k, v, fill, scale, platform, interpret, block_c, num_splits):
    if platform == "tpu":
        mode = _tpu.tpu_interpret_mode() if interpret else False
        return _tpu.decode_attention_tpu(
            q, k, v, fill, scale, block_c=block_c, num_splits=num_splits or 1, interpret=mode
        )
    reason = _gpu.unsupported_reason(q, k, block_c or 64)
    if reason is not None:
        impl = "interpret" if interpret else "pallas"
        raise ValueError(f"attention impl={impl!r} on gpu: {reason}")
    return _gpu.decode_attention_gpu(
        q, k, v, fill, scale, block_c=block_c or 64, num_splits=num_splits, interpret=interpret
    )


def decode_attention(
    q: Float[Array, "B N H"],
    k: Float[Array, "B K C H"],
    v: Float[Array, "B K C H"],
    fill: Int[Array, " B"],
    scale: float | None = None,
    impl: str = "auto",
    *,
    platform: str | None = None,
    block_c: int | None = None,
    num_splits: int | None = None,
    mesh: Mesh | None = None,
) -> tuple[Float[Array, "B N H"], Float[Array, "B N"]]:
    """Single-query slot-cache attention; see `decode_attention_ref` for the contract.

    impl: "xla" the jnp reference; "pallas" the kernel of `platform` (default: the arrays' or
    jax's default platform; must be gpu or tpu); "interpret" that kernel in Pallas interpret mode
    (on CPU the GPU kernel, unless platform="tpu" or this jax lacks Pallas Triton); "auto"
    Pallas on GPU/TPU and the reference on CPU, and also the reference for shapes the GPU
    kernel cannot tile (head_dim not a power of two >= 16). block_c / num_splits tune the
    Pallas kernels (None: their defaults). mesh: a ("data", "fsdp", "tensor") mesh over which
    q, k, v and fill are sharded like the KV cache; each device then attends with its own
    shard (`shard_attention`) instead of XLA gathering the cache before an opaque Pallas call.
    """
    if impl not in IMPLS:
        raise ValueError(f"attention impl={impl!r}: expected one of {IMPLS}")
    platform = _PLATFORM_ALIASES.get(platform, platform) if platform else current_platform(q)

    def attend(q, k, v, fill):
        return _dispatch(q, k, v, fill, scale, impl, platform, block_c, num_splits)

    return shard_attention(attend, mesh, q, k, v, fill)


def _dispatch(q, k, v, fill, scale, impl, platform, block_c, num_splits):
    if impl == "xla":
        return decode_attention_ref(q, k, v, fill, scale)
    if impl == "interpret":
        if platform != "tpu" and not _gpu.TRITON_AVAILABLE:
            platform = "tpu"  # the only Pallas kernel this jax can interpret
        return _pallas(q, k, v, fill, scale, platform, True, block_c, num_splits)
    if platform not in PALLAS_PLATFORMS:
        if impl == "pallas":
            raise ValueError(
                f"attention impl='pallas' needs platform in {PALLAS_PLATFORMS}, got {platform!r}; "
                "use impl='interpret' or 'xla' on CPU"
            )
        return decode_attention_ref(q, k, v, fill, scale)
    if impl == "auto" and platform == "gpu" and _gpu.unsupported_reason(q, k, block_c or 64):
        return decode_attention_ref(q, k, v, fill, scale)
    return _pallas(q, k, v, fill, scale, platform, False, block_c, num_splits)


__all__ = [
    "IMPLS",
    "current_platform",
    "decode_attention",
    "decode_attention_ref",
    "shard_attention",
]
