"""The rollout sampler: prefill, then decode inside a jitted scan over a fixed-slot KV cache.

Decoding runs in chunks of `kv.buffer` steps (a lax.scan) inside a lax.while_loop that stops once
every sequence has finished. A sparse policy compresses the cache between chunks ("interval"
trigger: the buffer is full every `buffer` steps) or before a step whose previous token is a line
break ("newline" trigger, with a forced compression when the cache is full). With
kv.compress_prompt=false (the authors') the first interval compression comes after `buffer`
decode steps, so a prompt longer than the budget is attended whole until then (the cache has
max(budget, prompt) + buffer slots); with true it is squeezed into the budget before decoding.

Timing: a compression here runs before the step that writes the next token, on the entries seen
so far (the window queries are those of the last w cached tokens). The authors' fork
(radix_attention.py RadixAttention.forward) writes the current token first and compresses with
it in the window, so their step attends to `budget` entries where ours attends to budget + 1;
the kept sets are otherwise chosen by the same rule, one token earlier. The dense sampler is
the same loop with capacity = prompt + max new tokens and no compression, so with a budget that
covers the whole sequence the two produce identical tokens and log-probs for the same key.

Randomness is per request, not per batch row: request r's sampling and eviction keys are
fold_in(key, r) split in three (`request_keys`), and the draw for its response token t (or the
compression that runs before token t) folds in t. A response therefore depends only on its own
prompt, request id and the run key: not on its batch neighbours, its row, the call that sampled
it (rollout.rows_per_call) or, in the slot engine, on the slot and segment it ran in.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from sparserl_jax import kvcache as kv
from sparserl_jax.kernels import IMPLS as ATTN_IMPLS
from sparserl_jax.model import transformer
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.model.precision import compute_params
from sparserl_jax.rollout.sampling import (
    TOPK_METHODS,
    SamplingConfig,
    kept_width,
    processed_logprobs,
    sample,
    sample_kept,
    top_candidates,
)
from sparserl_jax.validate import check_at_least, check_bool, check_in

PLATFORMS = ("cpu", "gpu", "tpu")  # sampler.attn_platform: what the attention kernel is built for


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    max_new_tokens: int = 256
    sampling: SamplingConfig = SamplingConfig()
    kv: kv.KVConfig = kv.KVConfig()
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    attn_impl: str = "auto"
    # The platform the attention kernel is built for (None: where the arrays live); set it to
    # lower a program for a platform this machine lacks (tests/test_lowering.py).
    attn_platform: str | None = None
    # The mesh the batch is sharded on: decode attention runs per device under shard_map on it
    # (None: no shard_map; with a sharded cache XLA would then gather it before a Pallas call).
    mesh: Mesh | None = None
    record_kept: bool = False  # keep each chunk's kept positions (for masked recompute checks)
    # Sample from and record each token's kept set (sampling.top_k candidates, ties at the k-th
    # included, after top-p) for the learner to renormalise over: training with top-p / top-k
    # (rollout/sampling.py sample_kept).
    replay_filters: bool = False
    # Record each token's `agreement_k` most probable tokens and their log-probs under the sampled
    # distribution, for the learner's sparse-dense agreement (rl/diagnostics.py agreement); 0: none.
    agreement_k: int = 0
    # How they are found (rollout/sampling.py top_candidates): "exact", "approx" (TPU's fast
    # approximate top-k) or "auto" (approx where the program is built for TPU, else exact).
    agreement_topk: str = "auto"
    # Record, per row, the fraction of each prompt position's (layer, KV head) entries the cache
    # still holds when the row ends: how much of the question the eviction took (rollout/question.py).
    record_prompt_kept: bool = False

    def __post_init__(self):
        check_at_least("sampler.max_new_tokens", self.max_new_tokens, 1)
        if not isinstance(self.sampling, SamplingConfig):
            raise ValueError(f"sampler.sampling={self.sampling!r}: expected a SamplingConfig")
        if not isinstance(self.kv, kv.KVConfig):
            raise ValueError(f"sampler.kv={self.kv!r}: expected a KVConfig")
        try:  # a tuple keeps the config hashable (a static argument of the jitted sampler)
            eos = tuple(int(t) for t in self.eos_token_ids)
        except (TypeError, ValueError):
            raise ValueError(f"sampler.eos_token_ids={self.eos_token_ids!r} must be a list of token ids") from None
        object.__setattr__(self, "eos_token_ids", eos)
        check_at_least("sampler.pad_token_id", self.pad_token_id, 0)
        check_in("sampler.attn_impl", self.attn_impl, ATTN_IMPLS)
        check_in("sampler.attn_platform", self.attn_platform, (None, *PLATFORMS))
        check_bool("sampler.record_kept", self.record_kept)
        if self.record_kept and self.kv.trigger != "interval":
            raise ValueError("sampler.record_kept needs kv.trigger='interval'")
        check_bool("sampler.replay_filters", self.replay_filters)
        check_at_least("sampler.agreement_k", self.agreement_k, 0)
        check_in("sampler.agreement_topk", self.agreement_topk, TOPK_METHODS)
        check_bool("sampler.record_prompt_kept", self.record_prompt_kept)
        if self.replay_filters and (self.sampling.top_k < 1 or self.sampling.temperature == 0):
            raise ValueError(
                "sampler.replay_filters records each token's kept set: it needs sampling.top_k >= 1 (the "
                f"set's size) and a temperature > 0, got top_k={self.sampling.top_k}, "
                f"temperature={self.sampling.temperature}"
            )


@struct.dataclass
class Rollout:
    tokens: Int[Array, "B M"]  # generated tokens, pad after the end
    logprobs: Float[Array, "B M"]  # log-prob of each token under the sampled distribution
    mask: Bool[Array, "B M"]  # True for generated tokens (EOS included)
    lengths: Int[Array, " B"]  # generated tokens per sequence
    kept: Int[Array, "B M"]  # KV entries (per layer and head) behind the logits of each token
    n_compressions: Int[Array, " B"]
    evicted_fraction: Float[Array, " B"]  # 1 - kept / seen at the last generated token
    kept_positions: Int[Array, "R L B K C"] | None = None  # per chunk, when record_kept
    # each token's kept set (ids, -1 padded; -1 after the end), when replay_filters
    kept_ids: Int[Array, "B M K"] | None = None
    # each token's agreement_k most probable tokens (ids, -1 where filtered out or after the end)
    # and their log-probs under the sampled distribution, when agreement_k
    top_ids: Int[Array, "B M A"] | None = None
    top_logp: Float[Array, "B M A"] | None = None
    # per position of the [B, P] prompt batch, the fraction of its (layer, KV head) entries held
    # at the row's end (finished rows are not compressed again), when record_prompt_kept; past a
    # row's prompt length the positions are its response's first tokens
    prompt_kept: Float[Array, "B P"] | None = None


class TokenRecord(NamedTuple):
    """A per-token record beside a token and its log-prob: its trailing width, dtype and the value
    where there is none (after the end, padding)."""

    width: int
    dtype: jnp.dtype
    fill: int | float


def token_records(cfg: SamplerConfig) -> dict[str, TokenRecord]:
    """The per-token records cfg asks for, by their Rollout field: `kept_ids`
    [kept_width(top_k) = top_k + TIE_SLOTS] with replay_filters (4 bytes an id), `top_ids` and
    `top_logp` [agreement_k] with agreement_k (8 * agreement_k bytes a token)."""
    records = {}
    if cfg.replay_filters:
        records["kept_ids"] = TokenRecord(kept_width(cfg.sampling.top_k), jnp.int32, -1)
    if cfg.agreement_k:
        records["top_ids"] = TokenRecord(cfg.agreement_k, jnp.int32, -1)
        records["top_logp"] = TokenRecord(cfg.agreement_k, jnp.float32, 0.0)
    return records


def empty_records(cfg: SamplerConfig, shape: tuple[int, ...], xp=jnp) -> dict:
    """Every record of cfg for `shape` tokens ([B, M]: arrays [B, M, width]), filled with its
    no-value; `xp`: jax.numpy (device) or numpy (host)."""
    return {name: xp.full((*shape, r.width), r.fill, r.dtype) for name, r in token_records(cfg).items()}


def cache_capacity(kv_cfg: kv.KVConfig, prompt_len: int, max_new_tokens: int) -> int:
    """Slots of the cache the sampler decodes with (dense: the whole sequence, rounded to chunks)."""
    if kv_cfg.is_dense:
        n_chunks = -(-max_new_tokens // kv_cfg.buffer)
        return prompt_len + n_chunks * kv_cfg.buffer
    return kv_cfg.capacity(prompt_len)


@struct.dataclass
class RequestKeys:
    """Each request's own keys ([B] key arrays); the draw for token t folds t into them."""

    sample: jax.Array
    evict: jax.Array
    prompt: jax.Array

    def at(self, t) -> RequestKeys:
        """The keys for response token t (t: a scalar or a [B] array)."""
        fold = jax.vmap(jax.random.fold_in, in_axes=(0, 0 if jnp.ndim(t) else None))
        return RequestKeys(*(fold(k, t) for k in (self.sample, self.evict, self.prompt)))


