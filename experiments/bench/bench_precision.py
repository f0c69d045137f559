"""Float32 vs bfloat16 compute on SmolLM2-135M: a GRPO iteration per phase, the mismatch bfloat16
brings between the sampler's decode and the learner's forward, and the dots behind both.

  taskset -c 1 python experiments/bench/bench_precision.py    # experiments/results/bench_precision.{json,md}
  python experiments/bench/bench_precision.py --smoke --checkpoint <tiny HF checkpoint> --out /tmp/b.json

Workload: experiments/configs/real/smollm2_chat_arithmetic.yaml with dense rollouts (rl.mode=dense
kv.policy=none), every response exactly --tokens long (rollout.ignore_eos: equal work in both
arms), one optimizer step per rollout batch. Arms, one after the other in this process:
  float32   model.dtype=float32: master and compute float32 (the committed real-model results);
  bfloat16  model.dtype=bfloat16: float32 master weights and AdamW state, bfloat16 compute copy
            for the sampler and the learner (sparserl_jax/model/precision.py).
Each arm runs --warmup untimed iterations (compilation), then --iterations timed ones (no compile
may happen in them: counted); per phase the median seconds of the trainer's own clocks (rollout,
score, update, diagnostics; other = the rest of the step). Mismatch: the per-token k3 estimate of
KL(sampler || pi_old) over the response tokens (the update's mismatch/kl_k3, as the eviction and
quantization tables report it): the sampler's log-probs from its cached decode, pi_old from the
learner's teacher-forced forward of the same weights, each in the arm's compute dtype.
Dots: one [rows x 576] x [576 x 1536] MLP product and the [rows x 576] x [576 x 49152] LM head,
float32 vs bfloat16 inputs with float32 accumulation, GFLOP/s on this core.

bfloat16 is fast on a CPU only with bfloat16 dot instructions: AVX512-BF16 (`avx512_bf16`) or AMX
(`amx_bf16`); without them XLA:CPU widens bfloat16 to float32 around every dot. The CPU flags are
recorded (figprov.cpu_flags). The host's own numerics are used (no portable settings: they cap the
ISA at AVX2, which would hide those instructions); run it pinned to one core with taskset.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from experiments.lib import figprov, workers  # import no JAX
from experiments.real.precision_workload import ARMS, BF16_FLAGS, train_config

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/
PHASES = ("rollout", "score", "update", "diagnostics", "other")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations per arm")
    p.add_argument("--iterations", type=int, default=3, help="timed iterations per arm")
    p.add_argument("--tokens", type=int, default=128, help="every response's length")
    p.add_argument("--dot-rows", type=int, default=2928, help="rows of the dot benchmark")
    p.add_argument("--checkpoint", default=None, help="an HF checkpoint in place of the config's")
    p.add_argument("--smoke", action="store_true", help="tiny workload, one iteration each")
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_precision.json"))
    p.add_argument("overrides", nargs="*", help="key=value settings for both arms (e.g. rollout.prompts=2)")
    args = p.parse_args(argv)
    if args.smoke:
        args.warmup, args.iterations, args.tokens, args.dot_rows = 1, 1, 8, 64
    return args


def run_arm(args, dtype: str) -> dict:
    """--warmup + --iterations trainer steps at model.dtype=`dtype`: one row per step."""
    from jax import monitoring

    from sparserl_jax.train import Trainer

    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: compiles.append(duration) if "backend_compile" in event else None
    )
    rows = []
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = Trainer(train_config(args, dtype, out_dir), log=lambda *a, **k: None)
        trainer.start()
        for it in range(args.warmup + args.iterations):
            compiles.clear()
            t0, c0 = time.perf_counter(), time.process_time()
            m = trainer.step()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            trainer.iteration += 1
            phases = {p: m[f"time/{p}_s"] for p in PHASES[:-1]}
            rows.append(
                {
                    "iteration": it,
                    "warmup": it < args.warmup,
                    "iteration_s": wall,
                    "cpu_s": cpu,
                    **{f"{p}_s": s for p, s in phases.items()},
                    "other_s": wall - sum(phases.values()),
                    "response_tokens": m["update/tokens"],
                    "kl_k3": m["mismatch/kl_k3"],
                    "abs_dlogp_max": m["mismatch/abs_dlogp_max"],
                    "reward": m["reward/mean"],
                    "compiles": len(compiles),
                }
            )
    return {"dtype": dtype, "iterations": rows}


def dot_gflops(rows: int, n: int, dtype: str, repeats: int = 5) -> float:
    """GFLOP/s of [rows x 576] x [576 x n] in `dtype` with float32 accumulation and output."""
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(jax.random.key(0))
    x = jax.random.normal(k1, (rows, 576), jnp.float32).astype(dtype)
    w = (0.02 * jax.random.normal(k2, (576, n), jnp.float32)).astype(dtype)
    f = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
    jax.block_until_ready(f(x, w))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, w))
        times.append(time.perf_counter() - t0)
    return 2 * rows * 576 * n / statistics.median(times) / 1e9


def summarise(arm: dict) -> dict:
    timed = [r for r in arm["iterations"] if not r["warmup"]]
    med = lambda k: statistics.median(r[k] for r in timed)  # noqa: E731
    return {
        **{k: med(k) for k in ("iteration_s", "cpu_s", *(f"{p}_s" for p in PHASES), "kl_k3", "abs_dlogp_max")},
        "response_tokens": med("response_tokens"),
        "compiles_in_timed": sum(r["compiles"] for r in timed),
    }


def to_markdown(data: dict) -> str:
    s = data["summary"]
    flags = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in data["cpu_flags"].items())
    f32, b16 = s["float32"], s["bfloat16"]
    lines = [
        *figprov.report_head("Float32 vs bfloat16 compute: a SmolLM2-135M GRPO iteration", data),
        f"CPU flags: {flags}. Workload: "
        f"{data['workload']}; median of {data['iterations']} timed iterations after "
        f"{data['warmup']} untimed (compiles in timed iterations: float32 {f32['compiles_in_timed']}, "
        f"bfloat16 {b16['compiles_in_timed']}).",
        "",
        "Seconds of wall time per phase (the trainer's clocks); cpu: the process's CPU seconds in "
        "the iteration, the figure a core shared with other work leaves least changed.",
        "",
        "| phase | float32 s | bfloat16 s | bfloat16 / float32 |",
        "|---|---:|---:|---:|",
    ]
    for p in ("iteration", "cpu", *PHASES):
        a, b = f32[f"{p}_s"], b16[f"{p}_s"]
        lines.append(f"| {p} | {a:.2f} | {b:.2f} | {b / a:.2f}x |" if a > 0 else f"| {p} | {a:.2f} | {b:.2f} | - |")
    lines += [
        "",
        "Mismatch between the sampler's decode and the learner's teacher-forced pi_old, per "
        "response token (the update's mismatch/kl_k3, k3 estimate of KL(sampler || pi_old); the "
        "largest |log-prob difference| beside it):",
        "",
        "| compute | k3 per token | max abs dlogp |",
        "|---|---:|---:|",
        f"| float32 | {f32['kl_k3']:.3g} | {f32['abs_dlogp_max']:.3g} |",
        f"| bfloat16 | {b16['kl_k3']:.3g} | {b16['abs_dlogp_max']:.3g} |",
        "",
        f"Dots on this core, float32 accumulation ({data['dot_rows']} rows):",
        "",
        "| product | float32 GFLOP/s | bfloat16 GFLOP/s | bfloat16 / float32 |",
        "|---|---:|---:|---:|",
    ]
    for name, d in data["dots"].items():
        lines.append(f"| {name} | {d['float32']:.1f} | {d['bfloat16']:.1f} | {d['bfloat16'] / d['float32']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0, cores = time.perf_counter(), workers.available_cores()
    provenance = {**figprov.provenance(cores, None), "portable_cpu": "host"}
    arms = {dtype: run_arm(args, dtype) for dtype in ARMS}
    dots = {
        name: {dtype: dot_gflops(args.dot_rows, n, dtype) for dtype in ARMS}
        for name, n in (("MLP [576 x 1536]", 1536), ("LM head [576 x 49152]", 49152 if not args.smoke else 1536))
    }
    cfg = train_config(args, "float32", tempfile.gettempdir())
    data = {
        "command": figprov.command_line(cores),
        "provenance": {**provenance, "wall_s": round(time.perf_counter() - t0, 1)},
        "cpu_flags": figprov.cpu_flags(BF16_FLAGS),
        "workload": f"{cfg.rollout.prompts} prompts x {cfg.rollout.samples} samples, "
        f"{args.tokens} new tokens each, dense rollouts, lr {cfg.rl.optim.lr:g}",
        "warmup": args.warmup,
        "iterations": args.iterations,
        "dot_rows": args.dot_rows,
        "arms": arms,
        "summary": {d: summarise(a) for d, a in arms.items()},
        "dots": dots,
    }
    figprov.write_report(args.out, data, to_markdown(data))
    print(to_markdown(data))
    return data


if __name__ == "__main__":
    main()
