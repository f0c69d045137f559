"""The float32-vs-bfloat16 workload on SmolLM2-135M that experiments/bench/bench_precision.py times
and experiments/bench/profile_cpu.py profiles: experiments/configs/real/smollm2_chat_arithmetic.yaml
with dense rollouts, every response exactly `tokens` long (rollout.ignore_eos: equal work in every
arm), one optimizer step per rollout batch, model.dtype the arm's compute dtype."""

from __future__ import annotations

import os

from experiments.real.smoke import SMOKE_BATCH, load_real_config

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/
CONFIG = os.path.join(HERE, "configs", "real", "smollm2_chat_arithmetic.yaml")
OVERRIDES = (
    "rl.mode=dense",
    "kv.policy=none",
    "train.progress=false",
    "train.save_every=100000",
    "train.eval_every=0",
    "rollout.ignore_eos=true",
)
ARMS = ("float32", "bfloat16")  # model.dtype of each arm (bfloat16: over float32 master weights)
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512f", "avx2")  # the CPU flags a report names


def train_config(args, dtype: str, out_dir: str):
    """The workload's TrainConfig for one arm; `args` carries smoke, tokens, overrides, checkpoint."""
    over = [
        *OVERRIDES,
        *(SMOKE_BATCH if args.smoke else ()),
        f"rollout.max_new_tokens={args.tokens}",
        f"train.out_dir={out_dir}",
        *args.overrides,
        f"model.dtype={dtype}",
    ]
    if args.checkpoint:
        over.append(f"model.checkpoint={args.checkpoint}")
    return load_real_config(over, CONFIG)
