"""Our rollout sampler (dense and sparse) against Hugging Face `generate` on one CPU core.

A random model of the chosen shape is written as an HF checkpoint (sparserl_jax.model.hf) and
loaded by transformers (torch, float32), so both engines run the same weights. Each engine decodes
greedily exactly --new-tokens tokens after a random --prompt-len prompt (no EOS), at each --batch.
Engines run one thread each (torch.set_num_threads(1); XLA CPU without its thread pool, set by
xla_one_thread.py before jax starts its backend; run the script under `taskset -c 1` to pin the
process to one core), and their calls are interleaved (dense, sparse, HF, dense, ...) so background
load falls on all alike. The median call per engine is reported, with ours/HF and sparse/dense
tokens/s ratios.
Targets (a benchmark, not a test): dense >= 1.0x HF at batch 1 and >= 1.5x at batch 8.

    taskset -c 1 python experiments/bench/bench_vs_hf.py            # experiments/results/bench_vs_hf.{json,md}
    taskset -c 1 python experiments/bench/bench_vs_hf.py --smoke    # seconds: a tiny shape, one repeat
    # a real model: SmolLM2-135M-Instruct (python -m sparserl_jax.fetch smollm2-135m-instruct ...)
    taskset -c 1 python experiments/bench/bench_vs_hf.py --checkpoint checkpoints/smollm2-135m \
        --batch 1 8 32 --out experiments/results/bench_vs_hf_smollm2.json

Compile time (AOT lower + compile) and HF's first call are excluded from the medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib import figprov
from experiments.lib.xla_one_thread import xla_flags  # before the backend starts
from sparserl_jax.kvcache import KVConfig
from sparserl_jax.model import hf, transformer
from sparserl_jax.model.config import ModelConfig, param_count
from sparserl_jax.rollout.sampler import SamplerConfig, generate
from sparserl_jax.rollout.sampling import SamplingConfig

# Qwen2-shaped, 40.5M parameters: small enough that the whole run stays within ~5 minutes on
# one shared core (the issue's 315M shape is 5x slower per step).
MODEL = ModelConfig(
    family="qwen2",
    vocab_size=32000,
    d_model=512,
    n_layers=8,
    n_heads=8,
    n_kv_heads=2,
    head_dim=64,
    d_ff=1536,
    rope_theta=1e6,
    tie_embeddings=True,
    qkv_bias=True,
    max_seq_len=4096,
)
SMOKE_MODEL = ModelConfig.tiny("qwen2", vocab_size=256)
TARGETS = {1: 1.0, 8: 1.5}  # dense tokens/s over HF's, per batch size


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per engine and batch")
    p.add_argument("--policy", default="streaming", help="eviction policy of the sparse engine")
    p.add_argument("--budget", type=int, default=64, help="sparse kv.budget")
    p.add_argument("--buffer", type=int, default=32, help="kv.buffer (the dense loop's chunk too)")
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny model, 16 new tokens, 1 repeat")
    p.add_argument(
        "--checkpoint",
        default=None,
        help="a Hugging Face checkpoint directory to run instead of the random model "
        "(both engines load its weights; float32)",
    )
    p.add_argument("--out", default=os.path.join("experiments", "results", "bench_vs_hf.json"))
    args = p.parse_args(argv)
    if args.smoke:
        args.new_tokens, args.repeats, args.prompt_len = 16, 1, 8
        args.budget, args.buffer, args.window = 8, 8, 2
    return args


def machine() -> dict:
    """CPU model, core count, the process's CPU affinity and library versions."""
    import torch
    import transformers

    return dict(
        cpu=figprov.cpu_model(),
        cpus=os.cpu_count(),
        affinity=sorted(os.sched_getaffinity(0)),
        python=platform.python_version(),
        jax=jax.__version__,
        torch=torch.__version__,
        transformers=transformers.__version__,
        xla_flags=xla_flags(),
        torch_threads=torch.get_num_threads(),
    )


def ours(params, model: ModelConfig, kv: KVConfig, prompts, lengths, new_tokens: int):
    """A timed call of our compiled sampler: () -> generated tokens [B, new_tokens] (numpy)."""
    cfg = SamplerConfig(max_new_tokens=new_tokens, sampling=SamplingConfig(temperature=0.0), kv=kv, eos_token_ids=())
    compiled = (
        jax.jit(generate, static_argnames=("model_cfg", "cfg"))
        .lower(params, model, prompts, lengths, jax.random.key(0), cfg)
        .compile()
    )

    def call():
        out = jax.block_until_ready(compiled(params, prompts, lengths, jax.random.key(0)))
        if int(jnp.min(out.lengths)) != new_tokens:
            raise RuntimeError("a sequence stopped early; the timing assumes full-length rows")
        return np.asarray(out.tokens)

    return call