def request_keys(key: jax.Array, request_ids: Int[Array, " B"]) -> RequestKeys:
    """Request r's keys: fold_in(key, r) split into sampling, eviction and prompt-compression keys."""
    split = jax.vmap(lambda r: jax.random.split(jax.random.fold_in(key, r), 3))(request_ids)
    return RequestKeys(split[:, 0], split[:, 1], split[:, 2])


def maybe_compress(kv_cfg: kv.KVConfig, cache: kv.KVCache, active_B, key):
    """Compress the sequences in active_B that exceed the budget (a no-op when none does);
    returns the cache and which rows were compressed (int32 [B])."""
    did_B = active_B & (cache.fill > kv_cfg.budget_at(cache.length))
    cache = jax.lax.cond(jnp.any(did_B), lambda c: kv.compress(kv_cfg, c, key, active=did_B), lambda c: c, cache)
    return cache, did_B.astype(jnp.int32)


def prefill_requests(
    params: transformer.Params,
    model_cfg: ModelConfig,
    prompts: Int[Array, "B W"],
    prompt_lengths: Int[Array, " B"],
    keys: RequestKeys,
    cfg: SamplerConfig,
    capacity: int,
):
    """Prefill right-padded prompts into a fresh cache of `capacity` slots; a prompt longer than
    that (kv.compress_prompt, or a resumed prompt + partial response) is first squeezed into the
    budget. Returns (logits [B, V], cache, compressions [B])."""
    B, W = prompts.shape
    kv_cfg = cfg.kv
    cache = kv.cache_for(kv_cfg, model_cfg, B, W, jnp.dtype(model_cfg.dtype), capacity=max(capacity, W))
    logits, cache = transformer.prefill(
        params, model_cfg, prompts, prompt_lengths, cache, observe_prefill=kv.observe_prefill(kv_cfg), mesh=cfg.mesh
    )
    n_comp_B = jnp.zeros((B,), jnp.int32)
    if W > capacity:
        n_comp_B = (cache.fill > kv_cfg.budget_at(cache.length)).astype(jnp.int32)
        cache = kv.resize(kv.compress(kv_cfg, cache, keys.prompt), capacity)
    return logits, cache, n_comp_B


