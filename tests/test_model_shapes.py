"""Parameter shapes and counts of real architectures via jax.eval_shape (nothing allocated),
checked against config.param_count and the published figures."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from sparserl_jax.model import sharding as shd
from sparserl_jax.model.config import ModelConfig, param_count

ARCHS = {
    # name: (config, published parameter count)
    "Qwen2.5-7B": (
        ModelConfig(
            family="qwen2",
            vocab_size=152064,
            d_model=3584,
            n_layers=28,
            n_heads=28,
            n_kv_heads=4,
            head_dim=128,
            d_ff=18944,
            tie_embeddings=False,
            qkv_bias=True,
        ),
        7_615_616_512,
    ),
    "Qwen2.5-0.5B": (
        ModelConfig(
            family="qwen2",
            vocab_size=151936,
            d_model=896,
            n_layers=24,
            n_heads=14,
            n_kv_heads=2,
            head_dim=64,
            d_ff=4864,
            tie_embeddings=True,
            qkv_bias=True,
        ),
        494_032_768,
    ),
    "Llama-3.1-8B": (
        ModelConfig(
            family="llama",
            vocab_size=128256,
            d_model=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            head_dim=128,
            d_ff=14336,
            tie_embeddings=False,
        ),
        8_030_261_248,
    ),
    "Qwen3-8B": (
        ModelConfig(
            family="qwen3",
            vocab_size=151936,
            d_model=4096,
            n_layers=36,
            n_heads=32,
            n_kv_heads=8,
            head_dim=128,
            d_ff=12288,
            tie_embeddings=False,
            qk_norm=True,
        ),
        8_190_735_360,
    ),
}


@pytest.mark.parametrize("name", ["Qwen2.5-7B", "Qwen2.5-0.5B", "Llama-3.1-8B", "Qwen3-8B"])
def test_eval_shape_param_count_matches_published(name):
    cfg, published = ARCHS[name]
    shapes = shd.abstract_params(cfg)
    leaves = jax.tree_util.tree_leaves(shapes)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert sum(int(np.prod(x.shape)) for x in leaves) == param_count(cfg) == published
    layer = shapes["layers"][-1]
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    assert len(shapes["layers"]) == cfg.n_layers
    assert layer["q"].shape == (D, N, H) and layer["k"].shape == (D, K, H)
    assert layer["o"].shape == (N, H, D) and layer["down"].shape == (cfg.d_ff, D)
    assert ("lm_head" in shapes) == (not cfg.tie_embeddings)
    assert ("q_bias" in layer) == cfg.qkv_bias and ("q_norm" in layer) == cfg.qk_norm
