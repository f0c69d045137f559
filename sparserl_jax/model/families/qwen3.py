"""Qwen3: no biases, per-head RMSNorm on q and k before RoPE, default RoPE."""

from sparserl_jax.model.families.base import FAMILIES, Family

FAMILY = FAMILIES.register(
    Family(
        name="qwen3",
        architecture="Qwen3ForCausalLM",
        qk_norm=True,
        config_extra=(("attention_bias", False), ("use_sliding_window", False)),
    )
)
