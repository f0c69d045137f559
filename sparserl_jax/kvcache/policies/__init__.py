"""Registry of eviction policies: name -> Policy. Adding one is a new file plus one line here."""

from sparserl_jax.kvcache.policies import h2o, none, random, rkv, snapkv, streaming
from sparserl_jax.kvcache.policies.base import Policy

POLICIES: dict[str, Policy] = {
    "none": none.POLICY,
    "streaming": streaming.POLICY,
    "h2o": h2o.POLICY,
    "snapkv": snapkv.POLICY,
    "rkv": rkv.POLICY,
    "random": random.POLICY,
}

__all__ = ["POLICIES", "Policy"]
