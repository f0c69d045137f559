"""Model hyper-parameters, shared by the transformer, HF import/export and sharding.

Shape legend used in names across the package:
  B batch, T tokens (query length), S key length, D model dim, N query heads,
  K KV heads, G = N // K query heads per KV head, H head dim, F MLP hidden dim,
  V vocabulary, L layers, C cache slots.
"""

from __future__ import annotations

import dataclasses

from sparserl_jax.model.families import FAMILIES as FAMILY_REGISTRY
from sparserl_jax.validate import check_at_least, check_bool, check_in, check_multiple, check_positive

DOT_ACCUMULATIONS = ("auto", "output", "float32")  # "auto" and quant.core.ACCUMULATIONS
# model.head_backward: the LM head's backward in the learner from the loss's float32 cotangent
# ("float32": XLA widens a bfloat16 head weight to float32 for it) or from that cotangent rounded
# to model.dtype ("compute": bfloat16 products accumulated in float32, Megatron's bfloat16 output
# layer; quant.core.narrow_cotangent, its weight gradient's lone token axis split in two so that
# XLA:CPU runs that product in bfloat16 too). The same program under float32 compute.
HEAD_BACKWARDS = ("float32", "compute")
# model.attention_backward: the materialised attention's backward (model/attention.py; the xla path and
# blockwise's rows of at most 512 tokens): "autodiff" (jax's autodiff: float32 cotangents, so XLA widens a
# bfloat16 run's backward products to float32) or "compute" (FlashAttention-2's precision, as blockwise's
# longer rows: P and dS rounded to model.dtype before products accumulated in float32). The same
# computation under float32 compute but for the summation order.
ATTENTION_BACKWARDS = ("autodiff", "compute")

DTYPES: tuple[str, ...] = ("float32", "bfloat16")  # model.dtype (compute) and model.param_dtype
# model.dtype in a config may also be "auto": bfloat16 where the host computes it fastest (GPU, TPU,
# a CPU with bfloat16 dot instructions), float32 elsewhere (model/precision.py auto_dtype); the
# model's own dtype is always one of DTYPES
COMPUTE_DTYPES: tuple[str, ...] = ("auto", *DTYPES)
# model.attention: how the full-sequence passes (prompt prefill, scoring, the update) attend (model/attention.py).
# "auto" (default): cuDNN on a GPU for bfloat16 (xla for float32), splash on a TPU, blockwise on a CPU; "xla"
# materialises the [T, T] scores (every platform); "cudnn" is cuDNN's fused attention (a GPU, bfloat16);
# "blockwise" FlashAttention in plain JAX (every platform, memory linear in T, forward and backward); "splash"
# TPU's Pallas kernel (a TPU, or a program lowered for one). Decoding uses the Pallas kernel (GPU / TPU) or XLA
# (CPU) either way.
ATTENTION: tuple[str, ...] = ("auto", "xla", "cudnn", "blockwise", "splash")


