"""The real-model measurements (mismatch, lengths, calibration, update masking) and their report,
importable as `sparserl_jax.experiments.real`."""