def huggingface(hf_model, prompts, new_tokens: int):
    """A timed call of transformers generate (greedy, exactly new_tokens): () -> tokens."""
    import torch

    input_ids = torch.from_numpy(np.asarray(prompts, np.int64))
    mask = torch.ones_like(input_ids)

    def call():
        with torch.inference_mode():
            out = hf_model.generate(
                input_ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[:, input_ids.shape[1] :].numpy()

    return call


def bench_batch(params, hf_model, model: ModelConfig, args, batch: int) -> dict:
    """Interleaved timed calls of the three engines at one batch size; medians and ratios."""
    key = jax.random.key(args.seed + batch)
    prompts = jax.random.randint(key, (batch, args.prompt_len), 1, model.vocab_size, jnp.int32)
    lengths = jnp.full((batch,), args.prompt_len, jnp.int32)
    dense = KVConfig(policy="none", buffer=args.buffer)
    sparse = KVConfig(policy=args.policy, budget=args.budget, buffer=args.buffer, window=args.window)
    t0 = time.perf_counter()
    sparse_name = f"ours_sparse_{args.policy}"
    engines = {
        "ours_dense": ours(params, model, dense, prompts, lengths, args.new_tokens),
        sparse_name: ours(params, model, sparse, prompts, lengths, args.new_tokens),
        "hf_generate": huggingface(hf_model, prompts, args.new_tokens),
    }
    compile_s = time.perf_counter() - t0
    tokens = {name: call() for name, call in engines.items()}  # warm-up, untimed
    seconds = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, call in engines.items():
            t = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - t)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    tok_s = {name: batch * args.new_tokens / s for name, s in median.items()}
    return dict(
        batch=batch,
        compile_s=compile_s,
        seconds=seconds,
        median_s=median,
        tokens_per_s=tok_s,
        dense_over_hf=tok_s["ours_dense"] / tok_s["hf_generate"],
        sparse_over_hf=tok_s[sparse_name] / tok_s["hf_generate"],
        sparse_over_dense=tok_s[sparse_name] / tok_s["ours_dense"],
        target_dense_over_hf=TARGETS.get(batch),
        # Greedy tokens of our dense sampler equal to HF's (float32 rounding may flip near-ties).
        greedy_match_dense_vs_hf=float(np.mean(tokens["ours_dense"] == tokens["hf_generate"])),
    )


def markdown(report: dict) -> str:
    m, s, mc = report["model"], report["setting"], report["machine"]
    lines = [
        "# Our sampler vs Hugging Face generate (one CPU core each)",
        "",
        f"`{report['command']}`",
        "",
        f"{report['date']}; {mc['cpu']} ({mc['cpus']} CPUs, process pinned to {mc['affinity']}); "
        f"python {mc['python']}, jax {mc['jax']}, torch {mc['torch']}, transformers "
        f"{mc['transformers']}; XLA_FLAGS `{mc['xla_flags']}`, torch threads "
        f"{mc['torch_threads']}.",
        "",
        f"Model: {m['family']} V={m['vocab_size']} D={m['d_model']} L={m['n_layers']} "
        f"N={m['n_heads']} K={m['n_kv_heads']} H={m['head_dim']} F={m['d_ff']} {m['dtype']}, "
        f"{report['n_params'] / 1e6:.1f}M parameters{', tied embeddings' if m['tie_embeddings'] else ''}"
        f"{' (' + report['checkpoint'] + ')' if report.get('checkpoint') else ''}. Greedy, prompt "
        f"{s['prompt_len']} tokens, exactly {s['new_tokens']} new tokens per row (no EOS). Sparse: "
        f"{s['policy']} budget {s['budget']} + buffer {s['buffer']} (window {s['window']}); dense "
        f"decodes in chunks of the same buffer. Median of {s['repeats']} interleaved timed calls "
        f"per engine after one untimed call (prefill included). Run time "
        f"{report['total_s']:.0f} s.",
        "",
        "| batch | ours dense tok/s | ours sparse tok/s | HF generate tok/s | dense / HF | "
        "target | sparse / HF | sparse / dense | greedy tokens equal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        t = list(r["tokens_per_s"].values())
        target = r["target_dense_over_hf"]
        verdict = "n/a" if target is None else (f">= {target:g}: {'met' if r['dense_over_hf'] >= target else 'missed'}")
        lines.append(
            f"| {r['batch']} | {t[0]:.1f} | {t[1]:.1f} | {t[2]:.1f} | {r['dense_over_hf']:.2f}x | "
            f"{verdict} | {r['sparse_over_hf']:.2f}x | {r['sparse_over_dense']:.2f}x | "
            f"{r['greedy_match_dense_vs_hf']:.1%} |"
        )
    lines += ["", "Per-call seconds of every engine are in the JSON next to this file."]
    return "\n".join(lines)


def main(argv=None) -> dict:
    import torch
    import transformers

    torch.set_num_threads(1)
    args = parse_args(argv)
    if args.checkpoint:
        model, params = hf.load_params(args.checkpoint, dtype="float32")
    else:
        model = SMOKE_MODEL if args.smoke else MODEL
    need = args.prompt_len + args.new_tokens + args.buffer
    model = dataclasses.replace(model, max_seq_len=max(model.max_seq_len, need))
    report = dict(
        command=shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=machine(),
        model=dataclasses.asdict(model),
        n_params=param_count(model),
        checkpoint=args.checkpoint,
        setting=dict(
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            repeats=args.repeats,
            policy=args.policy,
            budget=args.budget,
            buffer=args.buffer,
            window=args.window,
            seed=args.seed,
        ),
        results=[],
    )
    t_start = time.perf_counter()
    if args.checkpoint:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(args.checkpoint, torch_dtype=torch.float32).eval()
    else:
        params = transformer.init_params(model, jax.random.key(args.seed))
        params = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, params)  # non-flat logits
        with tempfile.TemporaryDirectory() as ckpt:
            hf.save_params(ckpt, model, params)
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).float().eval()
    for batch in args.batch:
        row = bench_batch(params, hf_model, model, args, batch)
        report["results"].append(row)
        print(
            f"batch {batch}: "
            + ", ".join(f"{k} {v:.1f} tok/s" for k, v in row["tokens_per_s"].items())
            + f"; dense/HF {row['dense_over_hf']:.2f}x, sparse/dense "
            f"{row['sparse_over_dense']:.2f}x",
            flush=True,
        )
    report["total_s"] = time.perf_counter() - t_start
    figprov.write_report(args.out, report, markdown(report), indent=2)
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