def decode_token(
    params: transformer.Params,
    model_cfg: ModelConfig,
    cfg: SamplerConfig,
    capacity: int,
    keys: RequestKeys,
    carry: tuple,
    t,
    *,
    interval: bool,
    limit_B=None,
):
    """One decode step, shared by the static sampler and the slot engine: (newline-trigger
    compression,) (interval-trigger compression when `interval`: rows whose token index t is a
    multiple of kv.buffer,) sample response token t of every live row with its request keys at
    t, and feed it through the model. t is a scalar or a [B] array (each slot its own index);
    `limit_B` optionally ends a row after limit_B tokens (forced lengths). carry = (cache, logits,
    kept_B, prev_B, done_B, n_comp_B); returns (carry, (token_B, logp_B, live_B, kept_B,
    records)), records the token_records of cfg ({name: [B, width]}, the no-value where not live):
    its kept set with cfg.replay_filters, its top candidates' ids and log-probs with
    cfg.agreement_k."""
    cache, logits, kept_B, prev_B, done_B, n_comp_B = carry
    kv_cfg = cfg.kv
    at = keys.at(t)
    if not kv_cfg.is_dense and kv_cfg.trigger == "newline":
        need_B = (jnp.isin(prev_B, _ids(kv_cfg.newline_token_ids)) & ~done_B) | (cache.fill >= capacity)
        cache, did_B = maybe_compress(kv_cfg, cache, need_B, at.evict)
        n_comp_B = n_comp_B + did_B * ~done_B
    if interval and not kv_cfg.is_dense and kv_cfg.trigger == "interval":
        need_B = ~done_B & (t % kv_cfg.buffer == 0)
        if not kv_cfg.compress_prompt:  # the prompt stays whole until step `buffer`
            need_B = need_B & (t > 0)
        cache, did_B = maybe_compress(kv_cfg, cache, need_B, at.evict)
        n_comp_B = n_comp_B + did_B
    token_B, logp_B, rec = _draw(logits, at.sample, cfg)
    live_B = ~done_B
    token_B = jnp.where(live_B, token_B, cfg.pad_token_id)
    logp_B = jnp.where(live_B, logp_B, 0.0)
    done_B = done_B | jnp.isin(token_B, _ids(cfg.eos_token_ids)) | (t + 1 >= cfg.max_new_tokens)
    if limit_B is not None:
        done_B = done_B | (t + 1 >= limit_B)
    logits, cache = transformer.decode_step(
        params,
        model_cfg,
        cache,
        token_B,
        attn_impl=cfg.attn_impl,
        observe=kv.observe_decode(kv_cfg),
        attn_platform=cfg.attn_platform,
        mesh=cfg.mesh,
    )
    records = token_records(cfg)
    rec = {name: jnp.where(live_B[:, None], x, records[name].fill) for name, x in rec.items()}
    return (cache, logits, cache.fill, token_B, done_B, n_comp_B), (token_B, logp_B, live_B, kept_B, rec)


