"""Orbax checkpoints of a training run: params, optimizer state, iteration and data position.

Orbax writes each step to a temporary directory and renames it when complete, and deletes old
steps only after a newer one is finalised, so an interrupted save never costs the last checkpoint.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory: str, keep: int = 3):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self._mngr = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def save(self, step: int, items: dict[str, Any], meta: dict) -> None:
        """Save named pytrees (e.g. params, opt_state) and a JSON-able `meta` dict; blocks until
        the step is on disk."""
        args = {name: ocp.args.StandardSave(tree) for name, tree in items.items()}
        self._mngr.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **args))
        self._mngr.wait_until_finished()

    def restore(self, step: int, like: dict[str, Any]) -> tuple[dict[str, Any], dict]:
        """Restore the named items of `like` at `step`, with their structure, shapes, dtypes and
        shardings (items not named are not read)."""
        args = {
            name: ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, tree))
            for name, tree in like.items()
        }
        out = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), **args))
        return {name: out[name] for name in like}, dict(out["meta"])

    def close(self) -> None:
        self._mngr.close()


def restore_params(directory: str, like: Any, step: int | None = None) -> tuple[Any, dict]:
    """Params of a training checkpoint directory (its latest step unless `step` is given)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
    ckpt = Checkpointer(directory)
    step = ckpt.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint found in {directory!r}")
    items, meta = ckpt.restore(step, {"params": like})
    ckpt.close()
    return items["params"], meta
