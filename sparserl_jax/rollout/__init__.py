"""Owns sampling: the static scan sampler, SortedRL's slot engine and scheduler, rollout sources.
Must not touch rewards, advantages, the update or the run directory: imports no rl/, run_state, train.

Nor the run's schema or builders (config.py, components): its sources are handed the rollout,
quant and sorted sections and a SamplerConfig, which alone says what is sampled (tests/test_layering.py).
"""