def _draw(logits: Float[Array, "B V"], key: jax.Array, cfg: SamplerConfig):
    """Sample a token per row from the processed distribution, computed once for the draw and the
    recorded top candidates alike; returns (token_B, logp_B, {record name: [B, width]})."""
    proc_BxV = processed_logprobs(logits, cfg.sampling) if cfg.agreement_k else None
    rec = {}
    if cfg.replay_filters:
        token_B, logp_B, rec["kept_ids"] = sample_kept(logits, key, cfg.sampling, proc_BxV)
    else:
        token_B, logp_B = sample(logits, key, cfg.sampling, proc_BxV)
    if cfg.agreement_k:  # the sampled distribution's top candidates
        rec["top_logp"], rec["top_ids"] = top_candidates(
            proc_BxV, cfg.agreement_k, cfg.agreement_topk, cfg.attn_platform
        )
    return token_B, logp_B, rec


def _ids(ids: tuple[int, ...]):
    return jnp.asarray(ids or (-1,), jnp.int32)


def check_batch(prompts, prompt_lengths, request_ids=None, max_lengths=None) -> None:
    """The sampler's batch by shape and dtype (values are traced under jit): [B, P] integer
    prompts with P >= 1, and [B] integer prompt lengths, request ids and length limits."""
    if jnp.ndim(prompts) != 2 or not jnp.issubdtype(jnp.result_type(prompts), jnp.integer) or not prompts.shape[1]:
        raise ValueError(
            f"prompts: expected [B, P] token ids (integers, P >= 1), got shape "
            f"{jnp.shape(prompts)} of {jnp.result_type(prompts)}"
        )
    B = prompts.shape[0]
    for name, x in (("prompt_lengths", prompt_lengths), ("request_ids", request_ids), ("max_lengths", max_lengths)):
        if x is not None and (jnp.shape(x) != (B,) or not jnp.issubdtype(jnp.result_type(x), jnp.integer)):
            raise ValueError(
                f"{name}: expected [B] = [{B}] integers (one per prompt row), got shape "
                f"{jnp.shape(x)} of {jnp.result_type(x)}"
            )


