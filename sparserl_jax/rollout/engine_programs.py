"""The slot engine's device programs (rollout/engine.py dispatches them from the host and keeps
their state): the Q slots' state, a decode segment, an insert (prefill new requests and scatter
them into free slots) and a harvest copy. Each is a pure function of an EngineShape (the static
part: model, sampler config, slot count and widths) and jitted once per engine.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from sparserl_jax import kvcache as kv
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.model.precision import compute_params
from sparserl_jax.rollout.sampler import (
    SamplerConfig,
    decode_token,
    empty_records,
    prefill_requests,
    request_keys,
)


@struct.dataclass
class SlotState:
    """Everything of the Q slots that lives on the devices (every leaf has leading axis Q)."""

    cache: kv.KVCache
    logits: Float[Array, "Q V"]  # next-token logits of each slot
    logits_version: Int[Array, " Q"]  # policy version of the weights that computed them
    kept: Int[Array, " Q"]  # KV entries behind those logits
    prev: Int[Array, " Q"]  # last token (newline trigger)
    done: Bool[Array, " Q"]  # not decoding: free, or finished and not yet harvested
    n_comp: Int[Array, " Q"]
    t: Int[Array, " Q"]  # index of the next response token = tokens generated so far
    request: Int[Array, " Q"]  # request id (its random keys)
    limit: Int[Array, " Q"]  # forced response length (max_new_tokens when none)
    prompt_len: Int[Array, " Q"]
    tokens: Int[Array, "Q M"]
    logprobs: Float[Array, "Q M"]
    kept_tok: Int[Array, "Q M"]
    version: Int[Array, "Q M"]  # policy version whose logits each token was sampled from
    # the sampler's per-token records (sampler.token_records), when its config asks for them
    kept_ids: Int[Array, "Q M K"] | None = None
    top_ids: Int[Array, "Q M A"] | None = None
    top_logp: Float[Array, "Q M A"] | None = None


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """What the programs are built for: Q slots of prompts up to P tokens, M new tokens, C cache
    slots, segments of segment_chunks x kv.buffer steps, and the sampler's per-token records."""

    model_cfg: ModelConfig
    cfg: SamplerConfig
    Q: int
    P: int
    M: int
    C: int
    segment_chunks: int
    records: tuple[str, ...]


def empty_state(shape: EngineShape) -> SlotState:
    """Every slot free (done), its buffers zero: each leaf its own buffer (the programs donate it)."""
    Q, M, mc = shape.Q, shape.M, shape.model_cfg
    zeros = lambda: jnp.zeros((Q,), jnp.int32)
    return SlotState(
        cache=kv.cache_for(shape.cfg.kv, mc, Q, min(shape.P, shape.C), jnp.dtype(mc.dtype), capacity=shape.C),
        logits=jnp.zeros((Q, mc.vocab_size), jnp.float32),
        logits_version=zeros(),
        kept=zeros(),
        prev=zeros() - 1,
        done=jnp.ones((Q,), bool),
        n_comp=zeros(),
        t=zeros(),
        request=zeros(),
        limit=zeros() + M,
        prompt_len=zeros(),
        tokens=jnp.full((Q, M), shape.cfg.pad_token_id, jnp.int32),
        logprobs=jnp.zeros((Q, M), jnp.float32),
        kept_tok=jnp.zeros((Q, M), jnp.int32),
        version=jnp.zeros((Q, M), jnp.int32),
        **empty_records(shape.cfg, (Q, M)),
    )


