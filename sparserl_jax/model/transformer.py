"""The decoder-only transformer as pure functions over a plain params pytree.

params = {
  "embed": [V, D],
  "layers": [ {"attn_norm": [D], "q": [D, N, H], "k": [D, K, H], "v": [D, K, H], "o": [N, H, D],
               ("q_bias": [N, H], "k_bias": [K, H], "v_bias": [K, H])   # Qwen2, Llama attention_bias
               ("q_norm": [H], "k_norm": [H])                            # Qwen3
               "mlp_norm": [D], "gate": [D, F], "up": [D, F], "down": [F, D]}, ... ],
  "final_norm": [D],
  ("lm_head": [D, V])                                                    # untied embeddings
}

Layers are a Python list (unrolled), so a decode step reads and writes each layer's cache buffer
in place, with no slicing of stacked weights or caches. With model.scan_layers the learner's
full-sequence passes (forward: the update, scoring; prefill stays unrolled) stack them inside the
program and run one block under lax.scan; the params and the cache keep their per-layer layout.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from sparserl_jax import kernels
from sparserl_jax.kvcache import cache as kvc
from sparserl_jax.mesh_axes import BATCH
from sparserl_jax.model import attention
from sparserl_jax.model import remat as remat_policy
from sparserl_jax.model.activation_sharding import ActivationSharding
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.model.layers import (
    RopeTables,
    apply_rope,
    rms_norm,
    rope_frequencies,
    rope_tables,
    sequence_rope_tables,
    swiglu_mlp,
)
from sparserl_jax.model.precision import accumulation, compute_params
from sparserl_jax.quant.core import QWeight, dot, merge_leading_axes, narrow_cotangent

Params = dict


# ----------------------------------------------------------------------------- init


def _layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    shapes = {
        "q": (D, N, H),
        "k": (D, K, H),
        "v": (D, K, H),
        "o": (N, H, D),
        "gate": (D, F),
        "up": (D, F),
        "down": (F, D),
    }
    if cfg.qkv_bias:
        shapes.update(q_bias=(N, H), k_bias=(K, H), v_bias=(K, H))
    return shapes


def _normal_leaves(key: jax.Array, shapes: dict, dtype) -> dict:
    """Leaves of std 0.02 from one draw (one random program per layer keeps compiles short)."""
    sizes = [math.prod(s) for s in shapes.values()]
    flat = 0.02 * jax.random.normal(key, (sum(sizes),), jnp.float32)
    parts = jnp.split(flat, list(itertools.accumulate(sizes))[:-1])
    return {n: x.reshape(s).astype(dtype) for (n, s), x in zip(shapes.items(), parts)}


@functools.partial(jax.jit, static_argnums=0)
def _init_layer(cfg: ModelConfig, key: jax.Array) -> dict:
    """One layer's random params: one compiled program, reused by every layer (same shapes)."""
    D, H, dtype = cfg.d_model, cfg.head_dim, jnp.dtype(cfg.param_dtype)
    layer = _normal_leaves(key, _layer_shapes(cfg), dtype)
    layer.update(attn_norm=jnp.ones((D,), dtype), mlp_norm=jnp.ones((D,), dtype))
    if cfg.qk_norm:
        layer.update(q_norm=jnp.ones((H,), dtype), k_norm=jnp.ones((H,), dtype))
    return layer


