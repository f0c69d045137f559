"""Dense: keep everything, never evict (the cache capacity is the maximum length)."""

from sparserl_jax.kvcache.policies.base import Policy
from sparserl_jax.kvcache.policies.registry import register

POLICY = register(Policy(name="none", score=None))
