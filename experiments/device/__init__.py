"""The device check: `python experiments/device/gpu_check.py` runs its steps (environment, kernel,
sampler, update, study, end to end) on a lent GPU within one call's budget and writes
experiments/results/gpu/<device>/. gpu_check.py is the script; the other modules are its steps."""
