"""Rewards whose check hangs on the response "hang" (or dies on "crash"), for
tests/test_rewards_pool.py: a module that imports nothing heavy, so that a reward-pool worker unpickling one of them (by reference to this
module) spends no time importing JAX."""

import os
import signal
import time


def sleepy_reward(response: str, label: str) -> float:
    """A check that hangs in Python code (where SIGALRM is heard) on the response "hang"."""
    if response == "hang":
        time.sleep(600)
    return float(response == label)


def deaf_reward(response: str, label: str) -> float:
    """A check that hangs deaf to SIGALRM (as one stuck in C code is) on the response "hang"."""
    if response == "hang":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(600)
    return float(response == label)


def crashing_reward(response: str, label: str) -> float:
    """A check whose process dies (as one killed for its memory would) on the response "crash"."""
    if response == "crash":
        os._exit(1)
    return float(response == label)