@functools.partial(jax.jit, static_argnums=0)
def _init_outer(cfg: ModelConfig, key_embed: jax.Array, key_head: jax.Array) -> dict:
    """The params outside the layers: embedding, final norm and (untied) output head."""
    D, V, dtype = cfg.d_model, cfg.vocab_size, jnp.dtype(cfg.param_dtype)
    params = {
        "embed": _normal_leaves(key_embed, {"embed": (V, D)}, dtype)["embed"],
        "final_norm": jnp.ones((D,), dtype),
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = _normal_leaves(key_head, {"lm_head": (D, V)}, dtype)["lm_head"]
    return params


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
    """Random params (normal, std 0.02; norms at 1), in cfg.param_dtype: the master weights. Two
    small compiled programs (a layer's, called once per layer, and the embedding and head's): the
    whole model as one program did not finish compiling for an H200 within 170 s at Qwen2.5-1.5B
    (28 layers; XLA's slow-compile alarm named it), where it takes 7 s for a CPU. Under an outer
    jit (sharding.init_sharded) the two inline into one program; the values are the same either
    way; its shapes alone: jax.eval_shape(functools.partial(init_params, cfg), key)."""
    key_embed, key_head, *layer_keys = jax.random.split(key, 2 + cfg.n_layers)
    return {**_init_outer(cfg, key_embed, key_head), "layers": [_init_layer(cfg, k) for k in layer_keys]}


# how a head weight is laid out: [D, V] (an untied lm_head) or [V, D] (a tied head: the embedding)
HEAD_SPECS = {"dv": "cd,dv->cv", "vd": "cd,vd->cv"}


def head(params: Params) -> tuple[Float[Array, "D V"] | Float[Array, "V D"], str]:
    """The LM head as the learner reads it: (weight, layout), the layout a key of HEAD_SPECS. A
    tied head is the embedding itself, [V, D], contracted on its last axis in place: no transposed
    [D, V] copy, and its gradient comes out in the embedding's own layout (an embed.T wrote both:
    0.93 s of a 4-micro-step float32 update on the Xeon model 207,
    experiments/results/profile_cpu_intel-xeon-family6-model207.md)."""
    return (params["lm_head"], "dv") if "lm_head" in params else (params["embed"], "vd")


# ----------------------------------------------------------------------------- blocks


def _qkv(layer: dict, x: Float[Array, "B T D"], rope: RopeTables, cfg: ModelConfig):
    h = rms_norm(x, layer["attn_norm"], cfg.norm_eps)
    acc = accumulation(cfg)
    q = dot("btd,dnh->btnh", h, layer["q"], accumulate=acc)
    k = dot("btd,dkh->btkh", h, layer["k"], accumulate=acc)
    v = dot("btd,dkh->btkh", h, layer["v"], accumulate=acc)
    if "q_bias" in layer:
        q, k, v = q + layer["q_bias"], k + layer["k_bias"], v + layer["v_bias"]
    if cfg.qk_norm:
        q = rms_norm(q, layer["q_norm"], cfg.norm_eps)
        k = rms_norm(k, layer["k_norm"], cfg.norm_eps)
    return apply_rope(q, rope), apply_rope(k, rope), v


def _finish_block(layer: dict, x: Float[Array, "B T D"], o: Float[Array, "B T N H"], cfg: ModelConfig):
    # o_proj as one [B, T, N*H] @ [N*H, D] product: a free reshape of the stored [N, H, D] kernel
    # (contracting N and H as two axes made XLA transpose and copy the kernel on every call).
    B, T, N, H = o.shape
    acc = accumulation(cfg)
    x = x + dot("btf,fd->btd", o.reshape(B, T, N * H), merge_leading_axes(layer["o"], 2), accumulate=acc)
    return x + swiglu_mlp(rms_norm(x, layer["mlp_norm"], cfg.norm_eps), layer, acc)


# model.attention's implementations (xla, cudnn, blockwise, splash, auto) live in model/attention.py
causal_attention = attention.causal_attention


# ----------------------------------------------------------------------------- full sequences


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens: Int[Array, "B T"],
    *,
    remat: bool | str = False,
    return_qkv: bool = False,
    attn_masks: list[Bool[Array, "B N T T"]] | None = None,
    mesh: jax.sharding.Mesh | None = None,
):
    """Teacher-forced pass over right-padded tokens. Returns final-normed hidden states [B, T, D]
    (and, with return_qkv, per-layer post-RoPE queries [B, T, N, H], keys and values [B, T, K, H]).

    `attn_masks` (one boolean [B, N, T, T] mask per layer, applied on top of causality) replays
    what a sparse sampler let each query see, for an exact teacher-forced recompute.
    Every entry point reads the weights in cfg.dtype (model/precision.py: a no-op on a compute copy).
    `mesh` (the one the params and tokens are sharded on): the residual stream stays split on B
    over data x fsdp at every layer boundary, heads over tensor (model/activation_sharding.py).
    `remat` (rl.update.remat, model/remat.py) what each block keeps for the backward pass; with
    cfg.scan_layers the blocks run as one lax.scan (_run_blocks), the same values either way."""
    params = compute_params(params, cfg)
    act = ActivationSharding(mesh)
    rope = sequence_rope_tables(tokens.shape[1], cfg)
    x = act.rows(act.lookup_table(params["embed"])[tokens])

    def block(layer, x, mask):
        q, k, v = (remat_policy.tag("qkv", act.heads(a)) for a in _qkv(layer, x, rope, cfg))
        o = remat_policy.tag(
            "attn_out", causal_attention(q, k, v, mask, cfg.attention, mesh=mesh, backward=cfg.attention_backward)
        )
        return _finish_block(layer, x, act.heads(o), cfg), (q, k, v)

    x, qkv = _run_blocks(block, params["layers"], x, attn_masks, act, remat, cfg.scan_layers, return_qkv)
    h = act.rows(rms_norm(x, params["final_norm"], cfg.norm_eps))
    if not return_qkv:
        return h
    qs, ks, vs = qkv
    return h, qs, ks, vs


