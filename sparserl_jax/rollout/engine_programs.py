"""The slot engine's device programs (rollout/engine.py dispatches them from the host and keeps
their state): the Q slots' state, a decode segment, an insert (prefill new requests and scatter
them into free slots) and a harvest copy. Each is a pure function of an EngineShape (the static
part: model, sampler config, slot count and widths), jitted once per engine by `jitted`: over
every slot (one device, or a mesh XLA partitions: the training layout), or per device on the
rollout layouts "data" and "tensor:N" (rollout/layout.py), each row group running its own slots
alone under shard_map, so the segment's decode loop moves nothing between devices but its scalar
stop test.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from sparserl_jax import kvcache as kv
from sparserl_jax.kernels.sharded import per_device
from sparserl_jax.model import sharding as shd
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


def segment(shape: EngineShape, params, state: SlotState, key, version, *, stop_axes: tuple[str, ...] = ()):
    """Up to segment_chunks x buffer decode steps with the weights of `version` (fewer once
    every slot is done); returns the state, the active slot-steps and the steps run. Token t
    is sampled from the stored logits, so it carries their version; the step then stores the
    logits `params` compute for the next token. `stop_axes`: the mesh axes this runs under
    shard_map over, each device group with its own slots (per_device): the loop then runs until
    every group's slots are done (its stop test, a scalar, is the loop's one collective) and the
    active slot-steps are summed over the groups, so both equal the one-device program's."""
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
        finished = jnp.all(c[1].done)
        if stop_axes:  # every group's slots, not only this one's
            finished = jax.lax.pmin(finished.astype(jnp.int32), stop_axes) > 0
        return (c[0] < shape.segment_chunks) & ~finished

    r, state, active = jax.lax.while_loop(going, chunk, (jnp.int32(0), state, jnp.int32(0)))
    if stop_axes:
        active = jax.lax.psum(active, stop_axes)
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


@dataclasses.dataclass(frozen=True)
class Programs:
    """The engine's jitted programs: segment(params, state, key, version) -> (state, active
    slot-steps, steps); insert(params, state, key, slots, prompts, lengths, request, t0, limit,
    prefix, version, *, resume) -> state; harvest(state, slots) -> the copy; release(state) ->
    state, every slot done. The state is donated to each but harvest."""

    segment: Callable
    insert: Callable
    harvest: Callable
    release: Callable


def state_shardings(shape: EngineShape, mesh: Mesh) -> SlotState:
    """Where the slot state lives on `mesh`: every leaf's slots split over data x fsdp, the KV
    cache's heads also over "tensor" (model/sharding.py cache_shardings). Every program returns
    its state there, so the next call compiles nothing again for another input layout."""
    abstract = jax.eval_shape(functools.partial(empty_state, shape))
    rows = NamedSharding(mesh, P(shd.BATCH))
    return jax.tree.map(lambda _: rows, abstract.replace(cache=None)).replace(
        cache=shd.cache_shardings(abstract.cache, mesh)
    )


def jitted(shape: EngineShape, mesh: Mesh | None = None, manual_axes: tuple[str, ...] = ()) -> Programs:
    """The programs jitted for `shape`: over every slot (no `manual_axes`: one device, or the
    mesh in shape.cfg.mesh, which XLA partitions), or per device on `mesh`, manual over
    `manual_axes` (rollout/layout.py RolloutMesh.manual_axes): the Q slots split over its
    data x fsdp into row groups, each running its own Q / groups slots alone under shard_map (a
    slot index is the group's own, Q / groups its padding slot; the engine lays out an insert's
    rows that way), its segment's stop test the one collective of the decode loop."""
    if not manual_axes:
        return Programs(
            jax.jit(functools.partial(segment, shape), donate_argnums=(1,)),
            jax.jit(functools.partial(insert, shape), donate_argnums=(1,), static_argnames=("resume",)),
            jax.jit(functools.partial(harvest, shape)),
            jax.jit(_release, donate_argnums=(0,)),
        )
    groups = math.prod(mesh.shape[a] for a in shd.BATCH)
    inner_mesh = None if set(manual_axes) == set(mesh.axis_names) else mesh  # tensor:N: XLA splits a group's step
    local = dataclasses.replace(shape, Q=shape.Q // groups, cfg=dataclasses.replace(shape.cfg, mesh=inner_mesh))
    rows, rep = P(shd.BATCH), P()

    def on_groups(fn, in_specs, out_specs):
        return per_device(fn, mesh, in_specs, out_specs, manual_axes)

    seg = on_groups(functools.partial(segment, local, stop_axes=shd.BATCH), (rep, rows, rep, rep), (rows, rep, rep))
    # params, state, key, then slots, prompts, lengths, request, t0, limit and prefix per row, version
    insert_specs = (rep, rows, rep, *(rows,) * 7, rep)
    inserts = {r: on_groups(functools.partial(insert, local, resume=r), insert_specs, rows) for r in (False, True)}

    def insert_rows(params, state, key, *args, resume: bool):
        return inserts[resume](params, state, key, *args)

    placed = state_shardings(shape, mesh)
    everywhere = NamedSharding(mesh, rep)
    return Programs(
        jax.jit(seg, donate_argnums=(1,), out_shardings=(placed, everywhere, everywhere)),
        jax.jit(insert_rows, donate_argnums=(1,), static_argnames=("resume",), out_shardings=placed),
        jax.jit(on_groups(functools.partial(harvest, local), (rows, rows), rows)),
        jax.jit(_release, donate_argnums=(0,), out_shardings=placed),
    )


def _release(state: SlotState) -> SlotState:
    return state.replace(done=jnp.ones_like(state.done))
