"""The experiments, by concern: lib/ (the shared library: figure scaffold, provenance, workers, run
records), figures/ (one script per paper figure), bench/ (benchmarks), device/ (the GPU device
check) and real/ (the real-model studies on SmolLM2). Importable under its own name, `experiments`
(setup.py), and run as `python experiments/<folder>/<script>.py`; `python experiments/default.py`
is the landing command. Imports nothing, so a worker process that imports one of its modules to
set its environment starts no JAX (lib/workers.py)."""