def stack_layers(layers: list[dict]) -> dict:
    """The layers' weights as one layer whose every leaf has a leading [L] axis (QWeight values and
    scales alike): one copy of the layer weights, made inside the program that reads them."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def _run_blocks(
    block: Callable,
    layers: list[dict],
    x: Float[Array, "B T D"],
    attn_masks: list[Bool[Array, "B N T T"]] | None,
    act: ActivationSharding,
    remat: bool | str,
    scan: bool,
    return_qkv: bool,
):
    """The blocks over the residual stream, pinned to its row layout after each. Unrolled (the
    default): L copies of the block in the program. `scan` (model.scan_layers): one lax.scan over
    the stacked weights and masks, one block in a while loop; the stacked weights take each layer
    leaf's sharding with the new leading axis unsharded (XLA propagates it from the leaves it
    stacks; each iteration's slice is gathered where it runs). The same values either way.
    Returns the residual stream and, with return_qkv, the per-layer (queries, keys, values) lists."""
    # rl.update.remat: none, full or selective (model/remat.py); jax.checkpoint's prevent_cse guards an
    # unrolled recompute, a scan body needs none
    block = remat_policy.checkpointed(block, remat, prevent_cse=not scan)

    def body(x, layer_and_mask):
        layer, mask = layer_and_mask
        x, layer_qkv = block(layer, x, mask)
        return act.rows(x), (layer_qkv if return_qkv else None)

    if scan:
        masks_L = None if attn_masks is None else jnp.stack(attn_masks)
        x, qkv_L = jax.lax.scan(body, x, (stack_layers(layers), masks_L))
        return x, (tuple(list(a_L) for a_L in qkv_L) if return_qkv else None)  # [L, ...] -> L arrays
    per_layer = []
    for layer, mask in zip(layers, [None] * len(layers) if attn_masks is None else attn_masks):
        x, layer_qkv = body(x, (layer, mask))
        per_layer.append(layer_qkv)
    return x, (tuple(list(t) for t in zip(*per_layer)) if return_qkv else None)


def logits_from_hidden(params: Params, h: Float[Array, "... D"]) -> Float[Array, "... V"]:
    """Float32 logits (use only where [..., V] is small: decode steps, tests). A tied head
    contracts the embedding's last axis in place (no [V, D] -> [D, V] transpose per call); the
    embedding always stays full precision (quant.skip)."""
    if "lm_head" in params:
        return dot("...d,dv->...v", h, params["lm_head"], preferred_element_type=jnp.float32)
    return jnp.einsum("...d,vd->...v", h, params["embed"], preferred_element_type=jnp.float32)


def logits(
    params: Params, cfg: ModelConfig, tokens: Int[Array, "B T"], *, mesh: jax.sharding.Mesh | None = None
) -> Float[Array, "B T V"]:
    """Full float32 logits over [B, T] (tests and small vocabularies only)."""
    params = compute_params(params, cfg)
    return logits_from_hidden(params, forward(params, cfg, tokens, mesh=mesh))


def chunked_logprobs(
    h: Float[Array, "B T D"],
    w: Float[Array, "D V"] | Float[Array, "V D"],
    targets: Int[Array, "B T"],
    *,
    w_layout: str = "dv",
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    kept_ids: Int[Array, "B T K"] | None = None,
    gather_ids: Int[Array, "B T A"] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    head_backward: str = "float32",
    fit_chunks: bool = False,
) -> tuple[Float[Array, "B T"], ...]:
    """Log-probs of `targets` and the entropy under softmax(h @ w / temperature), without ever
    holding [B, T, V] logits (`w` laid out as `w_layout` says: "dv" [D, V], "vd" [V, D], HEAD_SPECS):
    each device processes `chunk_tokens` of its tokens at a time, and
    each chunk's logits are recomputed in the backward pass (jax.checkpoint) rather than stored.
    With `mesh` (h's rows split over its data x fsdp) a chunk takes `chunk_tokens` of every row
    shard's own tokens, so no device gathers another's hidden states; without one (or with one
    shard) the tokens are chunked in order, as one [B T, D] array.

    `kept_ids` (the sampler's kept set per position, -1 padded; rollout/sampling.py sample_kept):
    where a position has one, its log-prob is renormalised over that set, log p(target) -
    logsumexp over the set (the sampling-mask replay); elsewhere over the whole vocabulary. The
    entropy is always the whole distribution's. `gather_ids` (-1 padded): the log-probs of those
    tokens too, normalised as the targets' are, returned third ([B, T, A]; -inf at -1).
    `head_backward` (model.head_backward): "compute" takes the head's gradients from the logits'
    cotangent rounded to h's dtype when h is narrower than float32 (quant.core.narrow_cotangent).
    `fit_chunks`: the same number of chunks, each as small as the tokens allow (a multiple of 8
    rows): fewer padded rows than `chunk_tokens`-row chunks when the tokens do not fill them (the
    head window's, token_logprobs)."""
    # G row shards (1 without a mesh) of M tokens each, in S chunks of C tokens per shard: chunk s
    # holds tokens [s C, (s + 1) C) of every shard, so each device reads only its own rows
    if w_layout not in HEAD_SPECS:
        raise ValueError(f"chunked_logprobs: w_layout={w_layout!r}, accepted values are {tuple(HEAD_SPECS)}")
    spec = HEAD_SPECS[w_layout]
    act = ActivationSharding(mesh)
    B, T = targets.shape
    G, C = act.batch_shards(B), chunk_tokens
    M = B // G * T
    S = -(-M // C)
    if fit_chunks:
        C = -(-M // S)  # ceil(M / S) tokens a chunk, rounded up to 8 rows
        C = -(-C // 8) * 8

    def chunked(x, fill=0):  # [B, T, ...] -> [S, G C, ...]
        x_GxM = act.rows(x.reshape(G, M, *x.shape[2:]))
        x_GxM = jnp.pad(x_GxM, ((0, 0), (0, S * C - M)) + ((0, 0),) * (x.ndim - 2), constant_values=fill)
        x_SxGxC = act.pin(x_GxM.reshape(G, S, C, *x.shape[2:]).swapaxes(0, 1), P(None, BATCH))
        return x_SxGxC.reshape(S, G * C, *x.shape[2:])

    def unchunked(o):  # [S, G C, ...] -> [B, T, ...]
        o_GxSxC = o.reshape(S, G, C, *o.shape[2:]).swapaxes(0, 1)
        return o_GxSxC.reshape(G, S * C, *o.shape[2:])[:, :M].reshape(B, T, *o.shape[2:])

    xs = [chunked(h), chunked(targets)]
    if kept_ids is not None:
        xs.append(chunked(kept_ids, -1))
    if gather_ids is not None:
        xs.append(chunked(gather_ids, -1))
    has_kept = kept_ids is not None
    narrow = (
        head_backward == "compute"
        and not isinstance(w, QWeight)
        and h.dtype == w.dtype
        and jnp.finfo(h.dtype).bits < 32
    )

    @jax.checkpoint
    def one_chunk(h_cxD, t_c, *extra):
        if narrow:
            logits_cxV = narrow_cotangent(spec, h_cxD, w)
        else:
            logits_cxV = dot(spec, h_cxD, w, preferred_element_type=jnp.float32)
        logits_cxV = logits_cxV / temperature
        lse_c = jax.nn.logsumexp(logits_cxV, axis=-1)
        picked_c = jnp.take_along_axis(logits_cxV, t_c[:, None], axis=-1)[:, 0]
        p_cxV = jnp.exp(logits_cxV - lse_c[:, None])
        entropy_c = lse_c - jnp.sum(p_cxV * logits_cxV, axis=-1)
        norm_c = lse_c
        if has_kept:
            k_cxK = extra[0]
            kept_cxK = jnp.take_along_axis(logits_cxV, jnp.maximum(k_cxK, 0), axis=-1)
            lse_kept_c = jax.nn.logsumexp(jnp.where(k_cxK >= 0, kept_cxK, -jnp.inf), axis=-1)
            norm_c = jnp.where(k_cxK[:, 0] >= 0, lse_kept_c, lse_c)
        out = (picked_c - norm_c, entropy_c)
        if gather_ids is not None:
            g_cxA = extra[-1]
            at_cxA = jnp.take_along_axis(logits_cxV, jnp.maximum(g_cxA, 0), axis=-1) - norm_c[:, None]
            out = (*out, jnp.where(g_cxA >= 0, at_cxA, -jnp.inf))
        return out

    def body(_, xs):
        return None, one_chunk(*xs)

    _, outs = jax.lax.scan(body, None, tuple(xs))
    return tuple(unchunked(o) for o in outs)


def token_logprobs(
    params: Params,
    cfg: ModelConfig,
    tokens: Int[Array, "B T"],
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    remat: bool | str = False,
    kept_ids: Int[Array, "B T K"] | None = None,
    gather_ids: Int[Array, "B T A"] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    window: int | None = None,
    window_start: Int[Array, " B"] | None = None,
) -> tuple[Float[Array, "B T"], ...]:
    """Per-position log-prob of the next token (position t scores tokens[t + 1]; the last
    position scores token 0 and should be masked) and the entropy of each next-token distribution;
    with `kept_ids` renormalised over the sampler's kept set where a position has one, and with
    `gather_ids` the log-probs of those tokens third (chunked_logprobs). `mesh`: the activations
    stay split on B over it (forward).

    `window` positions from `window_start` (per row; head_window_starts): the LM head runs over
    those positions only, in chunks fitted to them (chunked_logprobs' fit_chunks), the rest of
    each row gets 0 (log-prob, entropy) and -inf (gathered log-probs), as a masked position's
    value that nothing reads (rl.update.head_window). The blocks still run over every position:
    the window's tokens attend to the whole row."""
    params = compute_params(params, cfg)
    h = forward(params, cfg, tokens, remat=remat, mesh=mesh)
    targets = jnp.roll(tokens, -1, axis=1)
    w, w_layout = head(params)
    T = tokens.shape[1]
    if window is not None and not 1 <= window <= T:
        raise ValueError(f"token_logprobs: window={window} must be within 1..{T}, the rows' width")
    if window is not None and window_start is None:
        raise ValueError("token_logprobs: a window needs window_start (head_window_starts)")
    take = (lambda x: x) if window is None else functools.partial(_take_window, starts_B=window_start, window=window)
    outs = chunked_logprobs(
        take(h),
        w,
        take(targets),
        w_layout=w_layout,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
        kept_ids=None if kept_ids is None else take(kept_ids),
        gather_ids=None if gather_ids is None else take(gather_ids),
        mesh=mesh,
        head_backward=cfg.head_backward,
        fit_chunks=window is not None,
    )
    if window is None:
        return outs
    fills = (0.0, 0.0, -jnp.inf)  # log-prob, entropy, gathered log-probs outside the window
    return tuple(_place_window(o, window_start, T, fill) for o, fill in zip(outs, fills))


# ----------------------------------------------------------------------------- head windows


def head_window_starts(response_mask: Bool[Array, "B T"], window: int) -> Int[Array, " B"]:
    """Where each row's head window begins: at its first response position (position t scores
    tokens[t + 1]), moved left where a window from there would pass the row's end, so the window
    still holds every response position of a row with at most `window` of them; 0 for a row
    without any."""
    first_B = jnp.argmax(response_mask, axis=1)
    return jnp.minimum(first_B, response_mask.shape[1] - window).astype(jnp.int32)


def _window_index(idx_BxW: Int[Array, "B W"], ndim: int) -> Int[Array, "B W ..."]:
    return idx_BxW.reshape(idx_BxW.shape + (1,) * (ndim - 2))


def _take_window(x: Array, *, starts_B: Int[Array, " B"], window: int) -> Array:
    """[B, T, ...] -> [B, window, ...]: each row's positions starts_B .. starts_B + window - 1."""
    idx_BxW = starts_B[:, None] + jnp.arange(window, dtype=jnp.int32)[None, :]
    return jnp.take_along_axis(x, _window_index(idx_BxW, x.ndim), axis=1)


def _place_window(o: Array, starts_B: Int[Array, " B"], T: int, fill: float) -> Array:
    """_take_window's inverse: [B, window, ...] -> [B, T, ...], `fill` outside each row's window."""
    window = o.shape[1]
    j_BxT = jnp.arange(T, dtype=jnp.int32)[None, :] - starts_B[:, None]
    inside_BxT = (j_BxT >= 0) & (j_BxT < window)
    got = jnp.take_along_axis(o, _window_index(jnp.clip(j_BxT, 0, window - 1), o.ndim), axis=1)
    return jnp.where(_window_index(inside_BxT, o.ndim), got, jnp.asarray(fill, o.dtype))


# ----------------------------------------------------------------------------- cached decoding


def prefill(
    params: Params,
    cfg: ModelConfig,
    tokens: Int[Array, "B T"],
    lengths: Int[Array, " B"],
    cache: kvc.KVCache,
    *,
    observe_prefill: Callable | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[Float[Array, "B V"], kvc.KVCache]:
    """Run right-padded prompts, store their keys/values in `cache`, and return the float32 logits
    of the next token after each prompt's last real token.

    `observe_prefill(cache, qs, ks, lengths) -> cache` (per-layer [B, T, N, H] queries and
    [B, T, K, H] keys) lets an eviction policy initialise its state from the prompt. `mesh`: the
    activations stay split on B over it (forward). The layers run unrolled whatever
    cfg.scan_layers says: a scan stacks a copy of the weights inside the program, which on a
    rollout layout (every chip holding the whole compute copy) doubles them (Qwen2.5-1.5B's sampler
    call on a v5e-8, data-parallel: 16.1 GiB a chip scanned, 9.5 unrolled).
    """
    params = compute_params(params, cfg)
    unrolled = dataclasses.replace(cfg, scan_layers=False)
    h, qs, ks, vs = forward(params, unrolled, tokens, return_qkv=True, mesh=mesh)
    last_BxD = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
    cache = kvc.write_prefill(cache, ks, vs, lengths)
    if observe_prefill is not None:
        cache = observe_prefill(cache, qs, ks, lengths)
    return logits_from_hidden(params, last_BxD), cache


AttendFn = Callable[..., tuple[Float[Array, "B N H"], Float[Array, "B N"]]]


def decode_step(
    params: Params,
    cfg: ModelConfig,
    cache: kvc.KVCache,
    tokens: Int[Array, " B"],
    *,
    attn_impl: str = "auto",
    observe: Callable | None = None,
    attn_platform: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[Float[Array, "B V"], kvc.KVCache]:
    """Feed one token per sequence at position cache.length; return next-token float32 logits.

    `observe(cache, layer, q_BxNxH, lse_BxN) -> cache` lets an eviction policy record what it
    needs (attention mass, recent queries) while the layer's query is at hand. attn_impl and
    attn_platform pick the attention kernel (kernels.decode_attention); with `mesh` (the cache
    sharded on it) each device attends with its own cache shard under shard_map.
    """
    params = compute_params(params, cfg)
    rope = rope_tables(cache.length[:, None], rope_frequencies(cfg))
    x = params["embed"][tokens][:, None, :]
    for i, layer in enumerate(params["layers"]):
        q, k, v = _qkv(layer, x, rope, cfg)
        cache = kvc.write_token(cache, i, k[:, 0], v[:, 0])
        o, lse = kernels.decode_attention(
            q[:, 0],
            cache.k[i],
            cache.v[i],
            cache.fill + 1,
            impl=attn_impl,
            platform=attn_platform,
            mesh=mesh,
        )
        if observe is not None:
            cache = observe(cache, i, q[:, 0], lse)
        x = _finish_block(layer, x, o[:, None], cfg)
    h = rms_norm(x[:, 0], params["final_norm"], cfg.norm_eps)
    return logits_from_hidden(params, h), kvc.advance(cache)
