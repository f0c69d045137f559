"""Evaluate a policy on a jsonl benchmark, a synthetic task or a suite, with dense or sparse inference.

  python -m sparserl_jax.evaluate --checkpoint DIR [--dataset FILE.jsonl | --task NAME] [--n N]
      [--k 8] [--temperature T] [--top-p P] [--max-new-tokens N]
      [--kv-policy snapkv --kv-budget 512 ...] [--output-json FILE]
  python -m sparserl_jax.evaluate --checkpoint DIR --suite SUITE.yaml [--out DIR] [--kv-policy ...]

DIR is a Hugging Face directory, or a training run directory (config.yaml + checkpoints/, the
newest intact step unless --step). For a run directory every setting not given as a flag is the
run's own (its task and task options, data.max_prompt_len, rollout temperature / top-p /
max_new_tokens, the kv.* knobs; inference is dense unless --kv-policy); for an HF directory the
defaults are the authors' (docs/methods.md#evaluation: temperature 0.8, top-p 0.95, 8192 new
tokens). A length beyond the model's maximum is an error. Reports avg@k: the mean reward over k
samples of every prompt. A suite (eval_suite.py: several jsonl files, each with its own k,
sampling settings and answer format) reports pass@1, pass@k, maj@k and avg@k per benchmark in one
table, written to --out (default: DIR/eval/<suite name> for a run, else eval/<suite name>) as
table.json, table.md, samples.jsonl and TensorBoard scalars at the checkpoint's step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from sparserl_jax import cli, components, distributed, eval_suite, host_memory
from sparserl_jax.checkpoint import restore_params
from sparserl_jax.config import DataConfig, ModelSource, TrainConfig, load_config
from sparserl_jax.data.datasets import PromptExample
from sparserl_jax.data.rewards import get_reward
from sparserl_jax.generate import (
    add_kv_args,
    add_quant_args,
    check_cache,
    check_flags,
    check_lengths,
    kv_config_from_args,
    quantized,
)
from sparserl_jax.kvcache import KVConfig
from sparserl_jax.model import sharding
from sparserl_jax.model.transformer import Params
from sparserl_jax.rollout.layout import check_layout, rollout_mesh
from sparserl_jax.rollout.on_mesh import generate_on_mesh
from sparserl_jax.rollout.prompts import pad_prompt_batch
from sparserl_jax.rollout.sampler import SamplerConfig


def evaluate_examples(
    params,
    model_cfg,
    tokenizer,
    examples: Sequence[PromptExample],
    reward: Callable[[str, str], float],
    sampler_cfg: SamplerConfig,
    *,
    k: int = 1,
    seed: int = 0,
    batch_size: int = 64,
    max_prompt_len: int = 1 << 30,
    mesh=None,
    layout: str = "train",
    on_rollout: Callable | None = None,
) -> dict:
    """avg@k accuracy, mean response length and KV saving of `sampler_cfg` on `examples`.

    `on_rollout(prompt_tokens, prompt_lens, out)`, if given, sees every sampler call's padded
    prompts and RolloutOutput (host arrays), e.g. to score the sampled tokens under another policy.

    With a mesh (`params` laid out on it: the training layout, or the rollout layout already)
    every process passes the same examples; each batch's rows are split over the processes'
    devices and the outputs gathered to all of them, so every process returns the one-process
    numbers. The batches decode on the rollout layout `layout` names (rollout.mesh,
    rollout/layout.py): `params` placed on it once (RolloutMesh.place), then every batch through
    RolloutMesh.generate ("train": on `mesh` as it is, XLA-partitioned; "data", "tensor:N": each
    row group decoding its own rows alone).
    """
    if not examples:
        raise ValueError("evaluation: no examples (empty dataset)")
    check_layout(layout)
    rollout = None if mesh is None else rollout_mesh(layout, mesh)
    if rollout is not None:
        params = rollout.place(params)
    per_batch = max(batch_size // k, 1)
    rewards, lengths, kept, seen, rows, nonfinite = [], [], 0.0, 0.0, [], 0
    for start in range(0, len(examples), per_batch):
        chunk = examples[start : start + per_batch]
        ids = [list(e.prompt_ids) for e in chunk for _ in range(k)]
        tokens, plens = pad_prompt_batch(ids, tokenizer.pad_token_id, max_prompt_len)
        first = start * k  # row r of the whole evaluation is request r: batch size changes nothing
        decode = generate_on_mesh if rollout is None else rollout.generate
        out = decode(
            params,
            model_cfg,
            tokens,
            plens,
            jax.random.key(seed),
            sampler_cfg,
            request_ids=np.arange(first, first + len(ids)),
        )
        if on_rollout is not None:
            on_rollout(tokens, plens, out)
        for i, e in enumerate(x for x in chunk for _ in range(k)):
            n = int(out.lengths[i])
            text = tokenizer.decode(out.tokens[i, :n].tolist())
            r = float(reward(text, e.label))
            rewards.append(r)
            lengths.append(n)
            rows.append({"source": e.source, "label": e.label, "response": text, "reward": r, "length": n})
        mask = out.mask
        nonfinite += int(np.sum(~np.all(np.isfinite(np.where(mask, out.logprobs, 0.0)), axis=1)))
        kept += float(np.sum(out.kept * mask))
        seen += float(np.sum((plens[:, None] + np.arange(mask.shape[1])[None]) * mask))
    return {
        "accuracy": float(np.mean(rewards)),
        "k": k,
        "n_prompts": len(examples),
        "mean_length": float(np.mean(lengths)),
        "kv_saving": 1.0 - kept / max(seen, 1.0),
        "nonfinite_rows": nonfinite,  # responses with a NaN/inf log-prob (NaN logits)
        "samples": rows,
    }


def _load_policy(args) -> tuple[TrainConfig, components.Components]:
    """The config and model: a training run's own config.yaml (every flag not given keeps the
    run's setting), or an HF directory with the built-in defaults."""
    run_config = os.path.join(args.checkpoint, "config.yaml")
    is_run = os.path.exists(run_config)
    if is_run:
        cfg = load_config([run_config])
        if args.dtype:
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=args.dtype))
    else:
        if not os.path.isdir(args.checkpoint):
            raise FileNotFoundError(f"--checkpoint {args.checkpoint!r}: no such directory")
        if not (args.dataset or args.task or args.suite):
            raise ValueError(
                f"--checkpoint {args.checkpoint!r} is an HF directory, not a training "
                "run: give --dataset FILE.jsonl, --task NAME or --suite SUITE.yaml"
            )
        cfg = TrainConfig(
            model=ModelSource(checkpoint=args.checkpoint, dtype=args.dtype or "float32"),
            data=DataConfig(task="arithmetic"),
        )  # replaced below
    d = cfg.data
    pick = lambda flag, default: default if flag is None else flag  # noqa: E731
    if args.chat and args.no_chat:
        raise ValueError("--chat and --no-chat contradict each other: give at most one")
    chat = False if args.no_chat else (True if args.chat else (d.chat_template if is_run else None))
    common = dict(max_prompt_len=pick(args.max_prompt_len, d.max_prompt_len if is_run else 1024))
    if args.dataset:
        data = DataConfig(
            task=None, dataset=args.dataset, reward=pick(args.reward, d.reward), chat_template=chat, **common
        )
    elif args.task:  # the run's task options when it is the run's task
        options = d.task_options if args.task == d.task and is_run else {}
        data = DataConfig(task=args.task, task_options=options, chat_template=chat, **common)
    else:
        data = dataclasses.replace(d, chat_template=chat, **common)
    cfg = dataclasses.replace(cfg, data=data)
    parts = components.build_model(cfg, sharding.make_mesh(cfg.mesh))  # main's mesh: read into its shards
    if is_run:
        parts.params, meta = restore_params(os.path.join(args.checkpoint, "checkpoints"), parts.params, step=args.step)
        args.step = int(meta.get("iteration", args.step or 0))  # the step restored: the suite's table names it
    return cfg, parts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparserl_jax.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="HF directory or training run directory")
    p.add_argument("--step", type=int, default=None, help="training checkpoint step (default: latest)")
    p.add_argument("--dataset", default=None, help="jsonl or .parquet benchmark (SimpleRL-Zoo / verl format)")
    p.add_argument("--task", default=None, help="synthetic task name instead of a dataset")
    p.add_argument("--n", type=int, default=None, help="number of prompts (default: all / 64 for tasks)")
    p.add_argument("--k", type=int, default=1, help="samples per prompt (avg@k)")
    # None: the run's setting (rollout.*, data.*, kv.*) for a run directory, else the default shown
    p.add_argument("--temperature", type=float, default=None, help=f"default {EVAL_DEFAULTS['temperature']}")
    p.add_argument("--top-p", type=float, default=None, help=f"default {EVAL_DEFAULTS['top_p']}")
    p.add_argument("--max-new-tokens", type=int, default=None, help=f"default {EVAL_DEFAULTS['max_new_tokens']}")
    p.add_argument("--max-prompt-len", type=int, default=None, help="default 1024")
    p.add_argument("--batch-size", type=int, default=None, help="default 64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reward", default=None, help="default math")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap every prompt, task prompts included, in the chat template (data.chat_template=true)",
    )
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--output-json", default=None)
    distributed.add_distributed_arg(p)
    host_memory.add_host_memory_arg(p)
    p.add_argument(
        "--suite",
        default=None,
        help="YAML suite of jsonl benchmarks (sparserl_jax/eval_suite.py): pass@1, pass@k, maj@k and avg@k "
        "per benchmark; a setting a benchmark leaves out is the flag's",
    )
    p.add_argument(
        "--out",
        default=None,
        help="--suite: the table's folder (default: DIR/eval/<suite> for a run, else eval/<suite>)",
    )
    add_kv_args(p)
    add_quant_args(p)
    return p


