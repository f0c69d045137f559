"""SortedRL's comparison of rollout engines on one workload: the static sampler (batches of Q rows,
each decoded until its longest row ends) against the slot engine (sparserl_jax/rollout/engine.py:
Q slots, each refilled as soon as its response ends, FIFO), on N requests with forced response
lengths, the same for both arms, so both decode the same tokens and the comparison is exact.

Shapes: N requests, P prompt tokens, Q slots (the static sampler's batch).
Used by experiments/bench/bench_sorted.py and the device check's engine step (device/gpu_engine.py).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Int

from sparserl_jax import compile_clock
from sparserl_jax import kvcache as kv
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rollout import sampler as smp
from sparserl_jax.rollout.engine import SlotEngine
from sparserl_jax.rollout.stats import rollout_bubble


def workload(n: int, *, max_new: int, short: tuple[int, int], long_frac: float, seed: int = 0) -> Int[np.ndarray, " N"]:
    """Forced lengths: a fraction `long_frac` at the cap `max_new`, the rest uniform in `short`
    (both ends included)."""
    lo, hi = short
    if not 1 <= lo <= hi <= max_new:
        raise ValueError(
            f"short={tuple(short)} with max_new={max_new}: the short lengths need "
            "1 <= low <= high <= max_new (bench_sorted.py's --short and --max-new)"
        )
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, size=n)
    lengths[rng.random(n) < long_frac] = max_new
    return lengths.astype(np.int32)


def requests(
    n: int, *, prompt_len: int, vocab: int, min_len: int = 8, seed: int = 1
) -> tuple[Int[np.ndarray, "N P"], Int[np.ndarray, " N"]]:
    """Random prompts of min_len..prompt_len tokens (ids 1..vocab-1), right-padded with 0."""
    rng = np.random.default_rng(seed)
    prompts_NxP = rng.integers(1, vocab, size=(n, prompt_len)).astype(np.int32)
    plens_N = rng.integers(min_len, prompt_len + 1, size=n).astype(np.int32)
    prompts_NxP[np.arange(prompt_len)[None] >= plens_N[:, None]] = 0
    return prompts_NxP, plens_N


def static_bubble(limits_N: Int[np.ndarray, " N"], *, slots: int, max_new: int, buffer: int) -> float:
    """The static sampler's bubble, 1 - tokens / (Q x steps), averaged over its batches of Q
    (rollout/stats.py rollout_bubble: whole chunks of `buffer` steps)."""
    N = len(limits_N)
    return float(
        np.mean(
            [
                rollout_bubble(limits_N[i : i + slots], max_new, buffer)["rollout/bubble_slots"]
                for i in range(0, N, slots)
            ]
        )
    )


def compare(
    params,
    model_cfg: ModelConfig,
    prompts_NxP: Int[np.ndarray, "N P"],
    plens_N: Int[np.ndarray, " N"],
    limits_N: Int[np.ndarray, " N"],
    *,
    policy: str,
    slots: int,
    max_new: int,
    budget: int,
    buffer: int,
    window: int,
    segment_chunks: int,
    attn_impl: str = "auto",
    seed: int = 0,
) -> tuple[dict, dict[str, np.ndarray]]:
    """Both arms with a `policy` cache (budget + buffer, window), each run once to compile and
    once timed. Returns (row, lengths): the row's tokens/s (wall, with any compile time left in a
    timed run, from compile_clock, subtracted and its compilations counted: 0 expected), speedup,
    static bubble and the engine's slot-step and wall (SortedRL Eq. 4) bubbles, over the whole run
    and until the queue ran empty; lengths: each arm's tokens per request [N], in input order."""
    kv_cfg = kv.KVConfig(policy=policy, budget=budget, buffer=buffer, window=window)
    cfg = smp.SamplerConfig(max_new_tokens=max_new, kv=kv_cfg, attn_impl=attn_impl)
    Q, N = slots, len(limits_N)
    key = jax.random.key(seed)

    def static() -> list[jax.Array]:
        lengths = []
        for i in range(0, N, Q):
            rows = slice(i, min(i + Q, N))
            out = smp.generate_jit(
                params,
                model_cfg,
                jnp.asarray(prompts_NxP[rows]),
                jnp.asarray(plens_N[rows]),
                key,
                cfg,
                jnp.arange(i, rows.stop),
                jnp.asarray(limits_N[rows]),
            )
            jax.block_until_ready(out.tokens)
            lengths.append(out.lengths)
        return lengths

    eng = SlotEngine(model_cfg, cfg, Q, prompts_NxP.shape[1], segment_chunks=segment_chunks)

    def engine():
        return eng.run(params, key, prompts_NxP, plens_N, limits=limits_N)

    static(), engine()  # compile (every insert/harvest bucket the run meets)
    since, t0 = compile_clock.Since(), time.perf_counter()
    static_lengths = static()
    t_static = time.perf_counter() - t0 - since.seconds
    static_compiles = since.compiles
    eng.stats = type(eng.stats)()
    since, t0 = compile_clock.Since(), time.perf_counter()
    out = engine()
    t_engine = time.perf_counter() - t0 - since.seconds
    engine_compiles = since.compiles
    tokens = int(limits_N.sum())
    row = {
        "policy": policy,
        "tokens": tokens,
        "static_tokens_per_s": tokens / t_static,
        "engine_tokens_per_s": tokens / t_engine,
        "speedup": t_static / t_engine,
        "static_bubble": static_bubble(limits_N, slots=Q, max_new=max_new, buffer=buffer),
        "engine_bubble_slots": eng.stats.bubble_slots(),
        "engine_bubble_wall": eng.stats.bubble_wall(Q),
        "engine_bubble_slots_until_drain": eng.stats_at_drain.bubble_slots(),
        "engine_bubble_wall_until_drain": eng.stats_at_drain.bubble_wall(Q),
        "static_s": t_static,
        "engine_s": t_engine,
        "static_compiles": static_compiles,
        "engine_compiles": engine_compiles,
    }
    lengths = {"static": np.concatenate([np.asarray(x) for x in static_lengths]), "engine": np.asarray(out.lengths)}
    return row, lengths
