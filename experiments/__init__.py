"""The experiments: the figure scripts on the Figure scaffold (figlib.py), the benchmarks and the
real-model measurements (real/), importable as `sparserl_jax.experiments` (setup.py) and run as
`python experiments/<script>.py`. Imports nothing, so a worker process that imports one of its
modules to set its environment starts no JAX (workers.py)."""
