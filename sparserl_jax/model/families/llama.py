"""Llama 3.x: no biases, no q/k norm, Llama-3 RoPE frequency scaling."""

from sparserl_jax.model.families.base import FAMILIES, Family

FAMILY = FAMILIES.register(
    Family(
        name="llama",
        architecture="LlamaForCausalLM",
        rope="llama3",
        config_extra=(("attention_bias", False), ("mlp_bias", False)),
    )
)
