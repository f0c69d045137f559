"""Dry run: per-device memory of a training run, planned from shapes alone (nothing allocated).

  python -m sparserl_jax.dryrun --config experiments/configs/real/qwen2.5-7b.yaml \
      --config experiments/configs/real/mesh/8gpu.yaml \
      --arch experiments/configs/real/arch/qwen2.5-7b.json --device-memory-gib 80

Exact from jax.eval_shape (bytes follow from shapes, dtypes and PartitionSpecs): the parameters
(sharding.PARTITION_RULES on their paths), the optimizer state as rl.optim.make_optimizer builds
it (each moment laid out like its parameter), the rollout KV cache (kvcache.cache_for at the
sampler's capacity, sharding.cache_specs) and its dense counterpart. Estimated, by the formulas
below: activations and the other transient buffers of each phase. Per device, a dim split over
mesh axes is divided by their product; what the rules leave unsplit is counted whole.

Shapes: b rows per device, T tokens (P prompt, M new), D model dim, N/K query/KV heads, H head
dim, F MLP dim, V vocabulary, L layers, C cache slots, w window; Nt, Kt, Ft, Vt: N, K, F, V divided
by mesh.tensor where it divides them; a bytes per activation (model dtype), f32 = 4.

  hidden(b, T)   = b T D a                               one [b, T, D] activation
  layer(b, T)    = b T a (4 D + 2 Nt H + 2 Kt H + 3 Ft)  one block's live tensors (x, normed x,
                 + 2 b Nt T^2 f32                          residual, q, k, v, o, gate, up, act) and
                                                           the XLA attention's float32 logits and
                                                           probabilities ([b, N, T, T]); a fused
                                                           attention (fused_attention: cudnn,
                                                           blockwise, splash, auto in bfloat16)
                                                           keeps b Nt T f32 softmax statistics instead
  blocks(b, T)   = 2 (layer - its attention) + fused:     under remat, the backward's two live blocks;
                   2 b Nt T f32; XLA's: b Nt T^2 (f32 + a)  the recomputed layer's [T, T] f32 scores
                                                           and its probabilities (XLA:TPU's plan)
  update, remat  = L hidden + max(head, blocks + g)      block inputs saved by jax.checkpoint; then
                                                           the head's moment or one block recomputed
                                                           with its gradients, whichever is larger;
                                                           + L b T Ft a with the layers unrolled
                                                           under fsdp (XLA:TPU keeps each block's
                                                           MLP activation; model.scan_layers does not)
  update, selective = L (hidden + b T a (2 Nt H + 2 Kt H)) + max(head, blocks + g)
                                                           also q, k, v, attention output kept
  update, no remat = L layer + max(head, layer + g)      every block's residuals saved
  head(b, T)     = 2 hidden + 3 c Vt f32 + V D (a (1 + g') + f32 / s) / t, c = min(chunk_tokens, b T)
                                                           h and dh, one chunk's logits,
                                                           probabilities and their gradient; the head
                                                           weight's bf16 copy for the logits' product
                                                           (transposed), with mesh.fsdp > 1 (g' = 1)
                                                           its gathered copy, and its f32 gradient
                                                           summed over the chunks: whole (s = 1)
                                                           until reduce-scattered where D / fsdp
                                                           fills a 128-wide lane tile, else in D
                                                           slices (s = fsdp)
  g              = 2 (one layer's weights) a / t          two layers gathered (mesh.fsdp > 1, else 0)
  fwd_layer(b, T) = layer(b, T) - b T a Ft               a pass without gradients: the MLP's gate and
                                                           up live, its activation fused into the
                                                           down projection's operand
  score          = fwd_layer + hidden + c Vt f32         teacher-forced forward (pi_old, pi_ref): one
                                                           chunk's f32 logits (its log-softmax fused)
  prefill        = fwd_layer(b, P) + 2 L b P Kt H a      + the prompt keys/values of every layer
                                                           (upper bound: XLA may write them sooner)
  decode         = 3 b V f32 + 2 b Nt C f32               next-token logits carry, processed
                                                           logits, log-softmax; one layer's scores
  compress       = R-KV: b Kt C^2 f32; others: 2 b Nt w C f32; + 2 b Kt C H a
                                                           one layer's scores (R-KV: its f32 key
                                                           similarity, masked in place) and
                                                           compacted K/V
  fsdp gathers   = 2 (one layer's weights) / t + V D a / t  (when mesh.fsdp > 1) in the scoring
                                                           pass, and in the rollout where it decodes
                                                           on the training layout (rollout.mesh
                                                           train); the update's are in its formula
  stacked layers = the layers' weights / devices, a        (model.scan_layers: the learner's passes
                                                           stack a copy inside the program)

The rollout phase's b is the rows of one sampler call: rollout.rows_per_call when set (the
trainer samples the batch in consecutive calls of that many rows and fetches each call's outputs
to the host), else every row; the update batch holds every row.

Phases (the trainer runs them one after another): rollout (cache + prefill + decode + compress
+ outputs: summed, not their max, as XLA:TPU's plan of a sampler call holds them, + the quantized copy of the params with quant.format set, + the rollout layout's copy of
the compute weights with rollout.mesh data or tensor:N), score, update (gradients: a
float32 accumulator and one micro-batch's gradient; with rl.update.donate the new params and
optimizer state reuse the donated buffers of the old, else both coexist and the update phase holds
one more copy of each). Peak = persistent (params, reference params, optimizer state) + the
largest phase. The run fits when peak <= (1 - margin) x device memory; on GPU also set
XLA_PYTHON_CLIENT_MEM_FRACTION (JAX preallocates 75% by default).

With model.dtype apart from model.param_dtype (sparserl_jax/model/precision.py) the params and the
optimizer state are the param_dtype master, a persistent compute copy (model.dtype) is what the
sampler and the learner read, pi_ref is kept as a compute copy only (it is only scored), and a
micro-batch's gradient is in the compute dtype.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import shlex
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sparserl_jax import cli, components, quant
from sparserl_jax import kvcache as kv
from sparserl_jax.config import TrainConfig, load_config
from sparserl_jax.model import remat, sharding
from sparserl_jax.model.config import ModelConfig, param_count
from sparserl_jax.model.hf_config import config_from_hf
from sparserl_jax.rl.optim import make_optimizer
from sparserl_jax.rollout.layout import RolloutLayout
from sparserl_jax.rollout.sampler import cache_capacity
from sparserl_jax.rollout.sampling import kept_width

GIB = 1024**3
PHASES = ("persistent", "rollout", "score", "update")


@dataclasses.dataclass(frozen=True)
class Item:
    """One memory component: bytes per device, the phase it lives in, and how it was obtained."""

    name: str
    phase: str
    bytes: int
    how: str


# ----------------------------------------------------------------------------- inputs


def model_config(cfg: TrainConfig, arch: str | None = None) -> tuple[ModelConfig, str]:
    """The architecture in model.dtype and model.param_dtype: from `arch` (an HF config.json or a
    directory holding one), else model.checkpoint's config.json, else model.arch (random-init runs)."""
    settings = cfg.model.arch_settings
    path = arch
    if path is None and cfg.model.checkpoint:
        path = cfg.model.checkpoint
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(
                f"model.checkpoint={path!r} has no config.json (not downloaded here?): pass "
                "--arch FILE, e.g. experiments/configs/real/arch/qwen2.5-7b.json"
            )
    if path is None:
        return dataclasses.replace(cfg.model.arch, **settings), "model.arch"
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"--arch {path}: no such file (expected an HF config.json)")
    with open(file) as f:
        hf = json.load(f)
    return dataclasses.replace(config_from_hf(hf), **settings), file


