"""Qwen2 / Qwen2.5: q/k/v projection biases, no q/k norm, default RoPE."""

from sparserl_jax.model.families.base import FAMILIES, Family

FAMILY = FAMILIES.register(
    Family(
        name="qwen2",
        architecture="Qwen2ForCausalLM",
        qkv_bias=True,
        config_extra=(("use_sliding_window", False),),
    )
)
