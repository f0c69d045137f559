"""Prompts and rewards: jsonl datasets (datasets.py), verifiable rewards (rewards.py) and
synthetic tasks (tasks/). Import the submodules directly; this package stays import-light
because the reward checker subprocess starts from it."""
