"""One of the processes of tests/test_multihost.py: joins a 2-process JAX runtime over 127.0.0.1
(gloo CPU collectives), builds the global 2x2x2 mesh over both processes' 4 fake CPU devices each,
and checks sharded logits, prefill and decode steps against a reference it computes alone on its
own first device. Usage: multihost_worker.py PROCESS_ID NUM_PROCESSES PORT."""

from __future__ import annotations

import sys

import numpy as np

from sparserl_jax import distributed


def main(process_id: int, num_processes: int, port: int) -> None:
    assert distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id, initialization_timeout=60)
    import jax
    from sharding_worker import check_equivalence

    from sparserl_jax.model import sharding as shd
    from sparserl_jax.model.config import ModelConfig

    assert jax.process_count() == num_processes and jax.process_index() == process_id
    assert jax.local_device_count() == 4 and jax.device_count() == 4 * num_processes
    mesh = shd.make_mesh(shd.MeshConfig(data=2, fsdp=2, tensor=2))
    assert not shd.data_sharding(mesh).is_fully_addressable  # the mesh spans both processes

    batch = 4
    rows = distributed.local_batch_slice(mesh, batch)
    assert rows.stop - rows.start == batch // num_processes, rows
    print(f"ROWS {process_id} {rows.start} {rows.stop}", flush=True)

    def to_global(x):
        """Each process hands over only the rows it loads (what a data loader would read)."""
        local = np.asarray(x)[distributed.local_batch_slice(mesh, x.shape[0])]
        return distributed.host_local_to_global(local, mesh)

    # One layer keeps compile time down; the layer stack is covered by tests/test_sharding.py.
    cfg = ModelConfig.tiny(n_heads=4, n_kv_heads=2, tie_embeddings=False, n_layers=1)
    check_equivalence(mesh, cfg, to_global, batch=batch, steps=2, seed=3)
    distributed.sync("multihost_worker_done")
    print(f"MULTIHOST_WORKER_OK {process_id}", flush=True)
    distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
