"""The real model's response lengths at temperature 1.0, and the SortedRL slot engine against the
static batch sampler on that workload (docs/methods.md#sortedrl), side by side in one pinned
process.

Static: batches of Q prompts, each decoded until its longest response ends. Engine: Q slots
refilled as responses end (rollout/engine.py, FIFO). Both draw request r's tokens with the same
per-request keys, so they decode the same responses (the fraction that match is reported) and only the schedule differs.
Each is compiled first by a warm-up on the same prompts with short forced lengths (an engine
insert or harvest size the warm-up did not meet compiles inside the timed run, against the
engine); the timed calls alternate static, engine, `repeats` times, and the medians are reported.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.real import measure
from sparserl_jax.rollout.engine import SlotEngine
from sparserl_jax.rollout.sampler import generate_jit
from sparserl_jax.rollout.stats import rollout_bubble


def _static(params, model_cfg, ids, lengths, cfg, key, Q, limits):
    outs = []
    for i in range(0, len(ids), Q):
        out = generate_jit(
            params,
            model_cfg,
            jnp.asarray(ids[i : i + Q]),
            jnp.asarray(lengths[i : i + Q]),
            key,
            cfg,
            jnp.arange(i, i + Q, dtype=jnp.int32),
            jnp.asarray(limits[i : i + Q]),
        )
        outs.append(jax.device_get(out))
    return outs


def lengths_arm(arm: measure.Arm, slots: int = 16, segment_chunks: int = 2, repeats: int = 1) -> dict:
    """Dense rollouts of every prompt by the static sampler and by the slot engine (Q = slots)."""
    N, Q, M = arm.prompts, slots, arm.max_new
    if N % Q:
        raise ValueError(f"--prompts={N} must be a multiple of --slots={Q} (whole static batches)")
    model_cfg, params, tok, ids, lengths = measure.load(arm)
    cfg = measure.sampler_config(arm, tok)
    key = jax.random.key(arm.seed)
    engine = SlotEngine(model_cfg, cfg, Q, ids.shape[1], segment_chunks=segment_chunks)
    full = np.full((N,), M, np.int32)
    warm = np.random.default_rng(0).integers(1, 3 * arm.buffer + 1, size=N).astype(np.int32)
    _static(params, model_cfg, ids, lengths, cfg, key, Q, warm)
    engine.run(params, key, ids, lengths, limits=warm)
    static_s, engine_s, stats = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = _static(params, model_cfg, ids, lengths, cfg, key, Q, full)
        static_s.append(time.perf_counter() - t0)
        engine.stats = type(engine.stats)()
        t0 = time.perf_counter()
        fin = engine.run(params, key, ids, lengths, limits=full)
        engine_s.append(time.perf_counter() - t0)
        stats.append((engine.stats, engine.stats_at_drain))
    lens = np.concatenate([np.asarray(o.lengths) for o in outs])
    toks = np.concatenate([np.asarray(o.tokens) for o in outs])
    valid = np.arange(M)[None] < lens[:, None]
    same = (fin.lengths == lens) & np.all(np.where(valid, fin.tokens == toks, True), axis=1)
    n_tok = int(lens.sum())
    t_static, t_engine = statistics.median(static_s), statistics.median(engine_s)
    st, drain = stats[-1]
    static_bubble = float(
        np.mean([rollout_bubble(lens[i : i + Q], M, arm.buffer)["rollout/bubble_slots"] for i in range(0, N, Q)])
    )
    return {
        "arm": dataclasses.asdict(arm),
        "slots": Q,
        "segment_chunks": segment_chunks,
        "repeats": repeats,
        "lengths": [int(x) for x in lens],
        "tokens": n_tok,
        "same_responses": float(np.mean(same)),
        "static_s": static_s,
        "engine_s": engine_s,
        "static_tokens_per_s": n_tok / t_static,
        "engine_tokens_per_s": n_tok / t_engine,
        "engine_over_static": t_static / t_engine,
        "static_bubble": static_bubble,
        "engine_bubble_slots": st.bubble_slots(),
        "engine_bubble_wall": st.bubble_wall(Q),
        "engine_bubble_slots_until_drain": drain.bubble_slots() if drain else float("nan"),
        "engine_bubble_wall_until_drain": drain.bubble_wall(Q) if drain else float("nan"),
    }