def check_attention(attention: str, dtype: str) -> None:
    """model.attention is one of ATTENTION, and cuDNN's only with bfloat16 compute. The platform
    is checked where the program is traced or lowered (model/attention.py): a CPU may lower a
    TPU's program, so splash is no error here."""
    check_in("model.attention", attention, ATTENTION)
    if attention == "cudnn" and dtype not in ("bfloat16", "auto"):  # auto is bfloat16 on a GPU
        raise ValueError(
            f"model.attention=cudnn needs model.dtype=bfloat16 (cuDNN's fused attention takes no {dtype}): "
            "set model.dtype=bfloat16 or model.attention=auto, blockwise or xla"
        )


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 ("llama3") RoPE frequency scaling; see HF `_compute_llama3_parameters`."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            check_positive(f"model.rope_scaling.{name}", getattr(self, name))
        check_at_least("model.rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings, 1)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (Qwen2/Qwen2.5, Llama 3.x, Qwen3)."""

    family: str = "qwen2"  # a registered model family (model/families/)
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    d_ff: int = 128
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    qkv_bias: bool = False  # Qwen2: True; Llama: `attention_bias`
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    max_seq_len: int = 2048
    dtype: str = "float32"  # compute: weights as the forward reads them, activations, KV cache
    param_dtype: str = "float32"  # the master weights (and so the optimizer state) the update steps
    attention: str = "auto"  # the full-sequence passes' attention (ATTENTION)
    # the learner's full-sequence passes (the update, scoring: transformer.forward) run the layers as one
    # lax.scan over their weights stacked on a leading axis: one compiled block instead of n_layers copies
    # (compile time flat in depth, MaxText's scan_layers); a sampler's prefill and decode stay unrolled
    scan_layers: bool = False
    # how a projection in a narrow model.dtype accumulates: "output" (the dot returns model.dtype),
    # "float32" (a float32 result rounded to model.dtype; XLA:CPU then uses its bfloat16 dot
    # instructions), "auto" (float32 on CPU, output elsewhere; model/precision.py)
    dot_accumulation: str = "auto"
    head_backward: str = "float32"  # HEAD_BACKWARDS
    attention_backward: str = "autodiff"  # ATTENTION_BACKWARDS
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0

    def __post_init__(self):
        check_in("model.family", self.family, tuple(FAMILY_REGISTRY))
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "max_seq_len"):
            check_at_least(f"model.{name}", getattr(self, name), 1)
        check_multiple("model.n_heads", self.n_heads, "model.n_kv_heads", self.n_kv_heads)
        check_at_least("model.pad_token_id", self.pad_token_id, 0)
        check_positive("model.rope_theta", self.rope_theta)
        check_positive("model.norm_eps", self.norm_eps)
        check_in("model.dtype", self.dtype, DTYPES)
        check_in("model.param_dtype", self.param_dtype, DTYPES)
        check_attention(self.attention, self.dtype)
        check_in("model.dot_accumulation", self.dot_accumulation, DOT_ACCUMULATIONS)
        check_in("model.head_backward", self.head_backward, HEAD_BACKWARDS)
        check_in("model.attention_backward", self.attention_backward, ATTENTION_BACKWARDS)
        for name in ("tie_embeddings", "qkv_bias", "qk_norm", "scan_layers"):
            check_bool(f"model.{name}", getattr(self, name))
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even for RoPE")

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    @classmethod
    def tiny(cls, family: str = "qwen2", **overrides) -> ModelConfig:
        """A small model of the given family (its switches and RoPE variant) for CPU tests and the
        default experiment."""
        check_in("model.family", family, tuple(FAMILY_REGISTRY))
        fam = FAMILY_REGISTRY[family]
        base = dict(
            family=family,
            qkv_bias=fam.qkv_bias,
            qk_norm=fam.qk_norm,
            rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=64) if fam.rope == "llama3" else None,
        )
        base.update(overrides)
        return cls(**base)


def check_sequence_length(cfg: ModelConfig, prompt_len: int, max_new_tokens: int, *, prompt: str, new: str) -> None:
    """A prompt of `prompt_len` tokens plus `max_new_tokens` must fit the model's positions
    (max_seq_len, HF's max_position_embeddings); the error names the two settings (`prompt`,
    `new`) the caller reads them from."""
    total = prompt_len + max_new_tokens
    if total > cfg.max_seq_len:
        raise ValueError(
            f"{prompt}={prompt_len} + {new}={max_new_tokens} = {total} exceeds the model's max_seq_len="
            f"{cfg.max_seq_len} (max_position_embeddings)"
        )


def matmul_params(cfg: ModelConfig) -> int:
    """Weights a token multiplies by: every block's projections and the LM head (the input
    embedding, a gather, not counted; tied or not, the head once)."""
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    attn = 2 * D * N * H + 2 * D * K * H
    return cfg.n_layers * (attn + 3 * D * cfg.d_ff) + cfg.vocab_size * D


def param_count(cfg: ModelConfig) -> int:
    """Closed-form parameter count (checked against jax.eval_shape in the tests)."""
    D, N, K, H, F, V = (
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.d_ff,
        cfg.vocab_size,
    )
    attn = D * N * H + 2 * D * K * H + N * H * D
    if cfg.qkv_bias:
        attn += N * H + 2 * K * H
    if cfg.qk_norm:
        attn += 2 * H
    per_layer = attn + 3 * D * F + 2 * D
    embed = V * D * (1 if cfg.tie_embeddings else 2)
    return cfg.n_layers * per_layer + embed + D
