"""Tiny random Hugging Face checkpoints for parity tests: Qwen2 (q/k/v biases, tied), Llama 3
(rope_theta 500000, "llama3" RoPE scaling, untied) and Qwen3 (q/k norms, head_dim 24 != D/N, tied).

Weights are redrawn after construction: matrices and biases N(0, 0.1^2) (transformers zeroes
biases and sets norms to 1, which would hide mapping mistakes), norm weights 1 + N(0, 0.1^2).
The larger-than-default scale makes the logits far from flat, so greedy argmaxes never tie.
torch and transformers are imported lazily: importing this module costs nothing.
"""

from __future__ import annotations

from pathlib import Path

HF_FAMILIES: tuple[str, ...] = ("qwen2", "llama", "qwen3")

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
_FAMILY = {
    "qwen2": dict(
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "llama": dict(
        rope_theta=500_000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=[2, 3],
    ),
    "qwen3": dict(
        head_dim=24,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_id=5,
        pad_token_id=0,
    ),
}


def tiny_hf_config(family: str, tie: bool | None = None, **overrides):
    """A transformers config of the tiny model of `family` (hidden 64, 2 layers, vocab 256)."""
    import transformers

    cls = {
        "qwen2": transformers.Qwen2Config,
        "llama": transformers.LlamaConfig,
        "qwen3": transformers.Qwen3Config,
    }
    kwargs = {**_COMMON, **_FAMILY[family], **overrides}
    if tie is not None:
        kwargs["tie_word_embeddings"] = tie
    return cls[family](**kwargs)


def make_tiny_hf_model(family: str, tie: bool | None = None, seed: int = 0, **overrides):
    """A tiny random float32 transformers causal LM (eval mode), norms and biases non-trivial."""
    import torch
    import transformers

    cfg = tiny_hf_config(family, tie, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)
    return model


def make_tiny_hf_checkpoint(
    family: str,
    tmp_path: Path,
    tie: bool | None = None,
    sharded: bool = False,
    dtype: str = "float32",
    seed: int = 0,
    **overrides,
) -> Path:
    """Build a tiny random model and save_pretrained it under tmp_path; returns the directory.
    `sharded` splits it into many files (max_shard_size 20 kB) with model.safetensors.index.json;
    dtype "bfloat16" stores the same weights rounded to bfloat16."""
    import torch

    model = make_tiny_hf_model(family, tie, seed, **overrides)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    name = f"{family}-tie{tie}-sharded{sharded}-{dtype}-seed{seed}" + "".join(f"-{k}{v}" for k, v in overrides.items())
    directory = Path(tmp_path) / name
    kwargs = {"max_shard_size": "20KB"} if sharded else {}
    model.save_pretrained(directory, **kwargs)
    return directory


def load_hf_model(directory: Path):
    """transformers AutoModelForCausalLM from a directory, float32, eval mode."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory).float().eval()
