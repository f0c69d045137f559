"""Run metrics: TensorBoard scalars (written with the tensorboard package's own event writer, no
TensorFlow needed) and a metrics.jsonl file, one line per iteration."""

from __future__ import annotations

import glob
import json
import math
import os
import time
from collections.abc import Mapping

from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter


class MetricsLogger:
    """Appends one line per iteration to metrics.jsonl and one event to tensorboard/; a run that
    starts or resumes first calls `truncate_after(step)` so that neither holds an iteration twice."""

    def __init__(self, out_dir: str, tensorboard: bool = True):
        os.makedirs(out_dir, exist_ok=True)
        self.jsonl_path = os.path.join(out_dir, "metrics.jsonl")
        self.tb_dir = os.path.join(out_dir, "tensorboard") if tensorboard else None
        self._tb = None  # opened at the first log, after any truncation

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items()}
        with open(self.jsonl_path, "a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        if self.tb_dir is not None:
            if self._tb is None:
                self._tb = EventFileWriter(self.tb_dir)
            values = [summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in clean.items() if math.isfinite(v)]
            event = event_pb2.Event(wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=values))
            self._tb.add_event(event)
            self._tb.flush()

    def truncate_after(self, step: int) -> None:
        """Drop metrics.jsonl lines and TensorBoard events past `step` (0 on a fresh start): the
        iterations a restarted run redoes are then written once."""
        if os.path.exists(self.jsonl_path):
            with open(self.jsonl_path) as f:
                lines = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
            with open(self.jsonl_path, "w") as f:
                f.writelines(lines)
        if self.tb_dir is None or self._tb is not None:
            return
        old = sorted(glob.glob(os.path.join(self.tb_dir, "events.out.tfevents.*")))
        kept = [e for path in old for e in EventFileLoader(path).Load() if e.HasField("summary") and e.step <= step]
        for path in old:
            os.remove(path)
        if kept:
            self._tb = EventFileWriter(self.tb_dir)
            for event in kept:
                self._tb.add_event(event)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f]
