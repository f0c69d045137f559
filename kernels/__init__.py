"""Attention kernels with their jnp references (importable as `sparserl_jax.kernels`).

`decode_attention` is the dispatcher used by the model's decode step.
"""

from sparserl_jax.kernels.decode_attention_ref import decode_attention_ref


def decode_attention(q, k, v, fill, scale=None, impl: str = "auto"):
    """Single-query slot-cache attention; see `decode_attention_ref` for the contract."""
    if impl in ("auto", "xla"):
        return decode_attention_ref(q, k, v, fill, scale)
    raise ValueError(f"attention impl={impl!r}: expected one of ('auto', 'xla')")


__all__ = ["decode_attention", "decode_attention_ref"]
