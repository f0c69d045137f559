"""Run metrics: TensorBoard scalars (written with the tensorboard package's own event writer, no
TensorFlow needed) and a metrics.jsonl file, one line per iteration."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Mapping

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter


class MetricsLogger:
    def __init__(self, out_dir: str, tensorboard: bool = True):
        os.makedirs(out_dir, exist_ok=True)
        self.jsonl_path = os.path.join(out_dir, "metrics.jsonl")
        self._tb = EventFileWriter(os.path.join(out_dir, "tensorboard")) if tensorboard else None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items()}
        with open(self.jsonl_path, "a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        if self._tb is not None:
            values = [
                summary_pb2.Summary.Value(tag=k, simple_value=v)
                for k, v in clean.items()
                if math.isfinite(v)
            ]
            event = event_pb2.Event(
                wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=values)
            )
            self._tb.add_event(event)
            self._tb.flush()

    def truncate_after(self, step: int) -> None:
        """Drop lines past `step` (a resumed run rewrites the iterations it redoes)."""
        if not os.path.exists(self.jsonl_path):
            return
        with open(self.jsonl_path) as f:
            lines = [line for line in f if json.loads(line)["step"] <= step]
        with open(self.jsonl_path, "w") as f:
            f.writelines(lines)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f]
