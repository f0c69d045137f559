"""The learner's micro-batch gradient program with the LM head over every position vs over each
row's response window (rl.update.head_window full / response), side by side in one process.

  taskset -c 1 python experiments/bench/bench_head_window.py    # experiments/results/bench_head_window.{json,md}
  python experiments/bench/bench_head_window.py --smoke --out /tmp/hw.json

The program is the one the learner jits for a micro-batch (rl/bucketed.py BucketedUpdate._micro,
the fused path: pi_old from the update's own forward, pi_ref teacher-forced inside it as with
loss.beta > 0), at the real-model GRPO iteration's shape (bench_vs_trl's fixed regime):
SmolLM2-135M-Instruct's layers with random weights (experiments/lib/decode_bench.py's smollm2
profile), 4 rows a micro-batch, each a --prompt-token prompt then a --response-token response,
the rows --width positions wide. The two arms' programs are compiled first; then the timed steps
alternate between them (--rounds rounds, one step of each arm a round, after one untimed step
each), so both see the same state of the host. Per arm: the step's median wall and CPU seconds,
the head's rows per chunk read from the compiled program, XLA's temporaries; and the largest
difference of the arms' gradients and log-probs on the response positions (the head's float
summation order: ~1e-6 relative). A timing of this CPU: the host's own numerics (no portable
settings), recorded with the machine (experiments/lib/figprov.py).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

from experiments.lib import figprov, workers  # import no JAX

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/
ARMS = ("full", "response")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16", help="model.dtype (float32 master weights either way)")
    p.add_argument("--rows", type=int, default=4, help="rows of the micro-batch (rl.update.micro_batch_size)")
    p.add_argument("--prompt-tokens", type=int, default=57, help="each row's prompt (chat arithmetic: 55-59)")
    p.add_argument("--response-tokens", type=int, default=128, help="each row's response (rollout.max_new_tokens)")
    p.add_argument("--width", type=int, default=192, help="the micro-batch's width (a length bucket of 64)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds, one step of each arm per round")
    p.add_argument("--overrides", nargs="*", default=["model.head_backward=compute"], help="model.key=value")
    p.add_argument("--smoke", action="store_true", help="a tiny model, one round (tests)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_head_window.json"))
    args = p.parse_args(argv)
    if args.smoke:
        args.rows, args.prompt_tokens, args.response_tokens, args.width, args.rounds = 2, 5, 8, 16, 1
    if args.prompt_tokens + args.response_tokens > args.width:
        p.error(f"--width {args.width} holds no row of {args.prompt_tokens} + {args.response_tokens} tokens")
    return args


def model_config(args):
    """The profile's model with --dtype over float32 masters and the model.key=value overrides,
    read and checked as a config's (config_io: values coerced, a bad one named)."""
    from experiments.lib.decode_bench import PROFILES
    from sparserl_jax.config_io import from_dict, read_tree, to_dict
    from sparserl_jax.model.config import ModelConfig

    m = ModelConfig.tiny() if args.smoke else PROFILES["smollm2"].model
    tree = read_tree(overrides=args.overrides)
    if set(tree) - {"model"}:
        raise ValueError(f"--overrides: only model.* settings, got {sorted(set(tree) - {'model'})}")
    settings = {**to_dict(m), "dtype": args.dtype, "param_dtype": "float32", **tree.get("model", {})}
    return from_dict(ModelConfig, settings, "model")


def micro_batch(args, vocab: int) -> dict:
    """Host arrays of one micro-batch: random tokens, each row's prompt then its response, the
    rest padding (rl/batch.py's layout)."""
    import numpy as np

    rng = np.random.default_rng(0)
    B, T, P, R = args.rows, args.width, args.prompt_tokens, args.response_tokens
    mask = np.zeros((B, T), bool)
    mask[:, P - 1 : P + R - 1] = True  # position t scores tokens[t + 1]
    tokens = rng.integers(1, vocab, (B, T)).astype(np.int32)
    tokens[:, P + R :] = 0
    return {
        "tokens": tokens,
        "response_mask": mask,
        "sampler_logp": np.where(mask, -rng.uniform(0.1, 3.0, (B, T)), 0.0).astype(np.float32),
        "advantages": rng.normal(size=B).astype(np.float32),
    }


def head_rows(hlo: str, vocab: int) -> list[int]:
    """Rows of the head's products in a compiled program: dots with a [rows, vocab] result."""
    return sorted({int(r) for r in re.findall(rf"\[(\d+),{vocab}\]\S* dot\(", hlo)})


