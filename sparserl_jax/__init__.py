"""sparserl_jax: RL for LLMs with cheap rollouts (Sparse-RL, QuRL, SortedRL) in JAX."""

__version__ = "0.1.0"
