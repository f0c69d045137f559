"""A registry: name -> item, in the order the items register. Each item registers itself where it
is defined (`ITEM = REGISTRY.register(Item(name=...))`), so a registry knows none of its members;
the eviction policies (kvcache/policies/registry.py) and the corrections
(rl/corrections/registry.py) each keep one. A leaf: it imports nothing of the package."""

from __future__ import annotations

from typing import TypeVar

Item = TypeVar("Item")


class Registry(dict):
    """A dict of name -> item, filled by `register`; `kind` names its items in errors."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, item: Item) -> Item:
        """Add `item` under `item.name` (a name registered twice is an error) and return it."""
        if item.name in self:
            raise ValueError(f"{self.kind} {item.name!r} is registered twice")
        self[item.name] = item
        return item