# docs/methods.md#evaluation, for an HF directory (a run directory uses its own rollout settings)
EVAL_DEFAULTS = {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 8192}


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    check_flags(args, n=1, k=1, max_new_tokens=1, max_prompt_len=1, batch_size=1, temperature=0.0)
    if args.suite and (args.dataset or args.task):
        raise ValueError("--suite names its own benchmarks: drop --dataset / --task")
    suite = eval_suite.load_suite(args.suite) if args.suite else None  # a bad file fails before the model loads
    host_memory.configure(args.host_memory)  # before JAX's backend starts
    distributed.join(args.distributed)  # before any other JAX call; a no-op on a single process
    cfg, parts = _load_policy(args)
    mesh = sharding.make_mesh(cfg.mesh)  # every process's devices; prompts split over them
    params = sharding.shard_params(parts.params, mesh) if mesh.size > 1 else parts.params
    # decoded on the rollout layout rollout.mesh names: placed once (evaluate_examples then finds
    # them there), before QuRL's quantization as the rollout source does; the training copy dropped
    params = rollout_mesh(cfg.rollout.mesh, mesh).place(params)
    parts = dataclasses.replace(parts, params=params)
    run = os.path.exists(os.path.join(args.checkpoint, "config.yaml"))
    r = cfg.rollout
    defaults = (
        {"temperature": r.temperature, "top_p": r.top_p, "max_new_tokens": r.max_new_tokens} if run else EVAL_DEFAULTS
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.batch_size is None:
        args.batch_size = r.call_rows if run else 64
    kv_cfg = kv_config_from_args(args, parts.tokenizer, base=dataclasses.replace(cfg.kv, policy="none"))
    policy = _Policy(args, parts, quantized(params, args), mesh, kv_cfg)
    if suite is not None:
        return _evaluate_suite(args, suite, cfg, policy, default_out=args.checkpoint if run else ".")
    result = policy.evaluate(
        cfg,
        parts.reward,
        n=args.n,
        k=args.k,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
    )
    if not distributed.is_coordinator():
        return result
    print(
        f"avg@{args.k} = {result['accuracy']:.4f} on {result['n_prompts']} prompts "
        f"(kv policy {kv_cfg.policy}, mean length {result['mean_length']:.1f}, "
        f"kv saving {result['kv_saving']:.1%})"
    )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), **result}, f, indent=1)
    return result


