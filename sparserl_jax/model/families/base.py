"""A model family: the Hugging Face architecture its checkpoints name and the structural switches
of the transformer (model/transformer.py) it fixes. `FAMILIES` holds one entry per family, each
registered in its own file of this package; model.family names one, hf_config reads and writes
config.json through it, and ModelConfig.tiny builds a small model of it (docs/layout.md, "A model
family")."""

from __future__ import annotations

import dataclasses
from typing import Any

from sparserl_jax.registry import Registry

ROPE_TYPES: tuple[str, ...] = ("default", "llama3")  # the RoPE variants the transformer implements


@dataclasses.dataclass(frozen=True)
class Family:
    """`name` is model.family and config.json's model_type; `architecture` config.json's
    architectures[0] (a causal LM head). `qkv_bias`: the q/k/v projections carry biases (Qwen2);
    `qk_norm`: per-head RMSNorm on q and k before RoPE (Qwen3); `rope`: the RoPE variant its
    checkpoints use (ModelConfig.tiny gives a small model of it that scaling); `config_extra`:
    config.json keys its export writes with these fixed values (what its HF class reads to stay
    the architecture this transformer implements)."""

    name: str
    architecture: str
    qkv_bias: bool = False
    qk_norm: bool = False
    rope: str = "default"
    config_extra: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        if self.rope not in ROPE_TYPES:
            raise ValueError(f"model family {self.name!r}: rope={self.rope!r}, expected one of {ROPE_TYPES}")


FAMILIES: Registry = Registry("model family")