def axis_sizes(cfg: TrainConfig, devices: int | None = None) -> dict[str, int]:
    """{"data", "fsdp", "tensor"} sizes; `devices` is needed only when a mesh axis is -1."""
    sizes = dataclasses.asdict(cfg.mesh)
    if devices is None:
        if -1 in sizes.values():
            rest = next(k for k, v in sizes.items() if v == -1)
            raise ValueError(
                f"mesh.{rest}=-1 takes the rest of the devices: pass --devices N or use a mesh "
                "overlay with fixed sizes (experiments/configs/real/mesh/*.yaml)"
            )
        devices = math.prod(sizes.values())
    return dict(zip(sharding.AXES, cfg.mesh.resolve(devices)))


# ----------------------------------------------------------------------------- exact: eval_shape


def spec_for_path(name: str, shape: Sequence[int], sizes: dict[str, int]) -> P:
    """The parameter rule for `name` or for its longest suffix that is a parameter path (so an
    optimizer moment 'mu/layers/3/q' is laid out like 'layers/3/q'); scalars are replicated."""
    parts = name.split("/")
    for i in range(len(parts)):
        sub = "/".join(parts[i:])
        for pattern, spec in sharding.PARTITION_RULES:
            if re.search(pattern, sub) and len(spec) <= len(shape):
                return sharding.fit_spec(spec, shape, sizes, what=f"param {sub!r}")
    if len(shape) == 0:
        return P()
    raise ValueError(f"no partition rule matches {name!r}; add one to sharding.PARTITION_RULES")


