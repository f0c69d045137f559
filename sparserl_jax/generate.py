"""Generate continuations from a Hugging Face checkpoint directory, dense or with a sparse KV cache.

  python -m sparserl_jax.generate --checkpoint DIR --prompt TEXT [--prompt TEXT ...]
      --max-new-tokens N [--temperature T] [--top-p P] [--top-k K] [--draw D] [--seed S] [--chat]
      [--kv-policy {none,streaming,h2o,snapkv,rkv,random} --kv-budget B --kv-buffer U ...]
      [--output-json FILE]

Temperature 0 means greedy. --output-json writes, per prompt, the prompt token ids, the generated
token ids and the per-token log-probs of the generated tokens (under the sampled distribution).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparserl_jax import cli, host_memory, quant
from sparserl_jax import kvcache as kv
from sparserl_jax.kvcache.policies import POLICIES
from sparserl_jax.model import hf
from sparserl_jax.model.config import ModelConfig, check_sequence_length
from sparserl_jax.rollout.sampler import SamplerConfig, cache_capacity, generate_jit
from sparserl_jax.rollout.sampling import DRAWS, SamplingConfig
from sparserl_jax.tokenizer import HFTokenizer


def encode_prompts(tokenizer: HFTokenizer, prompts: Sequence[str], chat: bool) -> list[list[int]]:
    """Token ids per prompt: chat prompts go through the chat template (which writes its own
    special tokens); plain prompts get the tokenizer's special tokens (e.g. Llama's BOS)."""
    if chat:
        if tokenizer.chat_template is None:
            raise ValueError(
                f"--chat: the tokenizer in {tokenizer.source} has no chat template "
                "(tokenizer_config.json 'chat_template' or chat_template.jinja); drop --chat"
            )
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        return [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    return [tokenizer.encode(p, add_special_tokens=True) for p in prompts]


def pad_prompts(ids: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad to the longest prompt: ([B, P] tokens, [B] lengths)."""
    if any(len(x) == 0 for x in ids):
        raise ValueError("--prompt: a prompt encodes to zero tokens")
    P = max(len(x) for x in ids)
    tokens = np.full((len(ids), P), pad_id, np.int32)
    for i, x in enumerate(ids):
        tokens[i, : len(x)] = x
    return tokens, np.array([len(x) for x in ids], np.int32)


def check_lengths(model_cfg: ModelConfig, prompt_len: int, max_new_tokens: int) -> None:
    """The longest prompt plus --max-new-tokens within the model's positions."""
    check_sequence_length(model_cfg, prompt_len, max_new_tokens, prompt="the longest prompt", new="--max-new-tokens")


# --kv-* flag -> KVConfig field
KV_FLAGS = {
    "kv_policy": "policy",
    "kv_budget": "budget",
    "kv_buffer": "buffer",
    "kv_window": "window",
    "kv_pool_kernel": "pool_kernel",
    "kv_lambda": "rkv_lambda",
    "kv_redundancy_threshold": "redundancy_threshold",
    "kv_sinks": "n_sinks",
    "kv_selection": "selection",
    "kv_compress_prompt": "compress_prompt",
    "kv_trigger": "trigger",
}


def check_flags(args: argparse.Namespace, **minimum) -> None:
    """--flag values below their minimum (e.g. max_new_tokens=1) are errors naming the flag."""
    for name, low in minimum.items():
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise ValueError(f"--{name.replace('_', '-')}={value} must be >= {low}")


def kv_config_from_args(
    args: argparse.Namespace, tokenizer: HFTokenizer, base: kv.KVConfig | None = None
) -> kv.KVConfig:
    """The --kv-* flags given on top of `base` (default KVConfig(), dense); a bad value is an
    error naming the flag."""
    base = base or kv.KVConfig()
    given = {field: getattr(args, flag) for flag, field in KV_FLAGS.items() if getattr(args, flag) is not None}
    trigger = given.get("trigger", base.trigger)
    given["newline_token_ids"] = tuple(sorted(tokenizer.newline_token_ids)) if trigger == "newline" else ()
    try:
        return dataclasses.replace(base, **given)
    except ValueError as e:  # name the flag the user typed instead of the config setting
        msg = str(e)
        for flag, field in KV_FLAGS.items():
            msg = msg.replace(f"kv.{field}", "--" + flag.replace("_", "-"))
        raise ValueError(msg) from None


def check_cache(model_cfg: ModelConfig, kv_cfg: kv.KVConfig, batch: int, prompt_len: int, max_new_tokens: int) -> int:
    """Bytes of the KV cache the sampler will allocate; an error with the figure when its slots
    exceed the model's maximum length or the bytes exceed the device's (or host's) free memory."""
    if not kv_cfg.is_dense and kv_cfg.budget + kv_cfg.buffer > model_cfg.max_seq_len:
        raise ValueError(
            f"--kv-budget={kv_cfg.budget} + --kv-buffer={kv_cfg.buffer} is beyond the model's "
            f"max_position_embeddings={model_cfg.max_seq_len}"
        )
    slots = cache_capacity(kv_cfg, prompt_len, max_new_tokens)
    itemsize = jnp.dtype(model_cfg.dtype).itemsize
    nbytes = 2 * batch * slots * model_cfg.n_layers * model_cfg.n_kv_heads * model_cfg.head_dim * itemsize
    free = free_memory_bytes()
    if free is not None and nbytes > free:
        raise ValueError(
            f"the KV cache would take {nbytes / 2**30:.1f} GiB ({batch} rows x {slots} slots) but only "
            f"{free / 2**30:.1f} GiB are free: lower --kv-budget, --max-new-tokens or the prompts"
        )
    return nbytes