def segment(shape: EngineShape, params, state: SlotState, key, version):
    """Up to segment_chunks x buffer decode steps with the weights of `version` (fewer once
    every slot is done); returns the state, the active slot-steps and the steps run. Token t
    is sampled from the stored logits, so it carries their version; the step then stores the
    logits `params` compute for the next token."""
    cfg, U, M, Q = shape.cfg, shape.cfg.kv.buffer, shape.M, shape.Q
    params = compute_params(params, shape.model_cfg)  # once, not in every decode step
    keys = request_keys(key, state.request)
    rows_Q = jnp.arange(Q)

    def step(c, _):
        st, active = c
        carry = (st.cache, st.logits, st.kept, st.prev, st.done, st.n_comp)
        carry, (token_Q, logp_Q, live_Q, kept_Q, rec_Q) = decode_token(
            params, shape.model_cfg, cfg, shape.C, keys, carry, st.t, interval=True, limit_B=st.limit
        )
        cache, logits, kept, prev, done, n_comp = carry
        col_Q = jnp.where(live_Q, st.t, M)  # M: out of range, dropped

        def put(buf, x):
            return buf.at[rows_Q, col_Q].set(x.astype(buf.dtype), mode="drop")

        st = st.replace(
            cache=cache,
            logits=logits,
            kept=kept,
            prev=prev,
            done=done,
            n_comp=n_comp,
            logits_version=jnp.where(live_Q, version, st.logits_version),
            t=st.t + live_Q,
            tokens=put(st.tokens, token_Q),
            logprobs=put(st.logprobs, logp_Q),
            kept_tok=put(st.kept_tok, kept_Q),
            version=put(st.version, st.logits_version),
            **{name: put(getattr(st, name), x) for name, x in rec_Q.items()},
        )
        return (st, active + jnp.sum(live_Q, dtype=jnp.int32)), None

    def chunk(c):
        r, st, active = c
        (st, active), _ = jax.lax.scan(step, (st, active), None, length=U)
        return r + 1, st, active

    def going(c):
        return (c[0] < shape.segment_chunks) & ~jnp.all(c[1].done)

    r, state, active = jax.lax.while_loop(going, chunk, (jnp.int32(0), state, jnp.int32(0)))
    return state, active, r * U


def insert(
    shape: EngineShape,
    params,
    state: SlotState,
    key,
    slots,
    prompts,
    lengths,
    request,
    t0,
    limit,
    prefix,
    version,
    *,
    resume: bool,
):
    """Prefill `prompts` (prompt, or prompt + partial response when `resume`) with the
    weights of `version` into a fresh cache and scatter every leaf into `slots` (index Q: a
    padding row, dropped). `prefix`: the rows' tokens so far and their records (resumed: the
    partial responses'; fresh: none, the records then start empty here)."""
    keys = request_keys(key, request)
    logits, cache, n_comp = prefill_requests(
        params, shape.model_cfg, prompts, lengths, keys.at(t0) if resume else keys, shape.cfg, shape.C
    )

    def put(dst, src):
        return dst.at[slots].set(src.astype(dst.dtype), mode="drop")

    tokens, logprobs, kept_tok, token_version, prev_n_comp, records = prefix
    n = prompts.shape[0]
    if not resume:
        records = empty_records(shape.cfg, (n, shape.M))
    prev = jnp.take_along_axis(tokens, jnp.maximum(t0 - 1, 0)[:, None], axis=1)[:, 0]
    return state.replace(
        cache=jax.tree.map(put, state.cache, cache),
        logits=put(state.logits, logits),
        logits_version=put(state.logits_version, jnp.broadcast_to(version, (n,))),
        kept=put(state.kept, lengths),
        prev=put(state.prev, jnp.where(t0 > 0, prev, -1)),
        done=put(state.done, jnp.zeros((n,), bool)),
        n_comp=put(state.n_comp, n_comp + prev_n_comp),
        t=put(state.t, t0),
        request=put(state.request, request),
        limit=put(state.limit, limit),
        prompt_len=put(state.prompt_len, lengths - t0),
        tokens=put(state.tokens, tokens),
        logprobs=put(state.logprobs, logprobs),
        kept_tok=put(state.kept_tok, kept_tok),
        version=put(state.version, token_version),
        **{name: put(getattr(state, name), x) for name, x in records.items()},
    )


def harvest(shape: EngineShape, state: SlotState, slots):
    """A copy of the responses in `slots`: request ids, tokens, log-probs, kept counts, versions,
    lengths, compressions, prompt lengths and the per-token records."""
    s = state
    records = {name: getattr(s, name)[slots] for name in shape.records}
    return (
        s.request[slots],
        s.tokens[slots],
        s.logprobs[slots],
        s.kept_tok[slots],
        s.version[slots],
        s.t[slots],
        s.n_comp[slots],
        s.prompt_len[slots],
        records,
    )
