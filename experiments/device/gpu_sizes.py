"""The device check's sizes: what each step measures at full and quick size on a GPU and at smoke
size on CPU (toy shapes), and the real configs' kernel shapes. Imports no JAX."""

from __future__ import annotations

import dataclasses
import os

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/
REAL = os.path.join(HERE, "configs", "real")
DEFAULT_CONFIG = os.path.join(HERE, "configs", "walk_key_rkv.yaml")  # the default experiment's
GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What every step measures at one size."""

    gpu: bool  # full and quick: the device must be a GPU; smoke: CPU
    kernel_heads: tuple[str, ...]  # real configs whose heads the kernel runs at (empty: TOY_HEADS)
    kernel_batches: tuple[int, ...]
    kernel_impl: str  # "pallas" on the device, "interpret" on CPU
    block_c: int | None  # None: the kernel's default tile
    bandwidth_cases: tuple[tuple[str, int, float], ...]  # (heads, batch, fill fraction)
    copy_mib: int
    timing: dict  # bench_kernel.time_fn's iters, repeats, warmup
    kernel_calls: int  # kernel calls per timed program
    sampler_argv: tuple[str, ...]  # experiments/bench/bench_decode.py's arguments, less --batch and --out
    sampler_batches: tuple[int, ...]
    engine_batch: int  # the engine step's int8 rows: batch and new tokens (the sampler's profile)
    engine_new_tokens: int
    engine_workload: dict  # its slot engine rows: engine_bench.workload's and compare's settings
    profile_batches: tuple[int, ...]  # the profile step's traced decode calls: batches and new tokens
    profile_steps: int
    update_configs: tuple[str, ...]
    update_arch: str | None
    update_overrides: tuple[str, ...]
    update_steps: int
    update_attention: tuple[str, ...]  # the model.attention values the update step measures, in order
    iteration_configs: tuple[str, ...]  # the iteration step's trainer config (random weights)
    iteration_arch: str | None  # an HF config.json the model's shape comes from (None: model.arch)
    iteration_overrides: tuple[str, ...]
    e2e_overrides: tuple[str, ...] | None  # the resume check's (None: default.py's --smoke overrides)
    run_default: bool  # also `python experiments/default.py --smoke` (minutes even at its smoke size)


TOY_HEADS = {"toy-gqa4": (8, 2, 16, 40, "bfloat16")}  # N, K, H, C (not a tile multiple), dtype
MODELS = ("qwen2.5-1.5b", "qwen2.5-7b")
_GPU = dict(
    gpu=True,
    kernel_heads=MODELS,
    kernel_impl="pallas",
    block_c=None,
    copy_mib=1024,
    kernel_calls=16,
    sampler_argv=("--profile", "gpu", "--lengths", "4096", "--policies", "rkv", "none", "--min-seconds", "0"),
    # Qwen2.5-1.5B with one GPU's overlay at the authors' micro-batch of 4 responses
    update_configs=(os.path.join(REAL, "qwen2.5-1.5b.yaml"), os.path.join(REAL, "mesh", "1gpu.yaml")),
    update_arch=os.path.join(REAL, "arch", "qwen2.5-1.5b.json"),
    update_overrides=(
        "rollout.prompts=1",
        "rollout.samples=8",
        "rollout.rows_per_call=0",
        "rl.update.minibatch_size=8",
        "rl.update.micro_batch_size=4",
        "rl.update.score_batch_size=4",
        "rl.optim.lr=1e-6",
    ),
    update_steps=2,
    # cuDNN's fused attention first: the device's peak memory is a high-water mark over the step's
    # process, so the variant expected to hold less is measured before the one that holds more
    update_attention=("cudnn", "xla"),
    e2e_overrides=None,
    engine_batch=64,
    engine_new_tokens=1024,
    # Q = 64 slots, 10% of the responses at the cap, the rest uniform in [64, 256]; one chunk of
    # kv.buffer (128) steps a segment, so a slot waits at most 128 steps before its refill
    engine_workload=dict(requests=256, slots=64, max_new=1024, short=(64, 256), long_frac=0.1, segment_chunks=1),
    profile_batches=(64, 256),
    profile_steps=64,
    # one trainer iteration at Qwen2.5-1.5B's shape on one GPU: 8 x 8 = 64 rows of 1024 new tokens
    # (one sampler call), one optimizer step; arithmetic prompts (no dataset reaches the device),
    # only the programs the iteration runs compiled
    iteration_configs=(os.path.join(REAL, "qwen2.5-1.5b.yaml"), os.path.join(REAL, "mesh", "1gpu.yaml")),
    iteration_arch=os.path.join(REAL, "arch", "qwen2.5-1.5b.json"),
    iteration_overrides=(
        "rollout.prompts=8",
        "rollout.samples=8",
        "rollout.max_new_tokens=1024",
        "rl.update.minibatch_size=64",
        "rl.update.compile_ahead=false",
        "data.task=arithmetic",
        "data.dataset=null",
        "train.iterations=1",
        "sft.steps=0",
    ),
)

SIZES = {
    "full": Sizes(
        **_GPU,
        kernel_batches=(1, 8, 64, 256),
        bandwidth_cases=tuple((m, b, f) for m in MODELS for b in (64, 256) for f in (1.0, 0.5)),
        timing=dict(iters=20, repeats=5, warmup=2),
        sampler_batches=(64, 256),
        run_default=True,
    ),
    "quick": Sizes(
        **_GPU,
        kernel_batches=(1, 256),
        bandwidth_cases=tuple((m, 256, 1.0) for m in MODELS),
        timing=dict(iters=20, repeats=3, warmup=2),
        sampler_batches=(64,),
        run_default=False,
    ),
    "smoke": Sizes(
        gpu=False,
        kernel_heads=(),
        kernel_batches=(3,),
        kernel_impl="interpret",
        block_c=16,
        bandwidth_cases=(("toy-gqa4", 4, 1.0),),
        copy_mib=4,
        timing=dict(iters=2, repeats=2, warmup=1),
        kernel_calls=2,
        sampler_argv=(
            "--profile",
            "cpu",
            "--n-layers",
            "1",
            "--prompt-len",
            "8",
            "--lengths",
            "24",
            "--budget",
            "8",
            "--buffer",
            "8",
            "--window",
            "2",
            "--policies",
            "rkv",
            "none",
            "--min-seconds",
            "0",
        ),
        sampler_batches=(2,),
        engine_batch=2,
        engine_new_tokens=24,
        engine_workload=dict(requests=6, slots=2, max_new=24, short=(4, 12), long_frac=0.2, segment_chunks=1),
        profile_batches=(2,),
        profile_steps=64,
        iteration_configs=(os.path.join(HERE, "configs", "smoke.yaml"),),
        iteration_arch=None,
        iteration_overrides=("train.iterations=1", "sft.steps=0"),
        update_configs=(os.path.join(HERE, "configs", "smoke.yaml"),),
        update_arch=None,
        update_overrides=(
            "rollout.prompts=1",
            "rollout.samples=4",
            "rl.update.minibatch_size=4",
            "rl.update.micro_batch_size=2",
            "rl.optim.lr=1e-6",
            "model.arch.n_layers=1",
        ),
        update_steps=2,
        update_attention=("xla",),
        e2e_overrides=(
            "sft.steps=0",
            "sft.curriculum.steps=0",
            "train.eval_prompts=2",
            "rollout.prompts=1",
            "rollout.samples=2",
            "rollout.max_new_tokens=24",
            "kv.budget=12",
            "kv.buffer=4",
            "rl.update.minibatch_size=2",
            "rl.update.micro_batch_size=2",
            "rl.update.length_bucket=0",
            "rl.update.reuse_old_forward=false",
            "model.arch.n_layers=1",
            "train.iterations=2",
        ),
        run_default=False,
    ),
}


def kernel_shapes(sizes: Sizes) -> dict:
    """{label: (N, K, H, C, dtype)}: the real configs' heads and R-KV slots (budget + buffer), as
    tests/test_lowering.py lowers them, or the toy heads."""
    if not sizes.kernel_heads:
        return dict(TOY_HEADS)
    from sparserl_jax.config import load_config
    from sparserl_jax.dryrun import model_config

    shapes = {}
    for name in sizes.kernel_heads:
        cfg = load_config([os.path.join(REAL, f"{name}.yaml")])
        m, _ = model_config(cfg, os.path.join(REAL, "arch", f"{name}.json"))
        shapes[name] = (m.n_heads, m.n_kv_heads, m.head_dim, cfg.kv.budget + cfg.kv.buffer, m.dtype)
    return shapes