def free_memory_bytes() -> int | None:
    """Free memory of the first device (its allocator's limit minus use), or the host's available
    memory on CPU; None when unknown."""
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_finite(logprobs, what: str) -> None:
    """Non-finite log-probs mean the model's logits were NaN/inf: fail instead of writing them."""
    if not np.all(np.isfinite(np.asarray(logprobs))):
        raise cli.RunFailed(
            f"{what}: the model produced non-finite log-probabilities (NaN or inf "
            "logits); check the checkpoint's weights and --dtype"
        )


def add_kv_args(p: argparse.ArgumentParser) -> None:
    """The sparse KV cache flags (one per KVConfig setting), shared with the evaluator."""
    kvd = kv.KVConfig()
    g = p.add_argument_group(
        "sparse KV cache (docs/methods.md#kv-compression; a flag not given "
        "keeps the run's setting, or the default shown)"
    )
    g.add_argument("--kv-policy", choices=sorted(POLICIES), default=None, help="default: none (dense)")
    g.add_argument("--kv-budget", type=int, default=None, help=f"default {kvd.budget}")
    g.add_argument("--kv-buffer", type=int, default=None, help=f"default {kvd.buffer}")
    g.add_argument("--kv-window", type=int, default=None, help=f"default {kvd.window}")
    g.add_argument("--kv-pool-kernel", type=int, default=None, help=f"default {kvd.pool_kernel}")
    g.add_argument("--kv-lambda", type=float, default=None, help=f"default {kvd.rkv_lambda}")
    g.add_argument("--kv-redundancy-threshold", type=float, default=None, help=f"default {kvd.redundancy_threshold}")
    g.add_argument("--kv-sinks", type=int, default=None, help=f"default {kvd.n_sinks}")
    g.add_argument("--kv-selection", choices=["per_head", "shared"], default=None)
    g.add_argument("--kv-compress-prompt", action="store_true", default=None)
    g.add_argument("--kv-trigger", choices=["interval", "newline"], default=None)
    g.add_argument("--attn-impl", default="auto", help="decode attention: auto, xla, pallas, interpret")


def add_quant_args(p: argparse.ArgumentParser) -> None:
    """Sample with a quantized copy of the weights (QuRL's behaviour policy), shared with the evaluator."""
    g = p.add_argument_group("quantized sampling (docs/methods.md#quantized-rollouts)")
    g.add_argument("--quant", choices=quant.FORMATS, default="none")
    g.add_argument("--quant-mode", choices=quant.QUANT_MODES, default="w8a8")


def quantized(params, args: argparse.Namespace):
    return quant.quantize_params(params, quant.QuantConfig(format=args.quant, mode=args.quant_mode))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparserl_jax.generate", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="HF directory: config.json, *.safetensors, tokenizer.json")
    p.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--draw", choices=DRAWS, default="gumbel", help="how a token is drawn (rollout.draw)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--output-json", default=None)
    add_kv_args(p)
    add_quant_args(p)
    host_memory.add_host_memory_arg(p)
    return p


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    check_flags(args, max_new_tokens=1, top_k=0, temperature=0.0)
    host_memory.configure(args.host_memory)  # before the checkpoint's load starts JAX's backend
    model_cfg, params = hf.load_params(args.checkpoint, dtype=args.dtype)
    tokenizer = HFTokenizer.from_dir(args.checkpoint)
    ids = encode_prompts(tokenizer, args.prompt, args.chat)
    tokens, lengths = pad_prompts(ids, tokenizer.pad_token_id)
    check_lengths(model_cfg, tokens.shape[1], args.max_new_tokens)
    kv_cfg = kv_config_from_args(args, tokenizer)
    check_cache(model_cfg, kv_cfg, tokens.shape[0], tokens.shape[1], args.max_new_tokens)
    eos = tuple(tokenizer.eos_token_ids) or tuple(model_cfg.eos_token_ids)
    cfg = SamplerConfig(
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingConfig(args.temperature, args.top_p, args.top_k, args.draw),
        kv=kv_cfg,
        eos_token_ids=eos,
        pad_token_id=tokenizer.pad_token_id,
        attn_impl=args.attn_impl,
    )
    out = generate_jit(
        quantized(params, args), model_cfg, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(args.seed), cfg
    )
    out = jax.device_get(out)
    check_finite(np.where(out.mask, out.logprobs, 0.0), "generate")
    results = []
    for i, prompt in enumerate(args.prompt):
        n = int(out.lengths[i])
        gen = [int(t) for t in out.tokens[i, :n]]
        text = tokenizer.decode(gen, skip_special=True)
        results.append(
            {
                "prompt": prompt,
                "prompt_token_ids": ids[i],
                "generated_token_ids": gen,
                "logprobs": [float(x) for x in out.logprobs[i, :n]],
                "text": text,
                "kv_kept_last": int(out.kept[i, n - 1]) if n else 0,
                "kv_compressions": int(out.n_compressions[i]),
            }
        )
        print(f"=== prompt {i}: {prompt!r}\n{text}\n")
    if args.output_json:
        meta = {
            "sampler": dataclasses.asdict(cfg),
            "checkpoint": args.checkpoint,
            "seed": args.seed,
            "quant": {"format": args.quant, "mode": args.quant_mode},
        }
        with open(args.output_json, "w") as f:
            json.dump({"config": meta, "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    cli.run(main)
