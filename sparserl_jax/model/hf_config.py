"""ModelConfig <-> Hugging Face config.json, for Qwen2/Qwen2.5, Llama 3.x and Qwen3 checkpoints.

Reads both RoPE spellings: transformers >= 5 writes `rope_parameters` (with `rope_theta` inside),
older files hold `rope_theta` at the top level and the scaling in `rope_scaling` (key `type` or
`rope_type`). When a file has both, `rope_scaling` wins, as in transformers 4.x and 5.x. Export
writes both spellings, so transformers 4.x, 5.x and other readers (vLLM) load the result.
"""

from __future__ import annotations

from typing import Any

from sparserl_jax.model.config import ModelConfig, RopeScaling
from sparserl_jax.model.families import FAMILIES, ROPE_TYPES

DTYPES: tuple[str, ...] = ("float32", "bfloat16")


def architectures() -> dict[str, str]:
    """HF architecture name -> our family (model/families/, read at each call: a family registered
    later counts); the only heads this model implements (causal LM)."""
    return {f.architecture: f.name for f in FAMILIES.values()}


def family_from_hf(hf: dict[str, Any]) -> str:
    """Our family from `architectures` (or `model_type` when a file lists no architecture)."""
    archs, known = hf.get("architectures") or [], architectures()
    for arch in archs:
        if arch in known:
            return known[arch]
    model_type = hf.get("model_type")
    if not archs and model_type in known.values():
        return model_type
    raise ValueError(
        f"config.json architectures={archs} (model_type={model_type!r}) is not supported: "
        f"supported architectures are {tuple(known)}"
    )


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from either RoPE spelling."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # nested per layer type
        variants = list(params.values())
        if any(v != variants[0] for v in variants):
            raise ValueError(f"config.json rope_parameters differ per layer type ({params}); expected one RoPE")
        params = variants[0]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.json rope_type={rope_type!r} is not supported: expected one of {ROPE_TYPES}")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"config.json partial_rotary_factor={partial} is not supported: expected 1.0")
    other = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", other.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return float(theta), None
    scaling = RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
        ),
    )
    return float(theta), scaling


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def _check_supported(hf: dict[str, Any], family: str) -> None:
    """Refuse architecture variants whose extra parts this model has no slot for."""
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"config.json hidden_act={act!r} is not supported: expected 'silu'")
    if hf.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true is not supported: expected false (no MLP biases)")
    if not FAMILIES[family].qkv_bias and hf.get("attention_bias"):
        raise ValueError(
            f"config.json attention_bias=true ({family}) is not supported: it adds an o_proj bias; expected false"
        )
    if hf.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window=true is not supported: expected false (full attention)")
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"config.json layer_types={layer_types} is not supported: expected only 'full_attention'")


def config_from_hf(
    hf: dict[str, Any], generation: dict[str, Any] | None = None, dtype: str | None = None
) -> ModelConfig:
    """ModelConfig from a parsed config.json (and generation_config.json, whose eos/pad ids are
    merged in: chat checkpoints list their end-of-turn token there). `dtype` None keeps the
    checkpoint's dtype when it is float32 or bfloat16, else float32; it is both the compute and
    the parameter dtype (hf.load_params returns the weights in it)."""
    family = family_from_hf(hf)
    _check_supported(hf, family)
    generation = generation or {}
    if dtype is None:
        stored = hf.get("dtype") or hf.get("torch_dtype")
        dtype = stored if stored in DTYPES else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {DTYPES}")
    rope_theta, rope_scaling = _rope_from_hf(hf)
    d_model, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    eos = tuple(dict.fromkeys(_ids(hf.get("eos_token_id")) + _ids(generation.get("eos_token_id"))))
    pad = hf.get("pad_token_id")
    if pad is None:
        pad = generation.get("pad_token_id")
    if pad is None:
        pad = eos[0] if eos else 0
    bos = hf.get("bos_token_id")
    if bos is None:
        bos = generation.get("bos_token_id")
    return ModelConfig(
        family=family,
        vocab_size=int(hf["vocab_size"]),
        d_model=d_model,
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=int(hf.get("head_dim") or d_model // n_heads),
        d_ff=int(hf["intermediate_size"]),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=FAMILIES[family].qkv_bias,  # a family's biases are its own; others refused above
        qk_norm=FAMILIES[family].qk_norm,
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        dtype=dtype,
        param_dtype=dtype,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos,
        pad_token_id=int(pad),
    )


def _eos_json(cfg: ModelConfig):
    if not cfg.eos_token_ids:
        return None
    return cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids)


def config_to_hf(cfg: ModelConfig, dtype: str | None = None) -> dict[str, Any]:
    """config.json contents for `cfg` (the inverse of config_from_hf); `dtype` names the stored
    tensors' dtype (default cfg.dtype)."""
    fam = FAMILIES[cfg.family]
    arch = fam.architecture
    for switch in ("qkv_bias", "qk_norm"):
        if getattr(cfg, switch) != getattr(fam, switch):
            raise ValueError(
                f"model.{switch}={getattr(cfg, switch)} cannot be exported as {arch}: "
                f"expected {switch}={getattr(fam, switch)} for family {cfg.family!r}"
            )
    dtype = dtype or cfg.dtype
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        sc = cfg.rope_scaling
        rope = {
            "rope_type": "llama3",
            "rope_theta": cfg.rope_theta,
            "factor": sc.factor,
            "low_freq_factor": sc.low_freq_factor,
            "high_freq_factor": sc.high_freq_factor,
            "original_max_position_embeddings": sc.original_max_position_embeddings,
        }
    hf: dict[str, Any] = {
        "architectures": [arch],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": _eos_json(cfg),
        "pad_token_id": cfg.pad_token_id,
        "dtype": dtype,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if cfg.rope_scaling is not None:
        hf["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    hf.update(dict(fam.config_extra))
    return hf


def generation_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """generation_config.json contents: the special token ids."""
    return {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": _eos_json(cfg),
        "pad_token_id": cfg.pad_token_id,
    }
