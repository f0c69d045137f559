"""The eviction policies, one file each, and their registry (registry.py): name -> Policy.

Each policy registers itself where it is defined; adding one is a new file plus its name on the
import line below, whose order is the registry's (lists of policies follow it: dense first).
"""

# isort: off
from sparserl_jax.kvcache.policies import none, streaming, h2o, snapkv, rkv, random  # noqa: F401

# isort: on
from sparserl_jax.kvcache.policies.base import Policy
from sparserl_jax.kvcache.policies.registry import POLICIES, register

__all__ = ["POLICIES", "Policy", "register"]
