"""Registry of synthetic verifiable tasks (one file per task, one line here)."""

from __future__ import annotations

import dataclasses
import typing

from sparserl_jax.config_io import coerce
from sparserl_jax.data.tasks.arithmetic import ArithmeticTask
from sparserl_jax.data.tasks.base import BoxedAnswerTask, Task
from sparserl_jax.data.tasks.chat_arithmetic import ChatArithmeticTask
from sparserl_jax.data.tasks.copy_digits import CopyDigitsTask
from sparserl_jax.data.tasks.cycle_walk import CycleWalkTask
from sparserl_jax.data.tasks.kv_recall import KVRecallTask

TASKS: dict[str, type] = {
    "arithmetic": ArithmeticTask,
    "kv_recall": KVRecallTask,
    "copy_digits": CopyDigitsTask,
    "cycle_walk": CycleWalkTask,
    "chat_arithmetic": ChatArithmeticTask,
}


def get_task(name: str, **options) -> Task:
    """The task `name` with its difficulty options, e.g. get_task("kv_recall", max_pairs=20)."""
    if name not in TASKS:
        raise ValueError(f"task={name!r} is not registered; accepted: {sorted(TASKS)}")
    cls = TASKS[name]
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(f"task {name!r} has no option(s) {unknown}; accepted: {fields}")
    hints = typing.get_type_hints(cls)
    return cls(**{k: coerce(v, hints[k], f"data.task_options.{k}") for k, v in options.items()})


__all__ = [
    "TASKS",
    "Task",
    "BoxedAnswerTask",
    "get_task",
    "ArithmeticTask",
    "KVRecallTask",
    "CopyDigitsTask",
    "CycleWalkTask",
    "ChatArithmeticTask",
]
