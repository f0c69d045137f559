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

    def all_steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def restore_latest(self, like: dict[str, Any], log=print) -> tuple[int, dict[str, Any], dict] | None:
        """(step, items, meta) of the newest checkpoint that restores, or None when there is none.
        A damaged newer one (truncated file, missing item) is skipped with a one-line warning; when
        every checkpoint is damaged, a ValueError names the directory."""
        steps = self.all_steps()
        for step in reversed(steps):
            try:
                items, meta = self.restore(step, like)
            except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types
                log(
                    f"warning: skipping damaged checkpoint {self.directory}/{step} "
                    f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
                )
                continue
            return step, items, meta
        if steps:
            raise ValueError(
                f"no intact checkpoint in {self.directory} (steps {steps} all damaged); "
                "delete the directory to start again"
            )
        return None

    def delete_after(self, step: int) -> None:
        """Delete the checkpoints past `step` (e.g. those saved after training diverged)."""
        for s in self.all_steps():
            if s > step:
                self._mngr.delete(s)

    def close(self) -> None:
        self._mngr.close()


def restore_params(directory: str, like: Any, step: int | None = None) -> tuple[Any, dict]:
    """Params of a training checkpoint directory (its latest step unless `step` is given)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
    ckpt = Checkpointer(directory)
    try:
        if step is None:
            found = ckpt.restore_latest({"params": like})
            if found is None:
                raise FileNotFoundError(f"no checkpoint found in {directory!r}")
            items, meta = found[1], found[2]
        else:
            if step not in ckpt.all_steps():
                raise ValueError(f"--step {step}: no such checkpoint in {directory!r}; saved steps: {ckpt.all_steps()}")
            items, meta = ckpt.restore(step, {"params": like})
    finally:
        ckpt.close()
    return items["params"], meta