def device_bytes(shape: Sequence[int], dtype, spec: P, sizes: dict[str, int]) -> int:
    """Bytes of one shard: each dim divided by the product of the mesh axes it is split over."""
    n = 1
    for i, size in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        n *= -(-size // math.prod(sizes[a] for a in names))
    return n * jnp.dtype(dtype).itemsize


def tree_bytes(tree: Any, sizes: dict[str, int], *, dtype=None) -> int:
    """Per-device bytes of a params-like pytree (params, optimizer state, gradients)."""
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        spec = spec_for_path(sharding.path_str(path), leaf.shape, sizes)
        total += device_bytes(leaf.shape, dtype or leaf.dtype, spec, sizes)
    return total


def quantized_copy_bytes(cfg: TrainConfig, params: Any, sizes: dict[str, int]) -> int:
    """Per-device bytes of the rollout's quantized copy (QWeight values + float32 scales, laid out
    like their kernels); its full-precision leaves are theta's own buffers."""
    if not cfg.quant.enabled:
        return 0
    qparams = quant.abstract_quantized(params, cfg.quant)
    total = 0
    is_q = lambda x: isinstance(x, quant.QWeight)  # noqa: E731
    for path, leaf in jax.tree_util.tree_flatten_with_path(qparams, is_leaf=is_q)[0]:
        if isinstance(leaf, quant.QWeight):
            spec = spec_for_path(sharding.path_str(path), leaf.values.shape, sizes)
            total += device_bytes(leaf.values.shape, leaf.values.dtype, spec, sizes)
            total += device_bytes(leaf.scale.shape, jnp.float32, spec, sizes)
    return total


def cache_bytes(cache: kv.KVCache, sizes: dict[str, int]) -> int:
    """Per-device bytes of a KVCache (or its eval_shape) under sharding.cache_specs."""
    specs = sharding.cache_specs(cache, sizes)
    leaves = jax.tree_util.tree_leaves(cache)
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    return sum(device_bytes(x.shape, x.dtype, s, sizes) for x, s in zip(leaves, spec_leaves))


def abstract_cache(kv_cfg: kv.KVConfig, m: ModelConfig, batch: int, prompt_len: int, max_new: int):
    """eval_shape of the cache the sampler decodes with (rollout.sampler.generate). With
    kv.compress_prompt=false (the authors') a prompt longer than the budget stays whole until the
    first decode-time compression, so the cache has max(budget, prompt) + buffer slots; with true
    the prefill still fills a prompt-sized cache before squeezing it (hence max(capacity, P))."""
    capacity = cache_capacity(kv_cfg, prompt_len, max_new)
    make = functools.partial(kv.cache_for, kv_cfg, m, batch, prompt_len, capacity=max(capacity, prompt_len))
    return jax.eval_shape(make), capacity


# ----------------------------------------------------------------------------- checks


def per_device_rows(rows: int, setting: str, sizes: dict[str, int]) -> int:
    dp = sizes["data"] * sizes["fsdp"]
    if rows % dp:
        raise ValueError(
            f"{setting}={rows} is not a multiple of mesh data x fsdp = {dp}: every device needs "
            "the same whole number of rows; pick a multiple"
        )
    return rows // dp


def check_config(cfg: TrainConfig, m: ModelConfig, prompt_len: int) -> None:
    """The settings the trainer would refuse, named (before any estimate)."""
    components.check_lengths(cfg, m)  # the trainer's own length checks
    rows = cfg.rollout.prompts * cfg.rollout.samples
    if rows % cfg.rl.update.minibatch_size:
        raise ValueError(
            f"rollout.prompts x rollout.samples = {rows} must be a multiple of "
            f"rl.update.minibatch_size={cfg.rl.update.minibatch_size}"
        )
    if not 1 <= prompt_len <= cfg.data.max_prompt_len:
        raise ValueError(f"--prompt-len={prompt_len} must be in [1, data.max_prompt_len={cfg.data.max_prompt_len}]")


# ----------------------------------------------------------------------------- the estimate


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What every item of `estimate` reads, per device: the module docstring's symbols (D, L, H,
    Nt, Kt, Ft, V, Vt, a, M, T, C) and rows (b of each phase), the params' and optimizer state's
    bytes, and the two caches."""

    cfg: TrainConfig
    m: ModelConfig
    sizes: dict
    P_len: int
    D: int
    L: int
    H: int
    Nt: int
    Kt: int
    Ft: int
    V: int
    Vt: int
    a: int
    M: int
    T: int
    b_roll: int
    b_call: int
    b_micro: int
    b_score: int
    params: Any
    p_bytes: int
    c_bytes: int
    o_bytes: int
    sparse_cache: Any
    C: int
    dense_cache: Any
    C_dense: int

    @property
    def mixed(self) -> bool:
        return self.m.dtype != self.m.param_dtype

    def hidden(self, b: int, T_: int) -> int:
        return b * T_ * self.D * self.a

    def attn(self, b: int, T_: int) -> int:
        if fused_attention(self.m):  # the [T, T] scores never leave the kernel; its softmax statistics stay
            return b * self.Nt * T_ * F32
        return 2 * b * self.Nt * T_ * T_ * F32  # materialised scores and probabilities

    def recomputed_blocks(self, b: int, T_: int) -> int:
        """Under remat, the backward's two live blocks: their tensors, and either both layers'
        softmax statistics (fused attention) or one layer's [T, T] f32 scores and its probabilities
        in the model dtype (XLA's materialised attention: the block being recomputed)."""
        scores = 2 * self.attn(b, T_) if fused_attention(self.m) else b * self.Nt * T_ * T_ * (F32 + self.a)
        return 2 * (self.layer(b, T_) - self.attn(b, T_)) + scores

    def layer(self, b: int, T_: int) -> int:
        return b * T_ * self.a * (4 * self.D + 2 * self.Nt * self.H + 2 * self.Kt * self.H + 3 * self.Ft) + self.attn(
            b, T_
        )

    def forward_layer(self, b: int, T_: int) -> int:
        """One block's live tensors in a pass without gradients: the MLP's gate and up, its
        activation fused into the down projection's operand."""
        return self.layer(b, T_) - b * T_ * self.a * self.Ft

    def selective(self, b: int, T_: int) -> int:
        """What remat selective keeps of a block beside its input: q, k, v and the attention output."""
        return b * T_ * self.a * (2 * self.Nt * self.H + 2 * self.Kt * self.H)

    def chunk(self, b: int, T_: int) -> int:
        return min(self.cfg.rl.update.chunk_tokens, b * T_)

    @property
    def layer_params(self) -> int:
        """Parameters of one block (layer 0's)."""
        return sum(math.prod(x.shape) for x in jax.tree.leaves(self.params["layers"][0]))


F32 = 4
LANE = 128  # a TPU vector register's lane count: XLA:TPU tiles a minor dimension by it


def fused_attention(m: ModelConfig) -> bool:
    """Whether the full-sequence passes' attention keeps no [T, T] scores (model/attention.py):
    cudnn, blockwise and splash; auto in bfloat16 (cuDNN on a GPU, splash on a TPU, blockwise on a
    CPU); auto in float32 is XLA's materialised attention on a GPU, so counted as materialised."""
    return m.attention in ("cudnn", "blockwise", "splash") or (m.attention == "auto" and m.dtype == "bfloat16")


def shapes(cfg: TrainConfig, m: ModelConfig, sizes: dict[str, int], P_len: int) -> Shapes:
    """The per-device shapes and exact bytes (jax.eval_shape) of cfg's run."""
    r, u = cfg.rollout, cfg.rl.update
    t = sizes["tensor"]
    split = lambda n: n // t if n % t == 0 else n  # a dim the tensor axis splits when it divides it
    params = sharding.abstract_params(m)
    opt_state = jax.eval_shape(make_optimizer(cfg.rl.optim).init, params)
    sparse_cache, C = abstract_cache(cfg.kv, m, r.call_rows, P_len, r.max_new_tokens)
    dense_kv = dataclasses.replace(cfg.kv, policy="none")
    dense_cache, C_dense = abstract_cache(dense_kv, m, r.call_rows, P_len, r.max_new_tokens)
    b_roll = per_device_rows(r.rows, "rollout.prompts x rollout.samples", sizes)
    return Shapes(
        cfg=cfg,
        m=m,
        sizes=sizes,
        P_len=P_len,
        D=m.d_model,
        L=m.n_layers,
        H=m.head_dim,
        Nt=split(m.n_heads),
        Kt=split(m.n_kv_heads),
        Ft=split(m.d_ff),
        V=m.vocab_size,
        Vt=split(m.vocab_size),
        a=jnp.dtype(m.dtype).itemsize,
        M=-(-r.max_new_tokens // cfg.kv.buffer) * cfg.kv.buffer,  # decoded in whole chunks
        T=P_len + r.max_new_tokens,  # width of the update batch (rl.batch.assemble)
        b_roll=b_roll,
        b_call=per_device_rows(r.call_rows, "rollout.rows_per_call", sizes) if r.rows_per_call else b_roll,
        b_micro=per_device_rows(u.micro_batch_size, "rl.update.micro_batch_size", sizes),
        b_score=per_device_rows(min(u.score_batch_size, r.rows), "rl.update.score_batch_size", sizes),
        params=params,
        p_bytes=tree_bytes(params, sizes),  # the master (model.param_dtype)
        c_bytes=tree_bytes(params, sizes, dtype=m.dtype),  # a copy as the forwards read it
        o_bytes=tree_bytes(opt_state, sizes),
        sparse_cache=sparse_cache,
        C=C,
        dense_cache=dense_cache,
        C_dense=C_dense,
    )


def persistent_items(s: Shapes) -> list[Item]:
    """theta (the master), pi_ref, the optimizer state, and the compute copy with mixed precision."""
    m = s.m
    items = [
        Item(
            "params (theta)", "persistent", s.p_bytes, f"{m.param_dtype}{' master' if s.mixed else ''}, PARTITION_RULES"
        ),
        Item(
            "reference params (pi_ref)",
            "persistent",
            s.c_bytes,
            "a second copy after step 1" + (f", {m.dtype} (only scored)" if s.mixed else ""),
        ),
        Item("optimizer state", "persistent", s.o_bytes, "make_optimizer(rl.optim).init, like params"),
    ]
    if s.mixed:  # the compute copy, cast from the master after each optimizer step
        items.insert(
            1,
            Item(
                "compute copy of params",
                "persistent",
                s.c_bytes,
                f"{m.dtype}, cast from the master after each step: the sampler's and the learner's",
            ),
        )
    return items


def token_record_bytes(cfg: TrainConfig) -> tuple[int, int]:
    """Bytes a token of the sampler's records: (kept set with top-p / top-k training, int32 ids;
    the agreement's top candidates, int32 ids + float32 log-probs)."""
    r = cfg.rollout
    return (4 * kept_width(r.top_k) if r.filters else 0), 8 * components.agreement_candidates(cfg)


def rollout_copy_bytes(s: Shapes) -> int:
    """Per-device bytes of the weights the sampler decodes with on its own layout (rollout.mesh,
    rollout/layout.py): data, the compute copy whole on every device; tensor:N, split over N
    devices by the tensor rules; train (or one device), none beside the training layout's."""
    layout = RolloutLayout.parse(s.cfg.rollout.mesh)
    if layout.kind == "train" or math.prod(s.sizes.values()) == 1:
        return 0
    return tree_bytes(s.params, {"data": 1, "fsdp": 1, "tensor": layout.tensor}, dtype=s.m.dtype)


def rollout_items(s: Shapes) -> list[Item]:
    """One sampler call's cache, prefill, decode step and compression, outputs, and QuRL's copy."""
    cfg, r, q = s.cfg, s.cfg.rollout, s.cfg.quant
    b, C, f32 = s.b_call, s.C, F32
    if cfg.kv.policy == "rkv":
        scores, scores_how = b * s.Kt * C * C * f32, "b Kt C^2 f32 (R-KV similarity)"
    else:
        scores, scores_how = 2 * b * s.Nt * cfg.kv.window * C * f32, "2 b Nt w C f32"
    compress = 0 if cfg.kv.is_dense else scores + 2 * b * s.Kt * C * s.H * s.a
    kept_tok, top_tok = token_record_bytes(cfg)
    call_rows, rows = r.call_rows, r.rows
    per_call = f"{call_rows} rows per call" if call_rows < rows else f"all {rows} rows in one call"
    items = [
        Item(
            "KV cache (rollout)",
            "rollout",
            cache_bytes(s.sparse_cache, s.sizes),
            f"{call_rows} rows x C={C} slots ({cfg.kv.policy}; {per_call}), cache_specs",
        ),
        Item(
            "prefill activations",
            "rollout",
            s.forward_layer(b, s.P_len) + 2 * s.L * b * s.P_len * s.Kt * s.H * s.a,
            f"forward layer(b={b}, P={s.P_len}) + prompt K/V of every layer",
        ),
        Item(
            "decode step + compression",
            "rollout",
            3 * b * s.V * f32 + 2 * b * s.Nt * C * f32 + compress,
            f"3 b V f32 + 2 b Nt C f32 + {scores_how if compress else '0 (dense)'}, b={b}",
        ),
        Item(
            "rollout outputs",
            "rollout",
            b * (s.M * (13 + kept_tok + top_tok) + s.P_len * 4),
            f"tokens, log-probs, mask, kept [b={b}, {s.M}] (one call's)"
            + (f" + {kept_tok + top_tok} B a token of kept sets / top candidates" if kept_tok + top_tok else ""),
        ),
    ]
    copy = rollout_copy_bytes(s)
    if copy:
        items.insert(
            0,
            Item(
                "rollout copy of params",
                "rollout",
                copy,
                f"rollout.mesh={r.mesh}: the {s.m.dtype} compute copy "
                + ("whole on every device" if r.mesh == "data" else "split over a group's tensor axis"),
            ),
        )
    if q.enabled:  # QuRL: the sampler's quantized copy of theta, made before every rollout
        items.insert(
            0,
            Item(
                "quantized params (behaviour copy)",
                "rollout",
                quantized_copy_bytes(cfg, s.params, s.sizes),
                f"quant.format={q.format} quant.mode={q.mode}: values + f32 scales",
            ),
        )
    return items


def update_activations(s: Shapes) -> tuple[int, int, str]:
    """(activations with rl.update.remat as set, without remat, how they were counted) of one
    micro-batch's forward and backward, with fsdp's gathered weights: what the blocks save for
    the backward, plus the larger of the two moments that follow one another, the head (its chunk
    buffers, the head weight's f32 gradient summed over the chunks, the gathered head weight) and
    a block's backward (2 layers' live tensors and their gathered weights)."""
    b, T, f32 = s.b_micro, s.T, F32
    t, fsdp = s.sizes["tensor"], s.sizes["fsdp"]
    gathered = fsdp > 1
    # the head weight: its transposed bf16 copy for the logits' product, the fsdp-gathered one, and its
    # f32 gradient, summed whole and then reduce-scattered where a chip's share of D fills a 128-wide
    # lane tile, else computed in its D slices (XLA:TPU's plans, experiments/results/tpu/compile_table.md)
    grad_split = fsdp if s.D // fsdp < LANE else 1
    head_weight = s.V * s.D * ((1 + gathered) * s.a + f32 // grad_split) // t
    head = 2 * s.hidden(b, T) + 3 * s.chunk(b, T) * s.Vt * f32 + head_weight
    layer_weights = gathered * 2 * s.layer_params * s.a // t

    def peak(saved: int, working: int) -> int:
        return saved + max(head, working + layer_weights)

    no_remat = peak(s.L * s.layer(b, T), s.layer(b, T))
    moments = (
        "max(head + head weight's grad"
        + (" + gathered" if gathered else "")
        + ", {w}"
        + (" + 2 gathered layers)" if gathered else ")")
    )
    policy = remat.policy_name(s.cfg.rl.update.remat)
    # unrolled layers under fsdp: XLA:TPU's scheduler keeps each block's MLP activation from the
    # forward rather than recompute it after the block's weights are gathered again (v5e-8 and v5e-16,
    # experiments/results/tpu/compile_table.md); a scan recomputes each block inside its own iteration
    hoisted = s.L * b * T * s.Ft * s.a if gathered and not s.m.scan_layers else 0
    kept = " + L MLP act (unrolled under fsdp)" if hoisted else ""
    if policy == "full":
        acts = peak(s.L * s.hidden(b, T) + hoisted, s.recomputed_blocks(b, T))
        return acts, no_remat, f"L hidden{kept} + {moments.format(w='2 layer')} (remat full)"
    if policy == "selective":
        acts = peak(s.L * (s.hidden(b, T) + s.selective(b, T)) + hoisted, s.recomputed_blocks(b, T))
        return acts, no_remat, f"L (hidden + q k v o){kept} + {moments.format(w='2 layer')} (remat selective)"
    return no_remat, no_remat, f"L layer + {moments.format(w='layer')} (no remat)"


def learner_items(s: Shapes) -> list[Item]:
    """The update batch, the scoring pass, the gradients, the update's outputs and activations,
    and fsdp's all-gather buffers."""
    u, m, f32, T = s.cfg.rl.update, s.m, F32, s.T
    kept_tok, top_tok = token_record_bytes(s.cfg)
    batch_bytes = s.b_roll * T * (4 + 1 + 3 * f32) + s.b_roll * f32  # tokens, mask, 3 log-probs, adv.
    batch_bytes += s.b_roll * T * (kept_tok + top_tok // 2)  # the update reads the ids, not the log-probs
    acts, _, acts_how = update_activations(s)
    gathers = (2 * s.layer_params + s.V * s.D) * s.a // s.sizes["tensor"] if s.sizes["fsdp"] > 1 else 0
    # the update's gathers are in its activations' moments; a rollout layout of its own (rollout.mesh
    # data / tensor:N) decodes from whole weights
    own_layout = RolloutLayout.parse(s.cfg.rollout.mesh).kind != "train"
    items = [
        Item("update batch", "score+update", batch_bytes, f"[b={s.b_roll}, T={T}] tokens, mask, log-probs"),
        Item(
            "score activations",
            "score",
            s.forward_layer(s.b_score, T) + s.hidden(s.b_score, T) + s.chunk(s.b_score, T) * s.Vt * f32,
            f"forward layer + hidden + head (one chunk's f32 logits), b={s.b_score}",
        ),
        Item(
            "gradients (f32 accumulator + micro-batch)",
            "update",
            tree_bytes(s.params, s.sizes, dtype=jnp.float32) + s.c_bytes,
            "f32 sum + compute dtype",
        ),
        Item(
            "update outputs",
            "update",
            0 if u.donate else s.p_bytes + s.o_bytes + s.mixed * s.c_bytes,
            "in the donated buffers (rl.update.donate)"
            if u.donate
            else f"new params{' + compute copy' if s.mixed else ''} + opt state (rl.update.donate=false)",
        ),
        Item("update activations", "update", acts, f"{acts_how}, b={s.b_micro}, T={T}, {m.attention} attention"),
        Item(
            "fsdp all-gather buffers",
            "score" if own_layout else "rollout+score",
            gathers,
            ("2 layers + head weight" if gathers else "fsdp=1")
            + (f"; not in the rollout (rollout.mesh={s.cfg.rollout.mesh})" if gathers and own_layout else ""),
        ),
    ]
    if m.scan_layers:  # the learner's passes stack the layers' weights inside the program (transformer._run_blocks)
        stacked = tree_bytes({"layers": s.params["layers"]}, s.sizes, dtype=m.dtype)
        items.append(
            Item(
                "stacked layer weights",
                "score+update",
                stacked,
                f"model.scan_layers: the layers' {m.dtype} copy, stacked",
            )
        )
    return items


def estimate(
    cfg: TrainConfig, m: ModelConfig, sizes: dict[str, int], *, prompt_len: int | None = None
) -> tuple[list[Item], dict]:
    """Per-device memory items of one training iteration (persistent, rollout, then learner
    items), and facts used (shapes, capacities)."""
    P_len = prompt_len or cfg.data.max_prompt_len
    check_config(cfg, m, P_len)
    s = shapes(cfg, m, sizes, P_len)
    items = [*persistent_items(s), *rollout_items(s), *learner_items(s)]
    r = cfg.rollout
    facts = dict(
        prompt_len=P_len,
        max_new_tokens=r.max_new_tokens,
        update_width=s.T,
        rollout_rows=r.rows,
        rows_per_call=r.call_rows,
        rollout_calls=r.rows // r.call_rows,
        rows_per_device=dict(rollout=s.b_roll, rollout_call=s.b_call, micro_batch=s.b_micro, score=s.b_score),
        cache_capacity=s.C,
        dense_capacity=s.C_dense,
        dense_cache_bytes=cache_bytes(s.dense_cache, sizes),
        sparse_cache_bytes=cache_bytes(s.sparse_cache, sizes),
        update_activations_no_remat=update_activations(s)[1],
    )
    return items, facts


def phase_totals(items: Sequence[Item]) -> dict[str, int]:
    """Bytes per phase: "persistent" alone; every other phase includes the items shared with it."""
    totals = {}
    for phase in PHASES:
        totals[phase] = sum(
            i.bytes
            for i in items
            if i.phase == phase or (phase != "persistent" and (i.phase == "all" or phase in i.phase.split("+")))
        )
    return totals


def peak(totals: dict[str, int]) -> tuple[int, str]:
    phase = max(PHASES[1:], key=lambda p: totals[p])
    return totals["persistent"] + totals[phase], phase


# ----------------------------------------------------------------------------- report


def dry_run(
    cfg: TrainConfig,
    *,
    arch: str | None = None,
    devices: int | None = None,
    device_memory_gib: float = 80.0,
    margin: float = 0.1,
    prompt_len: int | None = None,
) -> dict:
    """The report as a JSON-able dict (see `to_markdown`)."""
    if device_memory_gib <= 0:
        raise ValueError(f"--device-memory-gib={device_memory_gib} must be > 0")
    if not 0 <= margin < 1:
        raise ValueError(f"--margin={margin} must be in [0, 1)")
    m, source = model_config(cfg, arch)
    sizes = axis_sizes(cfg, devices)
    items, facts = estimate(cfg, m, sizes, prompt_len=prompt_len)
    totals = phase_totals(items)
    total, phase = peak(totals)
    dense_items = [
        dataclasses.replace(i, bytes=facts["dense_cache_bytes"]) if i.name == "KV cache (rollout)" else i for i in items
    ]
    dense_totals = phase_totals(dense_items)
    dense_total, dense_phase = peak(dense_totals)
    budget = int((1 - margin) * device_memory_gib * GIB)
    return {
        "model": {
            "source": source,
            "family": m.family,
            "dtype": m.dtype,
            "param_dtype": m.param_dtype,
            "params": param_count(m),
            "d_model": m.d_model,
            "n_layers": m.n_layers,
            "n_heads": m.n_heads,
            "n_kv_heads": m.n_kv_heads,
            "head_dim": m.head_dim,
            "vocab_size": m.vocab_size,
        },
        "mesh": sizes,
        "devices": math.prod(sizes.values()),
        "kv": {"policy": cfg.kv.policy, "budget": cfg.kv.budget, "buffer": cfg.kv.buffer},
        "rollout": {
            "rows": facts["rollout_rows"],
            "rows_per_call": cfg.rollout.rows_per_call,
            "calls": facts["rollout_calls"],
        },
        "shapes": facts,
        "items": [dataclasses.asdict(i) for i in items],
        "phase_bytes": totals,
        "peak_bytes": total,
        "peak_phase": phase,
        "device_memory_gib": device_memory_gib,
        "margin": margin,
        "budget_bytes": budget,
        "fits": total <= budget,
        "dense_rollouts": {
            "peak_bytes": dense_total,
            "peak_phase": dense_phase,
            "rollout_phase_bytes": dense_totals["rollout"],
            "fits": dense_total <= budget,
        },
    }


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def precision(model: dict) -> str:
    """'bfloat16' or 'bfloat16 compute, float32 master' (a report's model entry)."""
    param = model.get("param_dtype", model["dtype"])
    return model["dtype"] if param == model["dtype"] else f"{model['dtype']} compute, {param} master"


def to_markdown(rep: dict, command: str | None = None) -> str:
    m, s = rep["model"], rep["shapes"]
    mesh = " x ".join(f"{k}={v}" for k, v in rep["mesh"].items())
    verdict = "fits" if rep["fits"] else "does not fit"
    lines = [
        f"# Dry run: {os.path.basename(m['source'])}, {rep['devices']} device(s), "
        f"{rep['device_memory_gib']:g} GiB each",
        "",
    ]
    if command:
        lines += ["```", command, "```", ""]
    lines += [
        f"- model: {m['family']}, {m['params'] / 1e9:.2f}B params, {precision(m)}; mesh {mesh}",
        f"- rollout: {s['rollout_rows']} rows in {s['rollout_calls']} sampler call(s) of "
        f"{s['rows_per_call']} (rollout.rows_per_call={rep['rollout']['rows_per_call']}), "
        f"prompt {s['prompt_len']} + {s['max_new_tokens']} new "
        f"tokens; KV cache {rep['kv']['policy']} C={s['cache_capacity']} slots vs dense "
        f"C={s['dense_capacity']} ({_gib(s['sparse_cache_bytes'])} vs {_gib(s['dense_cache_bytes'])} "
        "GiB per device, one call's rows)",
        f"- rows per device: {s['rows_per_device']}; update width T={s['update_width']}",
        "",
        "| component | phase | GiB / device | how |",
        "|---|---|---:|---|",
    ]
    lines += [f"| {i['name']} | {i['phase']} | {_gib(i['bytes'])} | {i['how']} |" for i in rep["items"]]
    lines += ["", "| phase | GiB / device (persistent + phase) |", "|---|---:|"]
    pb = rep["phase_bytes"]
    lines += [f"| persistent | {_gib(pb['persistent'])} |"]
    lines += [f"| {p} | {_gib(pb['persistent'] + pb[p])} |" for p in PHASES[1:]]
    d = rep["dense_rollouts"]
    lines += [
        "",
        f"**Peak {_gib(rep['peak_bytes'])} GiB per device ({rep['peak_phase']} phase): {verdict}** "
        f"in {rep['device_memory_gib']:g} GiB with a {rep['margin']:.0%} margin "
        f"(budget {_gib(rep['budget_bytes'])} GiB).",
        f"With dense rollouts: peak {_gib(d['peak_bytes'])} GiB ({d['peak_phase']} phase), "
        f"{'fits' if d['fits'] else 'does not fit'}.",
        "",
        "Exact from eval_shape: params, optimizer state, KV caches. Estimated: the rest "
        "(formulas in sparserl_jax/dryrun.py). The remat figure assumes XLA recomputes one block "
        "at a time; XLA:CPU's schedule does not realise that saving (tests/test_dryrun.py), and "
        f"without it the update activations would be {_gib(s['update_activations_no_remat'])} GiB.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m sparserl_jax.dryrun", description=__doc__.split("\n")[0])
    p.add_argument("--config", action="append", default=[], help="YAML file(s), merged in order")
    p.add_argument("overrides", nargs="*", help="key=value settings, e.g. kv.budget=256")
    p.add_argument("--arch", help="HF config.json (or a directory with one) when model.checkpoint is absent")
    p.add_argument("--devices", type=int, help="device count (only when a mesh axis is -1)")
    p.add_argument("--device-memory-gib", type=float, default=80.0)
    p.add_argument("--margin", type=float, default=0.1, help="fraction of device memory kept free")
    p.add_argument("--prompt-len", type=int, help="padded prompt width (default data.max_prompt_len)")
    p.add_argument("--out-json")
    p.add_argument("--out-md")
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    command = "python -m sparserl_jax.dryrun " + shlex.join(argv)
    rep = dry_run(
        load_config(args.config, args.overrides),
        arch=args.arch,
        devices=args.devices,
        device_memory_gib=args.device_memory_gib,
        margin=args.margin,
        prompt_len=args.prompt_len,
    )
    rep["command"] = command
    md = to_markdown(rep, command)
    for path, text in ((args.out_json, json.dumps(rep, indent=1) + "\n"), (args.out_md, md)):
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
    print(md, end="")
    return rep


if __name__ == "__main__":
    cli.run(main)
