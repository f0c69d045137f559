"""The registry of eviction policies: name -> Policy, in the order they are registered.

Each policy registers itself where it is defined (`POLICY = register(Policy(...))`); importing
`sparserl_jax.kvcache.policies` imports every shipped one. KVConfig (kvcache/config.py) checks
kv.policy against it, so no policy module imports the config.
"""

from __future__ import annotations

from sparserl_jax.kvcache.policies.base import Policy
from sparserl_jax.registry import Registry

POLICIES: Registry[str, Policy] = Registry("eviction policy")
register = POLICIES.register
