"""Owns sampling: the static scan sampler, SortedRL's slot engine and scheduler, rollout sources.
Must not touch rewards, advantages, the update or the run directory: imports no rl/, run_state, train.
"""