@dataclasses.dataclass
class _Policy:
    """The loaded policy, its (quantized) params on the rollout layout of the mesh and the KV cache
    it samples with."""

    args: argparse.Namespace
    parts: components.Components
    params: Params
    mesh: Mesh
    kv_cfg: KVConfig

    def evaluate(
        self,
        cfg: TrainConfig,
        reward: Callable[[str, str], float],
        *,
        n: int | None,
        k: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
    ) -> dict:
        """evaluate_examples on cfg's held-out prompts (its data section), checked for lengths,
        cache size and non-finite log-probs."""
        args, parts = self.args, self.parts
        examples = components.eval_examples(cfg, parts.tokenizer, n=n)
        longest = max(len(e.prompt_ids) for e in examples)
        check_lengths(parts.model_cfg, longest, max_new_tokens)
        check_cache(parts.model_cfg, self.kv_cfg, args.batch_size, cfg.data.max_prompt_len, max_new_tokens)
        sampler_cfg = components.sampler_config(cfg, parts.tokenizer, kv_cfg=self.kv_cfg, max_new_tokens=max_new_tokens)
        sampling = dataclasses.replace(sampler_cfg.sampling, temperature=temperature, top_p=top_p)
        result = evaluate_examples(
            self.params,
            parts.model_cfg,
            parts.tokenizer,
            examples,
            reward,
            dataclasses.replace(sampler_cfg, sampling=sampling),
            k=k,
            seed=args.seed,
            batch_size=args.batch_size,
            max_prompt_len=cfg.data.max_prompt_len,
            mesh=self.mesh,
            layout=cfg.rollout.mesh,
        )
        if result["nonfinite_rows"]:
            raise cli.RunFailed(
                f"evaluate: the model produced non-finite log-probabilities (NaN or inf logits) in "
                f"{result['nonfinite_rows']} of {len(result['samples'])} responses; check the "
                "checkpoint's weights and --dtype"
            )
        return result