def generate(
    params: transformer.Params,
    model_cfg: ModelConfig,
    prompts: Int[Array, "B P"],
    prompt_lengths: Int[Array, " B"],
    key: jax.Array,
    cfg: SamplerConfig,
    request_ids: Int[Array, " B"] | None = None,
    max_lengths: Int[Array, " B"] | None = None,
    *,
    stop_axes: tuple[str, ...] = (),
) -> Rollout:
    """Sample up to cfg.max_new_tokens after each right-padded prompt; row b is request
    request_ids[b] (default: b) for its random keys, and stops after max_lengths[b] tokens when
    given (forced lengths, for benchmarks). Jit with static configs:
    `jax.jit(generate, static_argnames=("model_cfg", "cfg"))`. `stop_axes`: the mesh axes this
    call runs under shard_map over, each device with its own rows (rollout/on_mesh.py
    generate_per_device): the loop then stops once every row of every device has finished (its
    stop test, a scalar, is the decode loop's one collective), so each output is the one-device
    program's."""
    check_batch(prompts, prompt_lengths, request_ids, max_lengths)
    params = compute_params(params, model_cfg)  # once, not in every decode step (model/precision.py)
    B, P = prompts.shape
    M = cfg.max_new_tokens
    kv_cfg = cfg.kv
    U = kv_cfg.buffer
    n_chunks = -(-M // U)
    C = cache_capacity(kv_cfg, P, M)
    if request_ids is None:
        request_ids = jnp.arange(B, dtype=jnp.int32)
    keys = request_keys(key, request_ids)
    logits, cache, n_comp_B = prefill_requests(params, model_cfg, prompts, prompt_lengths, keys, cfg, C)

    def step(carry, i):
        return decode_token(params, model_cfg, cfg, C, keys, carry, i, interval=False, limit_B=max_lengths)

    def chunk(state):
        r, carry, outs, kept_pos = state
        cache, logits, kept_B, prev_B, done_B, n_comp_B = carry
        if not kv_cfg.is_dense and kv_cfg.trigger == "interval":
            active_B = ~done_B
            if not kv_cfg.compress_prompt:  # the prompt stays whole until step `buffer`
                active_B = active_B & (r > 0)
            cache, did_B = maybe_compress(kv_cfg, cache, active_B, keys.at(r * U).evict)
            n_comp_B = n_comp_B + did_B
        if kept_pos is not None:
            kept_pos = kept_pos.at[r].set(jnp.stack(kv.kept_positions(cache)))
        carry = (cache, logits, kept_B, prev_B, done_B, n_comp_B)
        carry, ys = jax.lax.scan(step, carry, r * U + jnp.arange(U))
        outs = jax.tree.map(
            lambda o, y: jax.lax.dynamic_update_slice_in_dim(o, jnp.moveaxis(y, 0, 1), r * U, axis=1), outs, ys
        )
        return r + 1, carry, outs, kept_pos

    def not_finished(state):
        r, carry = state[0], state[1]
        finished = jnp.all(carry[4])
        if stop_axes:  # every device's rows, not only this one's
            finished = jax.lax.pmin(finished.astype(jnp.int32), stop_axes) > 0
        return (r < n_chunks) & ~finished

    outs = empty_outputs(cfg, B, n_chunks * U)
    kept_pos = None
    if cfg.record_kept:
        K = model_cfg.n_kv_heads
        kept_pos = jnp.full((n_chunks, model_cfg.n_layers, B, K, C), -1, jnp.int32)
    kept_B = prompt_lengths.astype(jnp.int32)  # the prefill logits saw the whole prompt
    zeros_B = jnp.zeros((B,), jnp.int32)
    carry = (cache, logits, kept_B, zeros_B - 1, jnp.zeros((B,), bool), n_comp_B)
    _, carry, outs, kept_pos = jax.lax.while_loop(not_finished, chunk, (jnp.int32(0), carry, outs, kept_pos))
    tokens, logprobs, mask, kept, records = jax.tree.map(lambda o: o[:, :M], outs)
    lengths = jnp.sum(mask, axis=1).astype(jnp.int32)
    return Rollout(
        tokens=tokens,
        logprobs=logprobs,
        mask=mask,
        lengths=lengths,
        kept=kept,
        n_compressions=carry[5],
        evicted_fraction=evicted_fraction(kept, lengths, prompt_lengths),
        kept_positions=kept_pos,
        prompt_kept=kv.position_kept(carry[0], P) if cfg.record_prompt_kept else None,
        **records,
    )


def empty_outputs(cfg: SamplerConfig, B: int, width: int) -> tuple:
    """The decode loop's per-token outputs before the first chunk: tokens (pad), log-probs, mask,
    kept entries and cfg's token records, each [B, width]."""
    return (
        jnp.full((B, width), cfg.pad_token_id, jnp.int32),
        jnp.zeros((B, width), jnp.float32),
        jnp.zeros((B, width), bool),
        jnp.zeros((B, width), jnp.int32),
        empty_records(cfg, (B, width)),
    )


def evicted_fraction(kept: Int[Array, "B M"], lengths: Int[Array, " B"], prompt_lengths: Int[Array, " B"]):
    """1 - kept / seen at each row's last generated token."""
    last = jnp.maximum(lengths - 1, 0)
    kept_last = jnp.take_along_axis(kept, last[:, None], axis=1)[:, 0]
    return 1.0 - kept_last / jnp.maximum(prompt_lengths + last, 1)


generate_jit = jax.jit(generate, static_argnames=("model_cfg", "cfg"))
