"""XLA's CPU backend on one thread (no Eigen thread pool), for a benchmark that times one core:
importing this module adds the flags to XLA_FLAGS, which XLA reads once, when JAX starts its
backend (so before any array is made, not necessarily before jax is imported)."""

import os

FLAGS = " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + FLAGS


def xla_flags() -> str:
    """The XLA_FLAGS this process runs with."""
    return os.environ["XLA_FLAGS"].strip()
