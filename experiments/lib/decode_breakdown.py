"""The decode step's time by piece, beside the whole step (experiments/lib/decode_bench.py
--breakdown). The whole step is the sampler's own loop (a benchmark row: wall time / new tokens);
each piece it runs every step is timed alone at the row's shapes, in one jitted loop of STEPS
steps (compiled apart; the median of the calls, at least --repeats and --min-seconds in all):

  lm_head      the final norm and the logits over the vocabulary, [B, D] x [D, V], float32 out
  sampling     log-softmax of the [B, V] float32 logits and one draw per row with its own key
               (rollout/sampling.py processed_logprobs + sample, as the sampler calls them, by
               the row's draw: rollout.draw)
  candidates   the agreement's top-k over [B, V] (rollout/sampling.py top_candidates), in a row
               that records them (agreement_k > 0)
  attention    decode attention over the cache in every layer (kernels.decode_attention at the
               row's capacity; fill: its mean over the generation, budget + buffer / 2 sparse,
               prompt + new tokens / 2 dense)
  compression  the eviction policy's compression of a full cache (its score, the top B kept, the
               gather: kvcache.compress), which runs once every kv.buffer steps: its time / buffer
  rest         the whole step less the pieces: the layers' projections, MLP, norms and RoPE, the
               cache writes, the policy's per-step observers, the loop itself

A piece alone runs without the fusion and the overlap it has inside the loop, and each carries its
output into its next input (a 1e-30 nudge, plus a max over [B, V] for the head) so that no step
is hoisted out of the loop; the rest absorbs the difference either way, so read it as what the
pieces leave, not as a measurement. The vocabulary's pieces (lm_head, sampling, candidates) cost
per row of [B, V]: their ms do not depend on the model's layers, only the head's on D.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from sparserl_jax import kernels
from sparserl_jax import kvcache as kv
from sparserl_jax.model import transformer
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.model.layers import rms_norm
from sparserl_jax.model.precision import compute_params
from sparserl_jax.rollout.sampling import SamplingConfig, processed_logprobs, sample, top_candidates

STEPS = 32  # steps per timed call of a piece
TINY = 1e-30  # carries a step's output into the next step's input without changing it
PIECES = ("lm_head", "sampling", "candidates", "attention", "compression")


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What a piece is timed at: one benchmark row's model, batch, cache and records."""

    model: ModelConfig
    batch: int
    capacity: int  # the cache's slots C
    mean_fill: int  # the filled slots attention reads, on average over the generation
    kv: kv.KVConfig
    agreement_k: int
    agreement_topk: str
    attn_impl: str
    draw: str = "gumbel"  # rollout/sampling.py DRAWS


