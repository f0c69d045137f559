"""The model families (one file each, registered in FAMILIES on import; this line's order is the
registry's): Qwen2 / Qwen2.5, Llama 3.x, Qwen3."""

# isort: off
from sparserl_jax.model.families import qwen2, llama, qwen3  # noqa: F401  (the registry's order)

# isort: on
from sparserl_jax.model.families.base import FAMILIES, ROPE_TYPES, Family

__all__ = ["FAMILIES", "ROPE_TYPES", "Family"]
