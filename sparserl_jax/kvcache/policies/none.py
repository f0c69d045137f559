"""Dense: keep everything, never evict (the cache capacity is the maximum length)."""

from sparserl_jax.kvcache.policies.base import Policy

POLICY = Policy(name="none", score=None)