def mean_fill(kv_cfg: kv.KVConfig, prompt_len: int, new_tokens: int, capacity: int) -> int:
    """The cache's fill averaged over a generation: dense grows from the prompt to the end; a
    sparse cache cycles between budget and budget + buffer."""
    if kv_cfg.is_dense:
        return min(capacity, prompt_len + new_tokens // 2)
    return min(capacity, kv_cfg.budget + kv_cfg.buffer // 2)


def _seconds(compiled: Callable, args: tuple, repeats: int, min_seconds: float) -> float:
    """Median seconds of a call of compiled(*args), run once first to warm."""
    jax.block_until_ready(compiled(*args))
    seconds: list[float] = []
    while len(seconds) < max(repeats, 1) or sum(seconds) < min_seconds:
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def _loop(step: Callable) -> Callable:
    """fn(carry, *inputs): `step(i, carry, *inputs) -> carry` STEPS times."""

    def run(carry, *inputs):
        return jax.lax.fori_loop(0, STEPS, lambda i, c: step(i, c, *inputs), carry)

    return run


def _rows(batch: int):
    return jnp.arange(batch)


def lm_head(s: Shapes, params, key) -> tuple[Callable, tuple]:
    m = s.model

    def step(i, h_BxD, params):
        logits_BxV = transformer.logits_from_hidden(params, rms_norm(h_BxD, params["final_norm"], m.norm_eps))
        return h_BxD + (TINY * jnp.max(logits_BxV, axis=-1, keepdims=True)).astype(h_BxD.dtype)

    h_BxD = jax.random.normal(key, (s.batch, m.d_model), jnp.dtype(m.dtype))
    return _loop(step), (h_BxD, compute_params(params, m))


def sampling(s: Shapes, params, key) -> tuple[Callable, tuple]:
    cfg = SamplingConfig(draw=s.draw)  # temperature 1, no filters: the training rollouts' distribution
    rows = _rows(s.batch)

    def step(i, logits_BxV, keys_B):
        keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_B, i)
        logp_BxV = processed_logprobs(logits_BxV, cfg)
        token_B, logp_B = sample(logits_BxV, keys_B, cfg, logp_BxV)
        return logits_BxV.at[rows, token_B].add(TINY * logp_B)

    k_logits, k_rows = jax.random.split(key)
    logits_BxV = 3.0 * jax.random.normal(k_logits, (s.batch, s.model.vocab_size), jnp.float32)
    return _loop(step), (logits_BxV, jax.random.split(k_rows, s.batch))


def candidates(s: Shapes, params, key) -> tuple[Callable, tuple]:
    rows = _rows(s.batch)

    def step(i, logp_BxV):
        # every candidate feeds the carry, as the sampler records them all: XLA rewrites a top-k
        # whose whole [B, k] is read into its TopK kernel; read one column and it keeps the full
        # sort over [B, V] (tests/test_decode_breakdown.py checks the loop holds no such sort)
        vals_BxK, ids_BxK = top_candidates(logp_BxV, s.agreement_k, s.agreement_topk)
        nudge_B = TINY * (vals_BxK.sum(axis=-1) + ids_BxK.sum(axis=-1).astype(jnp.float32))
        return logp_BxV.at[rows, ids_BxK[:, 0]].add(nudge_B)

    logp_BxV = jax.nn.log_softmax(3.0 * jax.random.normal(key, (s.batch, s.model.vocab_size), jnp.float32))
    return _loop(step), (logp_BxV,)


def attention(s: Shapes, params, key) -> tuple[Callable, tuple]:
    m = s.model
    dtype = jnp.dtype(m.dtype)

    def step(i, q_BxNxH, k_L, v_L, fill_B):
        for k_BxKxCxH, v_BxKxCxH in zip(k_L, v_L, strict=True):
            o_BxNxH, _ = kernels.decode_attention(q_BxNxH, k_BxKxCxH, v_BxKxCxH, fill_B, impl=s.attn_impl)
            q_BxNxH = q_BxNxH + (TINY * o_BxNxH).astype(dtype)
        return q_BxNxH

    keys = jax.random.split(key, 2 * m.n_layers + 1)
    shape = (s.batch, m.n_kv_heads, s.capacity, m.head_dim)
    k_L = tuple(jax.random.normal(k, shape, dtype) for k in keys[1 : 1 + m.n_layers])
    v_L = tuple(jax.random.normal(k, shape, dtype) for k in keys[1 + m.n_layers :])
    q_BxNxH = jax.random.normal(keys[0], (s.batch, m.n_heads, m.head_dim), dtype)
    fill_B = jnp.full((s.batch,), s.mean_fill, jnp.int32)
    return _loop(step), (q_BxNxH, k_L, v_L, fill_B)


def full_cache(s: Shapes, key) -> kv.KVCache:
    """A cache of random keys, values and policy state (H2O's mass, the window's queries) with
    every slot filled, a compression's input: C slots at positions 0 .. C - 1, C tokens seen."""
    cache = kv.cache_for(s.kv, s.model, s.batch, 1, jnp.dtype(s.model.dtype), capacity=s.capacity)
    draw = iter(jax.random.split(key, 4 * s.model.n_layers))

    def fresh(xs: tuple | None, positive: bool = False) -> tuple | None:
        if xs is None:
            return None
        ys = (jax.random.normal(next(draw), x.shape, x.dtype) for x in xs)
        return tuple(jnp.abs(y) if positive else y for y in ys)

    pos_C = jnp.arange(s.capacity, dtype=jnp.int32)
    full_B = jnp.full((s.batch,), s.capacity, jnp.int32)
    return cache.replace(
        k=fresh(cache.k),
        v=fresh(cache.v),
        pos=tuple(jnp.broadcast_to(pos_C, x.shape) for x in cache.pos),
        fill=full_B,
        length=full_B,
        mass=fresh(cache.mass, positive=True),
        window_q=fresh(cache.window_q),
    )


def compression(s: Shapes, params, key) -> tuple[Callable, tuple]:
    def step(i, cache, key):
        return kv.compress(s.kv, cache, jax.random.fold_in(key, i)).replace(fill=cache.fill)

    k_cache, k_evict = jax.random.split(key)
    return _loop(step), (full_cache(s, k_cache), k_evict)


BUILDERS: dict[str, Callable] = {
    "lm_head": lm_head,
    "sampling": sampling,
    "candidates": candidates,
    "attention": attention,
    "compression": compression,
}


def pieces_of(s: Shapes) -> tuple[str, ...]:
    """The pieces a row's step runs: candidates only with agreement_k, compression only sparse."""
    return tuple(
        p for p in PIECES if (p != "candidates" or s.agreement_k) and (p != "compression" or not s.kv.is_dense)
    )


def piece_key(name: str, s: Shapes) -> tuple:
    """What a piece's time depends on: rows that share it (e.g. with and without candidates)
    share one timing."""
    m = s.model
    return {
        "lm_head": (name, m, s.batch),
        "sampling": (name, s.batch, m.vocab_size, s.draw),
        "candidates": (name, s.batch, m.vocab_size, s.agreement_k, s.agreement_topk),
        "attention": (name, m, s.batch, s.capacity, s.mean_fill, s.attn_impl),
        "compression": (name, m, s.batch, s.capacity, s.kv),
    }[name]


def compile_piece(name: str, s: Shapes, params, seed: int = 0) -> tuple[Callable, tuple]:
    """One piece's loop of STEPS steps at shapes `s`, compiled, and its inputs."""
    fn, args = BUILDERS[name](s, params, jax.random.key(seed))
    return jax.jit(fn).lower(*args).compile(), args


def piece_ms(name: str, s: Shapes, params, *, repeats: int, min_seconds: float, seed: int = 0, compiled=None) -> float:
    """Milliseconds per decode step of one piece at shapes `s` (compression: per compression /
    kv.buffer, the steps between two); `compiled`: compile_piece's, when the caller has it."""
    program, args = compiled or compile_piece(name, s, params, seed)
    ms = _seconds(program, args, repeats, min_seconds) / STEPS * 1e3
    return ms / s.kv.buffer if name == "compression" else ms


def breakdown(step_ms: float, pieces: dict[str, float]) -> dict[str, float]:
    """The pieces' ms per step, the rest (the whole step less them) and each one's share of it."""
    out = dict(pieces)
    out["rest"] = step_ms - sum(pieces.values())
    out.update({f"{name}_share": ms / step_ms for name, ms in list(out.items())})
    return out
