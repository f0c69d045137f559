"""Multi-process (multi-host) runtime: joining it, and per-process data loading.

JAX's own runtime is the distributed engine: every process runs the same program over one global
mesh (sharding.make_mesh spans all processes' devices), loads only the batch rows its devices hold,
and jit runs the collectives (NCCL on GPU, ICI/DCN on TPU, gloo over TCP on CPU).

Launch one process per host (or per GPU), each with the same coordinator address:
    JAX_COORDINATOR_ADDRESS=10.0.0.1:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 python train.py ...
or on Slurm / Open MPI / Cloud TPU / Kubernetes call initialize(auto_detect=True).
"""

from __future__ import annotations

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
    logger.info(
        "joined %d processes as process %d (%d local of %d devices)",
        jax.process_count(),
        jax.process_index(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return True


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


def sync(name: str) -> None:
    """Barrier across processes (e.g. before process 0 reads files the others wrote)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


__all__ = [
    "initialize",
    "shutdown",
    "process_index",
    "process_count",
    "is_coordinator",
    "local_batch_slice",
    "host_local_to_global",
    "to_host",
    "sync",
]
