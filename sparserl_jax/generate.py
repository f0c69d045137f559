"""Generate continuations from a Hugging Face checkpoint directory, dense or with a sparse KV cache.

  python -m sparserl_jax.generate --checkpoint DIR --prompt TEXT [--prompt TEXT ...]
      --max-new-tokens N [--temperature T] [--top-p P] [--top-k K] [--seed S] [--chat]
      [--kv-policy {none,streaming,h2o,snapkv,rkv,random} --kv-budget B --kv-buffer U ...]
      [--output-json FILE]

Temperature 0 means greedy. --output-json writes, per prompt, the prompt token ids, the generated
token ids and the per-token log-probs of the generated tokens (under the sampled distribution).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparserl_jax import cli, quant
from sparserl_jax import kvcache as kv
from sparserl_jax.kvcache.policies import POLICIES
from sparserl_jax.model import hf
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rollout.sampler import SamplerConfig, generate_jit
from sparserl_jax.rollout.sampling import SamplingConfig
from sparserl_jax.tokenizer import HFTokenizer


def encode_prompts(
    tokenizer: HFTokenizer, prompts: Sequence[str], chat: bool
) -> list[list[int]]:
    """Token ids per prompt: chat prompts go through the chat template (which writes its own
    special tokens); plain prompts get the tokenizer's special tokens (e.g. Llama's BOS)."""
    if chat:
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
    total = prompt_len + max_new_tokens
    if total > model_cfg.max_seq_len:
        raise ValueError(
            f"--max-new-tokens={max_new_tokens} plus the longest prompt ({prompt_len} tokens) is "
            f"{total}, beyond the model's max_position_embeddings={model_cfg.max_seq_len}"
        )


def kv_config_from_args(args: argparse.Namespace, tokenizer: HFTokenizer) -> kv.KVConfig:
    newline_ids = tuple(sorted(tokenizer.newline_token_ids)) if args.kv_trigger == "newline" else ()
    return kv.KVConfig(
        policy=args.kv_policy,
        budget=args.kv_budget,
        buffer=args.kv_buffer,
        window=args.kv_window,
        pool_kernel=args.kv_pool_kernel,
        rkv_lambda=args.kv_lambda,
        redundancy_threshold=args.kv_redundancy_threshold,
        n_sinks=args.kv_sinks,
        selection=args.kv_selection,
        compress_prompt=args.kv_compress_prompt,
        trigger=args.kv_trigger,
        newline_token_ids=newline_ids,
    )


def add_kv_args(p: argparse.ArgumentParser) -> None:
    """The sparse KV cache flags (one per KVConfig setting), shared with the evaluator."""
    kvd = kv.KVConfig()
    g = p.add_argument_group("sparse KV cache (methods.md 1.5)")
    g.add_argument("--kv-policy", choices=sorted(POLICIES), default="none")
    g.add_argument("--kv-budget", type=int, default=kvd.budget)
    g.add_argument("--kv-buffer", type=int, default=kvd.buffer)
    g.add_argument("--kv-window", type=int, default=kvd.window)
    g.add_argument("--kv-pool-kernel", type=int, default=kvd.pool_kernel)
    g.add_argument("--kv-lambda", type=float, default=kvd.rkv_lambda)
    g.add_argument("--kv-redundancy-threshold", type=float, default=kvd.redundancy_threshold)
    g.add_argument("--kv-sinks", type=int, default=kvd.n_sinks)
    g.add_argument("--kv-selection", choices=["per_head", "shared"], default=kvd.selection)
    g.add_argument("--kv-compress-prompt", action="store_true")
    g.add_argument("--kv-trigger", choices=["interval", "newline"], default=kvd.trigger)
    g.add_argument("--attn-impl", default="auto", help="decode attention: auto, xla, pallas, interpret")


def add_quant_args(p: argparse.ArgumentParser) -> None:
    """Sample with a quantized copy of the weights (QuRL's behaviour policy), shared with the evaluator."""
    g = p.add_argument_group("quantized sampling (methods.md 2)")
    g.add_argument("--quant", choices=quant.FORMATS, default="none")
    g.add_argument("--quant-mode", choices=quant.MODES, default="w8a8")


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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--output-json", default=None)
    add_kv_args(p)
    add_quant_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    model_cfg, params = hf.load_params(args.checkpoint, dtype=args.dtype)
    tokenizer = HFTokenizer.from_dir(args.checkpoint)
    ids = encode_prompts(tokenizer, args.prompt, args.chat)
    tokens, lengths = pad_prompts(ids, tokenizer.pad_token_id)
    check_lengths(model_cfg, tokens.shape[1], args.max_new_tokens)
    eos = tuple(tokenizer.eos_token_ids) or tuple(model_cfg.eos_token_ids)
    cfg = SamplerConfig(
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingConfig(args.temperature, args.top_p, args.top_k),
        kv=kv_config_from_args(args, tokenizer),
        eos_token_ids=eos,
        pad_token_id=tokenizer.pad_token_id,
        attn_impl=args.attn_impl,
    )
    out = generate_jit(
        quantized(params, args), model_cfg, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(args.seed), cfg
    )
    out = jax.device_get(out)
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
        meta = {"sampler": dataclasses.asdict(cfg), "checkpoint": args.checkpoint, "seed": args.seed,
                "quant": {"format": args.quant, "mode": args.quant_mode}}
        with open(args.output_json, "w") as f:
            json.dump({"config": meta, "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    cli.run(main)