def _evaluate_suite(args, suite: eval_suite.Suite, cfg: TrainConfig, policy: _Policy, default_out: str) -> dict:
    """Every benchmark of the suite with the policy (a setting it leaves out: the flag's), then
    the table: printed, and written by the coordinator."""
    d = cfg.data
    suite = suite.resolved(
        k=args.k,
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        reward=args.reward or d.reward,
    )

    def run(bench: eval_suite.Benchmark) -> dict:
        data = DataConfig(
            task=None,
            dataset=bench.path,
            reward=bench.reward,
            prompt_template=bench.prompt_template,
            chat_template=d.chat_template,
            max_prompt_len=d.max_prompt_len,
        )
        return policy.evaluate(
            dataclasses.replace(cfg, data=data),
            get_reward(bench.reward),
            n=bench.n,
            k=bench.k,
            temperature=bench.temperature,
            top_p=bench.top_p,
            max_new_tokens=bench.max_new_tokens,
        )

    coordinator = distributed.is_coordinator()
    rows, samples = eval_suite.run_suite(suite, run, log=print if coordinator else lambda line: None)
    table = {
        "suite": suite.name,
        "checkpoint": args.checkpoint,
        "step": args.step,
        "kv": dataclasses.asdict(policy.kv_cfg),
        "quant": {"format": args.quant, "mode": args.quant_mode},
        "seed": args.seed,
        "benchmarks": rows,
    }
    if coordinator:
        out = args.out or os.path.join(default_out, "eval", suite.name)
        written = eval_suite.write_table(out, table, samples)
        print("\n" + eval_suite.markdown(table))
        print(f"wrote {', '.join(written)}")
    return table


if __name__ == "__main__":
    cli.run(main)
