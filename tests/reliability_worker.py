"""A training run in a subprocess, for tests/test_reliability.py.

python tests/reliability_worker.py metrics OUT.json [key=value ...]
    pins itself to one core (experiments/lib/workers.py), trains the default experiment's config
    with the overrides and writes every metric of every iteration except timings to OUT.json.
python tests/reliability_worker.py kill POINT STEP [key=value ...]
    runs `python -m sparserl_jax.train` on the smoke config and SIGKILLs itself at POINT of
    iteration STEP: "logged" (after its metrics are written, before its checkpoint) or
    "checkpoint" (while its checkpoint is being written).
"""

import json
import os
import signal
import sys

from experiments.lib import workers  # imports no JAX

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def metrics(out: str, overrides: list[str]) -> None:
    assert workers.pin_to_one_core()
    from sparserl_jax.config import load_config
    from sparserl_jax.train import Trainer

    cfg = load_config([os.path.join(REPO, "experiments/configs/default.yaml")], overrides)
    history = Trainer(cfg, log=lambda *a, **k: None).run()
    keep = [{k: v for k, v in h.items() if not k.startswith(("time/", "throughput/"))} for h in history]
    with open(out, "w") as f:
        json.dump(keep, f)


def kill(point: str, step: int, overrides: list[str]) -> None:
    workers.pin_to_one_core()
    from sparserl_jax import checkpoint, metrics_log, train

    if point == "logged":
        log = metrics_log.MetricsLogger.log

        def log_then_die(self, s, m):
            log(self, s, m)
            if s == step:
                _die()

        metrics_log.MetricsLogger.log = log_then_die
    elif point == "checkpoint":
        save = checkpoint.Checkpointer.save

        def die_while_saving(self, s, items, meta):
            if s != step:
                return save(self, s, items, meta)
            args = {name: checkpoint.ocp.args.StandardSave(t) for name, t in items.items()}
            self._mngr.save(s, args=checkpoint.ocp.args.Composite(meta=checkpoint.ocp.args.JsonSave(meta), **args))
            _die()  # the write is under way (orbax finalises it asynchronously)

        checkpoint.Checkpointer.save = die_while_saving
    else:
        raise SystemExit(f"unknown point {point!r}")
    train.main(["--config", os.path.join(REPO, "experiments/configs/smoke.yaml"), *overrides])


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "metrics":
        metrics(sys.argv[2], sys.argv[3:])
    else:
        kill(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
