"""Multi-process (multi-host) runtime: joining it, per-process data loading, and host-side work
split over the processes (process_rows, allgather_rows: each rewards its own share of a batch).

JAX's own runtime is the distributed engine: every process runs the same program over one global
mesh (sharding.make_mesh spans all processes' devices), loads only the batch rows its devices hold,
and jit runs the collectives (NCCL on GPU, ICI/DCN on TPU, gloo over TCP on CPU).

Launch one process per host (or per GPU), either with the three variables set by hand
(`--distributed env`, the default):
    JAX_COORDINATOR_ADDRESS=10.0.0.1:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 python train.py ...
or, on a cluster JAX detects (Cloud TPU pod slices, Slurm, Open MPI, Kubernetes / GKE), with the
same command on every host and nothing set by hand (`--distributed auto`: jax.distributed.initialize()
with no arguments, its cluster detection filling in the coordinator, process count and id):
    python -m sparserl_jax.train --distributed auto ...
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from sparserl_jax.model import sharding as shd

logger = logging.getLogger(__name__)

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
# How an entry point joins the runtime (--distributed): "env", the explicit variables above
# (initialize(); a single process without them); "auto", JAX's own cluster detection (join).
MODES = ("env", "auto")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: int | Sequence[int] | None = None,
    *,
    auto_detect: bool = False,
    cpu_collectives: str | None = "gloo",
    initialization_timeout: int = 300,
) -> bool:
    """Join the multi-process runtime (jax.distributed.initialize); True when it is running.

    Must run before any other JAX call. Arguments left None are read from JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES and JAX_PROCESS_ID. With no coordinator address and auto_detect=False this is
    a no-op (returns False): a plain single-process run. Cluster auto-detection (Slurm, Open MPI,
    Cloud TPU, Kubernetes) is opt-in because its probes (TPU metadata server, mpi4py) are slow or
    misfire on a workstation. `cpu_collectives` picks the cross-process collectives of CPU devices
    ("gloo" or "mpi"); it does not affect GPU or TPU. Calling it again once initialized is a no-op.
    """
    if jax.distributed.is_initialized():
        return True
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if coordinator_address is None and not auto_detect:
        if num_processes not in (None, 1):
            raise ValueError(
                f"distributed.num_processes={num_processes} needs a coordinator address "
                f"(argument coordinator_address or ${ENV_COORDINATOR}) or auto_detect=True"
            )
        return False
    if not auto_detect and (num_processes is None or process_id is None):
        raise ValueError(
            f"distributed: coordinator {coordinator_address!r} given but num_processes={num_processes} "
            f"and process_id={process_id}; set both (or ${ENV_NUM_PROCESSES} and ${ENV_PROCESS_ID}), "
            "or pass auto_detect=True on a supported cluster"
        )
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"distributed.process_id={process_id} must be in [0, num_processes={num_processes})")
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=initialization_timeout,
    )
    _log_joined()
    return True


def join(mode: str = "env") -> bool:
    """Join the runtime as an entry point's --distributed says (MODES); True when it is running.

    "env": initialize(), reading JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID
    (a single process without them). "auto": jax.distributed.initialize() with no arguments, so
    JAX's cluster detection (Cloud TPU pod slices, Slurm, Open MPI, Kubernetes / GKE) fills in the
    coordinator, the process count and this process's id: one command on every host (off such a
    cluster: a ValueError naming the flag and the "env" alternative). Must run before any other
    JAX call."""
    if mode not in MODES:
        raise ValueError(f"--distributed={mode!r}: accepted values are {MODES}")
    if mode == "env":
        return initialize()
    if jax.distributed.is_initialized():
        return True
    try:
        jax.distributed.initialize()
    except ValueError as e:  # JAX's "coordinator_address should be defined": no cluster detected
        raise ValueError(
            f"--distributed auto: JAX detected no cluster (Cloud TPU pod slice, Slurm, Open MPI, "
            f"Kubernetes) to give the coordinator, process count and id ({e}); set "
            f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} and use --distributed env"
        ) from e
    _log_joined()
    return True


def add_distributed_arg(p: argparse.ArgumentParser) -> None:
    """The entry points' --distributed flag (join's mode)."""
    p.add_argument(
        "--distributed",
        choices=MODES,
        default="env",
        help="join the multi-process runtime from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and "
        "JAX_PROCESS_ID ('env', the default; a single process without them) or by JAX's cluster "
        "detection on a TPU pod slice, Slurm, Open MPI or Kubernetes ('auto': one command on every host)",
    )


def _log_joined() -> None:
    logger.info(
        "joined %d processes as process %d (%d local of %d devices)",
        jax.process_count(),
        jax.process_index(),
        jax.local_device_count(),
        jax.device_count(),
    )


def shutdown() -> None:
    """Leave the multi-process runtime (no-op when it was never joined)."""
    jax.distributed.shutdown()


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def is_coordinator() -> bool:
    """Process 0: the one that writes logs, metrics and (with orbax) checkpoint metadata."""
    return jax.process_index() == 0


def local_batch_slice(mesh: Mesh, global_batch: int) -> slice:
    """Rows [start, stop) of a global [B, ...] batch that this process loads (data_sharding)."""
    sharding = shd.data_sharding(mesh)
    rows = sorted(
        {
            (idx[0].start or 0, global_batch if idx[0].stop is None else idx[0].stop)
            for idx in sharding.addressable_devices_indices_map((global_batch,)).values()
        }
    )
    start, stop = rows[0][0], rows[-1][1]
    covered = sum(b - a for a, b in rows)
    if covered != stop - start:
        raise ValueError(
            f"this process's rows {rows} of the batch ({global_batch}) are not contiguous; "
            "use a mesh whose leading axes span processes (sharding.make_mesh does)"
        )
    return slice(start, stop)


def host_local_to_global(local: Any, mesh: Mesh) -> Any:
    """Global [B, ...] arrays on data_sharding(mesh) from each process's own rows (a pytree of
    numpy arrays, rows local_batch_slice(mesh, B)); the global batch is processes x local rows."""
    sharding = shd.data_sharding(mesh)
    return jax.tree_util.tree_map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), local)


def to_host(x: Any) -> Any:
    """Full numpy values of (possibly multi-process) global arrays, on every process.
    A collective: every process must call it."""

    def gather(a):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(a, tiled=True))
        return np.asarray(a)

    return jax.tree_util.tree_map(gather, x)


def process_rows(n: int, index: int, count: int) -> slice:
    """Rows [start, stop) of n host-side items (a batch's responses to reward) that process `index`
    of `count` handles: contiguous, in process order, sizes differing by at most one, so every row
    is handled once."""
    if not 0 <= index < count:
        raise ValueError(f"process index={index} must be in [0, process count={count})")
    per, extra = divmod(n, count)
    start = index * per + min(index, extra)
    return slice(start, start + per + (index < extra))


def allgather_rows(local: np.ndarray, n: int) -> np.ndarray:
    """The [n, ...] host array whose rows process_rows(n, p, P) are process p's `local`, on every
    process (the processes' rows padded to one width for the allgather). A collective: every
    process must call it."""
    count = jax.process_count()
    if count == 1:
        return np.asarray(local)
    width = -(-n // count)
    padded = np.zeros((width, *np.shape(local)[1:]), np.asarray(local).dtype)
    padded[: len(local)] = local
    gathered = np.asarray(multihost_utils.process_allgather(padded))  # [count, width, ...]
    parts = [gathered[p, : len(range(n)[process_rows(n, p, count)])] for p in range(count)]
    return np.concatenate(parts)


def sync(name: str) -> None:
    """Barrier across processes (e.g. before process 0 reads files the others wrote)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


__all__ = [
    "MODES",
    "add_distributed_arg",
    "initialize",
    "join",
    "shutdown",
    "process_index",
    "process_count",
    "is_coordinator",
    "local_batch_slice",
    "host_local_to_global",
    "to_host",
    "process_rows",
    "allgather_rows",
    "sync",
]
