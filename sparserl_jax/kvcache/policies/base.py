"""What an eviction policy is: a score per slot, the cache state it needs, extra slots it keeps.

`compress` (sparserl_jax/kvcache/compress.py) does the rest for every policy: it forces the last
w keys to be kept, never keeps empty slots, takes the top B per (layer, sequence, KV head) or the
shared choice, and gathers the kept entries into slots [0, B) in original-position order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxtyping import Array, Bool, Float

# score(kv_cfg, cache, layer, key) -> [B, K, C] float32: larger is kept first. Only the
# candidate slots [0, fill - w) are read; other slots may hold anything finite. kv_cfg is the
# run's KVConfig (kvcache/config.py), which stands above the registry (it checks kv.policy
# against it), so a policy reads its knobs from it without importing it.
ScoreFn = Callable[..., Float[Array, "B K C"]]
# forced(kv_cfg, cache) -> [B, C]: slots kept regardless of their score (beyond the window).
ForcedFn = Callable[..., Bool[Array, "B C"]]

STATES: tuple[str, ...] = ("mass", "window_q")


@dataclasses.dataclass(frozen=True)
class Policy:
    """An eviction policy. `score` is None for the dense policy (never evicts).

    state: the optional cache fields it reads ("mass": H2O attention mass; "window_q": the last w
    queries); the observers in sparserl_jax/kvcache/observe.py keep them up to date.
    needs_key: the score is random and needs a jax key.
    """

    name: str
    score: ScoreFn | None
    state: tuple[str, ...] = ()
    forced: ForcedFn | None = None
    needs_key: bool = False

    def __post_init__(self):
        unknown = set(self.state) - set(STATES)
        if unknown:
            raise ValueError(f"policy {self.name!r}: unknown state {unknown}; expected {STATES}")
