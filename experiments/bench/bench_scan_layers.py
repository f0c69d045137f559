"""Compile and step time of the learner's gradient program with the layers unrolled vs under
lax.scan (model.scan_layers), side by side in one process.

  nice -n 15 python experiments/bench/bench_scan_layers.py   # experiments/results/bench_scan_layers.{json,md}
  python experiments/bench/bench_scan_layers.py --smoke --out /tmp/scan.json

The program is the one the learner jits for a micro-batch (rl/bucketed.py BucketedUpdate._micro,
the fused path: pi_old from the update's own forward, no pi_ref inside), at a CPU-feasible shape
with many layers (default: 28 layers as Qwen2.5-1.5B, d_model 256, 4 query and 2 KV heads of
64, d_ff 1024, vocabulary 2048, 2 rows of 512 tokens; model.attention auto, blockwise on a CPU).
Per arm: tracing and lowering seconds (jit.lower), XLA compile seconds (.compile()), wall and CPU
(the process's, every thread) seconds of each; the step's median wall and CPU seconds over
--steps runs after one untimed run; the compiled program's dots and while loops (HLO text) and
XLA's memory analysis (temporaries: the scanned arm's stacked copy of the layer weights and its
stacked gradient sit there); the gradient's largest difference between the arms, relative to its
largest entry (float32 sums in another order: ~1e-6). A timing of this CPU: the host's own
numerics (no portable settings), recorded with the machine (experiments/lib/figprov.py).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

from experiments.lib import figprov, workers  # import no JAX

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/
ARMS = ("unrolled", "scanned")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=512, help="T: each row's width")
    p.add_argument("--rows", type=int, default=2, help="the micro-batch's rows")
    p.add_argument("--attention", default="auto", help="model.attention (auto: blockwise on a CPU)")
    p.add_argument("--remat", default="none", help="rl.update.remat: none, full or selective")
    p.add_argument("--steps", type=int, default=3, help="timed steps per arm (after one untimed)")
    p.add_argument("--smoke", action="store_true", help="a tiny shape, one timed step (tests)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_scan_layers.json"))
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.d_model, args.head_dim, args.d_ff, args.vocab = 3, 32, 8, 64, 64
        args.tokens, args.steps = 16, 1
    return args


def model_config(args, scan: bool):
    from sparserl_jax.model.config import ModelConfig

    return ModelConfig.tiny(
        "qwen2",
        n_layers=args.layers,
        d_model=args.d_model,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        d_ff=args.d_ff,
        vocab_size=args.vocab,
        max_seq_len=max(2048, args.tokens),
        attention=args.attention,
        scan_layers=scan,
    )


def micro_batch(args, vocab: int) -> dict:
    """A micro-batch as the learner's fused path receives it (host arrays): random tokens, the
    response being each row's second half."""
    import numpy as np

    rng = np.random.default_rng(0)
    B, T = args.rows, args.tokens
    mask = np.zeros((B, T), bool)
    mask[:, T // 2 : T - 1] = True
    return {
        "tokens": rng.integers(1, vocab, (B, T)).astype(np.int32),
        "response_mask": mask,
        "sampler_logp": np.where(mask, -rng.uniform(0.1, 3.0, (B, T)), 0.0).astype(np.float32),
        "advantages": rng.normal(size=B).astype(np.float32),
    }


def _timed(fn):
    """(fn(), wall seconds, CPU seconds of the process)."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def run_arm(args, scan: bool) -> tuple[dict, object]:
    """Compile the micro-batch program for one arm, then time its steps. Returns (the arm's
    record, its gradient accumulator on the host)."""
    import jax
    import numpy as np

    from sparserl_jax import rl
    from sparserl_jax.model import transformer
    from sparserl_jax.rl.bucketed import BucketedUpdate
    from sparserl_jax.rl.optim import make_optimizer

    m = model_config(args, scan)
    cfg = rl.RLConfig(
        mode="dense",
        loss=rl.LossConfig(beta=0.0),  # no pi_ref: the update's forward and backward alone
        update=rl.UpdateConfig(
            minibatch_size=args.rows, micro_batch_size=args.rows, length_bucket=0, remat=args.remat, compile_ahead=False
        ),
    )
    up = BucketedUpdate(m, cfg, make_optimizer(cfg.optim), max_len=args.tokens, donate=False)
    assert up.paths(args.rows)[0].fused, "the bench times the fused path (pi_old from the update's forward)"
    params = jax.device_put(transformer.init_params(m, jax.random.key(0)), jax.devices()[0])
    mb, norm = up._micro_inputs(micro_batch(args, m.vocab_size), np.arange(args.rows), args.tokens, None, fused=True)

    lowered, lower_s, lower_cpu = _timed(lambda: up._micro.lower(params, None, up._zeros(params), mb, norm, fused=True))
    compiled, compile_s, compile_cpu = _timed(lowered.compile)
    hlo = compiled.as_text()
    mem = compiled.memory_analysis()

    def step():
        acc = up._zeros(params)  # donated to the step
        jax.block_until_ready(acc)
        out, wall, cpu = _timed(lambda: jax.block_until_ready(compiled(params, None, acc, mb, norm)))
        return out, wall, cpu

    out, _, _ = step()  # untimed
    walls, cpus = [], []
    for _ in range(args.steps):
        out, wall, cpu = step()
        walls.append(wall)
        cpus.append(cpu)
    record = {
        "scan_layers": scan,
        "lower_s": round(lower_s, 2),
        "lower_cpu_s": round(lower_cpu, 2),
        "compile_s": round(compile_s, 2),
        "compile_cpu_s": round(compile_cpu, 2),
        "step_s": round(statistics.median(walls), 3),
        "step_cpu_s": round(statistics.median(cpus), 3),
        "steps_s": [round(w, 3) for w in walls],
        "hlo_dots": len(re.findall(r"\sdot\(", hlo)),
        "hlo_whiles": len(re.findall(r"\swhile\(", hlo)),
        "hlo_lines": hlo.count("\n"),
        "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
        "argument_bytes": getattr(mem, "argument_size_in_bytes", None),
        "output_bytes": getattr(mem, "output_size_in_bytes", None),
    }
    return record, jax.tree.map(np.asarray, out[0])


def grad_difference(a, b) -> float:
    """The largest |a - b| over the gradient, relative to its largest entry."""
    import jax
    import numpy as np

    diff = max(float(np.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    return diff / max(float(np.abs(x).max()) for x in jax.tree.leaves(a))


def to_markdown(data: dict) -> str:
    u, s = data["arms"]["unrolled"], data["arms"]["scanned"]
    mib = lambda b: "-" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
    rows = [
        ("trace + lower, wall s", "lower_s"),
        ("trace + lower, CPU s", "lower_cpu_s"),
        ("XLA compile, wall s", "compile_s"),
        ("XLA compile, CPU s", "compile_cpu_s"),
        ("step, median wall s", "step_s"),
        ("step, median CPU s", "step_cpu_s"),
        ("dots in the HLO", "hlo_dots"),
        ("while loops in the HLO", "hlo_whiles"),
        ("HLO text lines", "hlo_lines"),
    ]
    lines = [
        *figprov.report_head(
            "The learner's gradient program: layers unrolled vs under lax.scan (model.scan_layers)", data
        ),
        f"Shape: {data['shape']}. One micro-batch gradient program (rl/bucketed.py BucketedUpdate._micro, "
        f"fused path), median of {data['steps']} timed steps after one untimed. Gradient difference "
        f"between the arms: {data['grad_rel_diff']:.2g} of its largest entry.",
        "",
        "| | unrolled | scanned | scanned / unrolled |",
        "|---|---:|---:|---:|",
    ]
    for label, key in rows:
        a, b = u[key], s[key]
        ratio = f"{b / a:.2f}x" if a else "-"
        lines.append(f"| {label} | {a} | {b} | {ratio} |")
    for label, key in (("temporaries, MiB", "temp_bytes"), ("arguments, MiB", "argument_bytes")):
        a, b = u[key], s[key]
        ratio = f"{b / a:.2f}x" if a and b else "-"
        lines.append(f"| {label} | {mib(a)} | {mib(b)} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0, cores = time.perf_counter(), workers.available_cores()
    provenance = {**figprov.provenance(cores, None), "portable_cpu": "host"}
    arms, grads = {}, {}
    for name, scan in zip(ARMS, (False, True)):
        arms[name], grads[name] = run_arm(args, scan)
    m = model_config(args, False)
    data = {
        "command": figprov.command_line(cores),
        "provenance": {**provenance, "wall_s": round(time.perf_counter() - t0, 1)},
        "shape": f"{m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads / {m.n_kv_heads} KV heads of "
        f"{m.head_dim}, d_ff {m.d_ff}, vocabulary {m.vocab_size}, {args.rows} rows x {args.tokens} tokens, "
        f"model.attention {m.attention}, rl.update.remat {args.remat}, {m.dtype}",
        "steps": args.steps,
        "arms": arms,
        "grad_rel_diff": grad_difference(grads["unrolled"], grads["scanned"]),
    }
    figprov.write_report(args.out, data, to_markdown(data))
    print(to_markdown(data))
    return data


if __name__ == "__main__":
    main()
