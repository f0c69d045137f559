"""The device check: one command that validates the kernels, the sampler, the update step, the
memory plan and a training run on one GPU, and writes what it measured as it goes.

  python experiments/device/gpu_check.py --out DIR            # the whole check: under 10 minutes on an H100 / H200
  python experiments/device/gpu_check.py --out DIR --quick    # kernels and sampler at B=64: under 3 minutes
  python experiments/device/gpu_check.py --out DIR --steps update e2e   # some steps (any size)
  python experiments/device/gpu_check.py --out DIR --steps env study     # the collapse study's cost (on request)
  python experiments/device/gpu_check.py --out DIR --steps env engine    # slot engine and int8 rollouts (on request)
  python experiments/device/gpu_check.py --out DIR --steps env profile iteration  # decode trace, one iteration (on request)
  python experiments/device/gpu_check.py --smoke --out DIR    # the same steps on CPU at toy shapes (tests)

Steps, in order, with their budgets in seconds (full / quick / smoke; a step's process is killed
past its budget, or past the check's --time-limit: 570 / 180 / 1320 s):
  env        15 /  20 / 60   device, memory, jax / jaxlib / CUDA plugin versions, the commit and
                             whether the tree is clean (figprov.py's provenance); no GPU: the other
                             steps are skipped
  numerics   90 /  35 / 120  Pallas decode attention (Triton) against its jnp reference on the
                             device: Qwen2.5-1.5B and 7B heads, head_dim 128, bf16, R-KV 512 + 128
                             slots, batch 1 / 8 / 64 / 256 (quick: 1 / 256), fills empty to full;
                             max error beside a bound derived from the computation
                             (gpu_kernel_check.py), plain and under shard_map on the one device's mesh
  bandwidth  25 /  25 / 60   bytes the kernel must read per call / its time, beside a device copy
                             measured in the same process: % of copy bandwidth per shape (goal >= 70%)
  sampler   200 /  90 / 120  decode tokens/s of the jitted sampler (bench_decode.py's gpu profile:
                             Qwen2.5-1.5B shape, random bf16 weights), R-KV 512 + 128 vs dense at a
                             4096-token generation, B = 64 and 256 (quick: 64), compile apart
  engine      - /   - / 180  on request (`--steps env engine`: 420 s on a GPU, a second device call;
                             not yet run on one: about 250 s of compiling assumed, its 11 programs
                             at the sampler step's H200 compile times, 16 s dense, 40 s R-KV) on
                             the sampler step's model (gpu_engine.py): QuRL's int8 W8A8 weights
                             beside the model's dtype, dense and R-KV 512 + 128, B = 64, 1024 new
                             tokens: tokens/s and their ratio (goal > 1); SortedRL's slot engine
                             beside the static sampler on one workload of forced lengths
                             (engine_bench.py: 256 requests, Q = 64 slots, 10% at the cap of 1024,
                             the rest in [64, 256], R-KV): tokens/s, speed-up, bubbles, both arms at
                             the forced lengths, no compilation inside the timed runs
  profile     - /   - / 150  on request (`--steps env profile iteration`: 270 s on a GPU, a second
                             device call; not yet run on one: 8 compiles at the sampler step's H200
                             times, 4 x 16 s dense + 4 x 40 s R-KV, assumed) a jax.profiler trace of 64
                             decode steps on the sampler step's model (gpu_profile.py), B = 64 and 256,
                             R-KV 512 + 128 and dense, the agreement's top-20 candidates on and off:
                             ms / step per case (one traced call after its compile), the traces in
                             DIR/profile/<case>/; goal: candidates off not slower than on
  update    140 /   - / 120  one jitted update step (rl/update.py), Qwen2.5-1.5B config + 1-GPU
                             overlay at the authors' micro-batch of 4, 8 rows x 5120 tokens: tokens/s,
                             model FLOP utilisation, whether the step moves the weights at lr 1e-6,
                             peak device memory beside `python -m sparserl_jax.dryrun`'s plan; the
                             param and compute dtypes are the config's; once with cuDNN's fused
                             attention (model.attention=cudnn), then with XLA's (the config's)
  iteration   - /   - / 150  on request (with profile: 280 s on a GPU; not yet run on one: about 150 s
                             of compiling assumed, the sampler's 40 s and the update's 48 s on the
                             H200 plus scoring) one trainer iteration (gpu_iteration.py) at
                             Qwen2.5-1.5B's shape, random weights, the 1-GPU overlay, 8 prompts x 8
                             samples x 1024 new tokens (arithmetic prompts), no SFT: seconds of
                             compile, rollout, scoring and update apart, the rollout's tokens/s, the
                             loss finite
  e2e       100 /   - / 180  the default experiment's config at smoke size: train with a checkpoint
                             every iteration, evaluate (dense and sparse inference), stop and resume,
                             compare; then `python experiments/default.py --smoke` (full size, in
                             what is left of the budget: on an H200 the training took 80 s of it)
  study       - /   - / 180  on request (`--steps env study`: 300 s on a GPU, a second device call)
                             the real-model collapse study's config (real_collapse.py) on a
                             SmolLM2-135M checkpoint with random weights (gpu_study.py): seconds an
                             iteration of dense and Sparse-RL, of an evaluation, and the whole plan's
                             cost on the device; SmolLM2's tokenizer where checkpoints/smollm2-135m
                             holds it (carry its tokenizer files), else the char tokenizer

Each step runs in its own process (gpu_report.py): a step that raises, crashes or runs out of
time is recorded as failed with one line, and the next step runs. DIR/report.json and
DIR/report.md are rewritten before and after every step (a check killed at its limit leaves what
it measured; DIR/steps/<step>.json holds a running step's partial figures, DIR/steps/<step>.log
its output). The report reads PASS only when every step ran and none failed; the exit code is 1
otherwise. Results for the repository: experiments/results/gpu/<device>/ (the default --out on a
GPU). `--fail STEP` makes a step raise once it has run (the guard's test: its figures stay, the
report reads FAIL).

The steps share JAX's persistent compilation cache (`--compile-cache`, default
~/.cache/sparserl_jax/xla, train.compile_cache's): a rerun on the same machine loads what the
first run compiled, so its compile figures are then load times (`--compile-cache ''`: off).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time

from experiments.device import gpu_report  # imports no JAX: this process never starts a device
from sparserl_jax import cli  # imports no JAX either

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/

TITLES = {
    "env": "environment",
    "numerics": "kernel numerics against the reference",
    "bandwidth": "kernel bandwidth against a device copy",
    "sampler": "sampler decode throughput",
    "engine": "rollouts of SortedRL and QuRL: slot engine and int8 W8A8 beside the static sampler",
    "profile": "a profiler trace of the sampler's decode steps per batch, cache and top candidates",
    "update": "update step: throughput, MFU, weights moved, peak memory vs the dry run",
    "iteration": "one trainer iteration at Qwen2.5-1.5B's shape: compile, rollout, scoring, update",
    "e2e": "end to end: train, evaluate, checkpoint, resume",
    "study": "the real-model collapse study's cost: its config on random SmolLM2-135M weights",
}
BUDGETS = {  # seconds per step (the module docstring's table)
    "full": {"env": 15, "numerics": 90, "bandwidth": 25, "sampler": 200, "update": 140, "e2e": 100},
    "quick": {"env": 20, "numerics": 35, "bandwidth": 25, "sampler": 90},
    "smoke": {
        "env": 60,
        "numerics": 120,
        "bandwidth": 60,
        "sampler": 120,
        "engine": 180,
        "profile": 150,
        "update": 120,
        "iteration": 150,
        "e2e": 180,
        "study": 180,
    },
}
# Steps outside the whole check (it fills one 10-minute device call), run by --steps at this budget
ON_REQUEST = {"engine": 420, "profile": 270, "iteration": 280, "study": 300}
TIME_LIMITS = {"full": 570, "quick": 180, "smoke": 1320}
# Per-step environment (a setting the user made wins): the whole device for one process, except
# where several share it (the default experiment runs its arms as parallel processes).
GPU_ENV = {"JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}
STEP_ENV = {"e2e": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out",
        help="report directory (default on a GPU: experiments/results/gpu/<device>; "
        "with --smoke: runs/gpu_check_smoke)",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the rerun subset: under 3 minutes")
    size.add_argument("--smoke", action="store_true", help="the same steps on CPU at toy shapes (seconds)")
    p.add_argument("--steps", nargs="+", choices=list(TITLES), help="run these steps only (in the check's order)")
    limits = " / ".join(map(str, TIME_LIMITS.values()))
    p.add_argument("--time-limit", type=float, help=f"seconds for the whole check (default {limits})")
    p.add_argument(
        "--lower",
        action="store_true",
        help="lower the full-size (or --quick) programs for cuda "
        "on this machine, no GPU needed (gpu_lower.py); writes DIR/lowering.md and .json with --out",
    )
    p.add_argument("--fail", choices=list(TITLES), help="make this step raise once it has run (tests the guard)")
    p.add_argument(
        "--compile-cache",
        default=cli.DEFAULT_COMPILE_CACHE,
        help="the steps' persistent compilation cache (a rerun loads what the first run compiled: its "
        "compile figures are then load times); '' turns it off; JAX_COMPILATION_CACHE_DIR or "
        f"${cli.COMPILE_CACHE_ENV}, when set, win (default: %(default)s)",
    )
    p.add_argument("--step", choices=list(TITLES), help=argparse.SUPPRESS)  # a step's own process
    p.add_argument("--mode", choices=list(BUDGETS), help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def device_slug() -> str:
    """The GPU's name as a directory (nvidia-smi; no device is started in this process)."""
    try:
        name = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        name = "unknown-gpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def step_env(name: str, mode: str, compile_cache: str | None = None) -> dict:
    """The environment of a step's process: GPU_ENV and STEP_ENV (CPU only under --smoke), and
    JAX's persistent compilation cache in `compile_cache` (cli.compile_cache_folder: None, off),
    where the user has not set them."""
    env = dict(os.environ)
    for k, v in ({"JAX_PLATFORMS": "cpu"} if mode == "smoke" else {**GPU_ENV, **STEP_ENV.get(name, {})}).items():
        env.setdefault(k, v)
    if compile_cache:
        env.setdefault("JAX_COMPILATION_CACHE_DIR", compile_cache)
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", str(cli.MIN_COMPILE_SECS))
    return env


