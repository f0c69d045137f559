"""The device mesh's axis names and how a PartitionSpec over them fits an array's shape.

A leaf (it imports nothing of the package): the model's sharding rules (model/sharding.py) and the
decode attention kernels (kernels/sharded.py), which sit below the model, share it. A dim that its
mesh axes do not divide is replicated instead (logged once).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence

from jax.sharding import PartitionSpec as P

logger = logging.getLogger(__name__)

AXES: tuple[str, str, str] = ("data", "fsdp", "tensor")
BATCH: tuple[str, str] = ("data", "fsdp")  # mesh axes a [B, ...] array's batch dim splits over

_logged_fallbacks: set[tuple] = set()


def entry_size(entry, axis_sizes: Mapping[str, int]) -> int:
    """Devices a spec entry spans: one axis name, or the product of a tuple of them."""
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(axis_sizes[n] for n in names)


def fit_spec(spec: P, shape: Sequence[int], axis_sizes: Mapping[str, int], what: str = "array") -> P:
    """`spec` with every mesh axis that does not divide its dim dropped (that dim replicated).

    A tuple entry such as ("data", "fsdp") keeps its longest prefix that divides the dim. Each
    distinct fallback is logged once at info level (e.g. GQA with fewer KV heads than `tensor`).
    """
    entries = tuple(spec)
    if len(entries) > len(shape):
        raise ValueError(f"partition spec {spec} has more entries than {what} has dims {shape}")
    fitted = []
    for dim, (size, entry) in enumerate(zip(shape, entries)):
        if entry is None or size % entry_size(entry, axis_sizes) == 0:
            fitted.append(entry)
            continue
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = next(
            (names[:i] for i in range(len(names) - 1, 0, -1) if size % entry_size(names[:i], axis_sizes) == 0),
            (),
        )
        new = None if not kept else (kept if len(kept) > 1 else kept[0])
        fitted.append(new)
        key = (re.sub(r"/\d+/", "/*/", what), dim, size, entry, new)
        if key not in _logged_fallbacks:  # once per rule, not once per layer
            _logged_fallbacks.add(key)
            logger.info(
                "%s dim %d (size %d) is not divisible by mesh axes %s (size %d): sharding it as %s",
                key[0],
                dim,
                size,
                entry,
                entry_size(entry, axis_sizes),
                new,
            )
    return P(*fitted)