def _timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def run(args) -> dict:
    import jax
    import numpy as np

    from sparserl_jax import rl
    from sparserl_jax.model import precision, transformer
    from sparserl_jax.rl.bucketed import BucketedUpdate
    from sparserl_jax.rl.optim import make_optimizer

    m = model_config(args)
    master = jax.device_put(transformer.init_params(m, jax.random.key(0)), jax.devices()[0])
    params = precision.compute_copy(master, m)
    arms = {}
    for arm in ARMS:
        cfg = rl.RLConfig(
            mode="dense",
            loss=rl.LossConfig(beta=1e-4),  # pi_ref inside the program, as the benchmarks' config
            update=rl.UpdateConfig(
                minibatch_size=args.rows,
                micro_batch_size=args.rows,
                length_bucket=0,
                compile_ahead=False,
                head_window=arm,
                temperature=0.7,
            ),
        )
        up = BucketedUpdate(
            m, cfg, make_optimizer(cfg.optim), max_len=args.width, donate=False, response_len=args.response_tokens
        )
        path = up.paths(args.rows)[0]
        assert path.fused and path.ref_inside, "the bench times the fused path with pi_ref inside"
        host = micro_batch(args, m.vocab_size)
        mb, norm = up._micro_inputs(host, np.arange(args.rows), args.width, None, fused=True)
        lowered = up._micro.lower(params, params, up._zeros(master), mb, norm, fused=True)
        compiled, compile_s, _ = _timed(lowered.compile)
        arms[arm] = dict(up=up, compiled=compiled, mb=mb, norm=norm, compile_s=compile_s, walls=[], cpus=[])

    def step(a):
        acc = a["up"]._zeros(master)
        jax.block_until_ready(acc)
        return _timed(lambda: jax.block_until_ready(a["compiled"](params, params, acc, a["mb"], a["norm"])))

    outs = {arm: step(a)[0] for arm, a in arms.items()}  # untimed
    for _ in range(args.rounds):
        for a in arms.values():
            _, wall, cpu = step(a)
            a["walls"].append(wall)
            a["cpus"].append(cpu)

    mask = np.asarray(arms["full"]["mb"]["response_mask"])
    full_g, win_g = outs["full"][0], outs["response"][0]
    grad_diff = max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max())
        for x, y in zip(jax.tree.leaves(full_g), jax.tree.leaves(win_g))
    )
    grad_scale = max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(full_g))
    logp_diff = float(np.abs(np.asarray(outs["full"][3])[mask] - np.asarray(outs["response"][3])[mask]).max())
    records = {}
    for arm, a in arms.items():
        hlo = a["compiled"].as_text()
        mem = a["compiled"].memory_analysis()
        records[arm] = {
            "step_s": round(statistics.median(a["walls"]), 3),
            "step_cpu_s": round(statistics.median(a["cpus"]), 3),
            "steps_s": [round(w, 3) for w in a["walls"]],
            "compile_s": round(a["compile_s"], 2),
            "head_rows": head_rows(hlo, m.vocab_size),
            "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
        }
    return {
        "arms": records,
        "grad_rel_diff": grad_diff / grad_scale,
        "logp_abs_diff": logp_diff,
        "shape": (
            f"{'SmolLM2-135M-Instruct layers (random weights)' if not args.smoke else 'tiny model'}, "
            f"model.dtype={args.dtype}, {' '.join(args.overrides) or 'no overrides'}; {args.rows} rows of "
            f"{args.width} positions, each a {args.prompt_tokens}-token prompt and a {args.response_tokens}-token "
            f"response; pi_ref inside the program (loss.beta > 0)"
        ),
    }


def to_markdown(data: dict) -> str:
    f, r = data["arms"]["full"], data["arms"]["response"]
    mib = lambda b: "-" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
    lines = [
        "# The learner's micro-batch program: the LM head over every position vs the response window",
        "",
        f"`{data['command']}`",
        "",
        figprov.provenance_line(data),
        "",
        f"Shape: {data['shape']}. One micro-batch gradient program (rl/bucketed.py BucketedUpdate._micro, "
        f"fused path), compiled per arm, then {data['rounds']} rounds alternating one step of each arm after "
        "one untimed step each. Differences between the arms: gradient "
        f"{data['grad_rel_diff']:.2g} of its largest entry, log-probs on the response positions "
        f"{data['logp_abs_diff']:.2g} (absolute).",
        "",
        "| | full | response | response / full |",
        "|---|---:|---:|---:|",
        f"| step, median wall s | {f['step_s']} | {r['step_s']} | {r['step_s'] / f['step_s']:.2f}x |",
        f"| step, median CPU s | {f['step_cpu_s']} | {r['step_cpu_s']} | {r['step_cpu_s'] / f['step_cpu_s']:.2f}x |",
        f"| steps, wall s | {', '.join(map(str, f['steps_s']))} | {', '.join(map(str, r['steps_s']))} | |",
        f"| the head's rows per chunk (compiled) | {', '.join(map(str, f['head_rows']))} | "
        f"{', '.join(map(str, r['head_rows']))} | |",
        f"| XLA compile, s | {f['compile_s']} | {r['compile_s']} | |",
        f"| temporaries, MiB | {mib(f['temp_bytes'])} | {mib(r['temp_bytes'])} | |",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0, cores = time.perf_counter(), workers.available_cores()
    provenance = {**figprov.provenance(cores, None), "portable_cpu": "host"}
    data = run(args)
    data.update(command=figprov.command_line(cores), rounds=args.rounds)
    data["provenance"] = {**provenance, "wall_s": round(time.perf_counter() - t0, 1)}
    figprov.write_report(args.out, data, to_markdown(data))
    print(to_markdown(data))
    return data


if __name__ == "__main__":
    main()