def lower(mode: str, out: str | None, argv) -> int:
    """--lower: every program of the check at this size lowered for cuda here (gpu_lower.py)."""
    from experiments.device import gpu_lower, gpu_sizes

    rows = gpu_lower.lower_all(gpu_sizes.SIZES[mode])
    command = shlex.join(["python", "experiments/device/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
    if out:
        os.makedirs(out, exist_ok=True)
        gpu_report.write_json(os.path.join(out, "lowering.json"), {"command": command, "rows": rows})
        with open(os.path.join(out, "lowering.md"), "w") as f:
            f.write(gpu_lower.markdown(rows, command))
    failed = [r for r in rows if not r["ok"]]
    print(
        f"{len(rows) - len(failed)} of {len(rows)} programs lowered for cuda"
        + (f"; failed: {', '.join(r['program'] + ' ' + r['shape'] for r in failed)}" if failed else "")
    )
    return 1 if failed else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.step:  # one step, in its own process
        from experiments.device import gpu_steps

        return gpu_steps.run_step(args.step, args.out, args.mode, args.deadline, fail=args.fail == args.step)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    if args.lower:
        return lower(mode, args.out, argv)
    budgets = BUDGETS[mode]
    if args.steps:  # a step outside the size's list runs at its full-size budget
        budgets = {s: budgets.get(s, BUDGETS["full"].get(s, ON_REQUEST.get(s))) for s in TITLES if s in args.steps}
    out = os.path.abspath(
        args.out
        or (
            os.path.join(os.path.dirname(HERE), "runs", "gpu_check_smoke")
            if mode == "smoke"
            else os.path.join(HERE, "results", "gpu", device_slug())
        )
    )
    os.makedirs(out, exist_ok=True)
    steps = [gpu_report.Step(name, TITLES[name], budget) for name, budget in budgets.items()]
    cache = cli.compile_cache_folder(args.compile_cache, "cpu" if mode == "smoke" else "gpu")
    envs = {s.name: step_env(s.name, mode, cache) for s in steps}
    time_limit = args.time_limit or TIME_LIMITS[mode]
    t_end = time.time() + time_limit

    def command(step: gpu_report.Step) -> list[str]:
        deadline = min(t_end, time.time() + step.budget_s)
        return [
            sys.executable,
            os.path.abspath(__file__),
            "--step",
            step.name,
            "--mode",
            mode,
            "--out",
            out,
            "--deadline",
            f"{deadline:.1f}",
            *(["--fail", args.fail] if args.fail else []),
        ]

    command_line = shlex.join(
        ["python", os.path.relpath(os.path.abspath(__file__)), *(sys.argv[1:] if argv is None else argv)]
    )
    runner = gpu_report.Runner(
        out, steps, command, mode=mode, command_line=command_line, time_limit_s=time_limit, envs=envs
    )
    return runner.run()


if __name__ == "__main__":
    sys.exit(main())
