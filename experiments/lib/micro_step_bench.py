"""The learner's micro-batch gradient program under two or more settings, side by side in one
process (bench_head_window, bench_attention_backward).

The program is the one the learner jits for a micro-batch (rl/bucketed.py BucketedUpdate._micro,
the fused path: pi_old from the update's own forward, pi_ref teacher-forced inside it as with
loss.beta > 0), at the real-model GRPO iteration's shape (bench_vs_trl's fixed regime):
SmolLM2-135M-Instruct's layers with random weights (experiments/lib/decode_bench.py's smollm2
profile), a micro-batch of rows each a prompt then a response, `width` positions wide. Every arm's
program is compiled first; then the timed steps alternate between the arms (one step of each arm
a round, after one untimed step each), so all see the same state of the host.
"""

from __future__ import annotations

import argparse
import re
import resource
import statistics
import time

from experiments.lib import figprov, workers


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The micro-batch's shape and the timing's rounds (each script adds its own arms)."""
    p.add_argument("--dtype", default="bfloat16", help="model.dtype (float32 master weights either way)")
    p.add_argument("--rows", type=int, default=4, help="rows of the micro-batch (rl.update.micro_batch_size)")
    p.add_argument("--prompt-tokens", type=int, default=57, help="each row's prompt (chat arithmetic: 55-59)")
    p.add_argument("--response-tokens", type=int, default=128, help="each row's response (rollout.max_new_tokens)")
    p.add_argument("--width", type=int, default=192, help="the micro-batch's width (a length bucket of 64)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds, one step of each arm per round")
    p.add_argument("--smoke", action="store_true", help="a tiny model, one round (tests)")


def check_shape_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.smoke:
        args.rows, args.prompt_tokens, args.response_tokens, args.width, args.rounds = 2, 5, 8, 16, 1
    if args.prompt_tokens + args.response_tokens > args.width:
        p.error(f"--width {args.width} holds no row of {args.prompt_tokens} + {args.response_tokens} tokens")
    return args


def model_config(args, overrides: list[str]):
    """The profile's model (a tiny one with --smoke) with --dtype over float32 masters and the
    model.key=value `overrides`, read and checked as a config's (config_io: values coerced, a bad
    one named)."""
    from experiments.lib.decode_bench import PROFILES
    from sparserl_jax.config_io import from_dict, read_tree, to_dict
    from sparserl_jax.model.config import ModelConfig

    m = ModelConfig.tiny() if args.smoke else PROFILES["smollm2"].model
    tree = read_tree(overrides=overrides)
    if set(tree) - {"model"}:
        raise ValueError(f"--overrides: only model.* settings, got {sorted(set(tree) - {'model'})}")
    settings = {**to_dict(m), "dtype": args.dtype, "param_dtype": "float32", **tree.get("model", {})}
    return from_dict(ModelConfig, settings, "model")


def rl_config(args, head_window: str):
    """The benchmarks' learner: dense GRPO with pi_ref inside the program, one micro-batch."""
    from sparserl_jax import rl

    return rl.RLConfig(
        mode="dense",
        loss=rl.LossConfig(beta=1e-4),  # pi_ref inside the program, as the benchmarks' config
        update=rl.UpdateConfig(
            minibatch_size=args.rows,
            micro_batch_size=args.rows,
            length_bucket=0,
            compile_ahead=False,
            head_window=head_window,
            temperature=0.7,
        ),
    )


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


def run_arms(args, arms: dict, inspect=None) -> tuple[dict, dict, object]:
    """`arms`: name -> (ModelConfig, RLConfig), the master weights drawn once (the first arm's
    model, float32) and every arm's compute copy cast from them. Returns (name -> record: median
    and every step's wall and CPU seconds, compile seconds, the head's rows, XLA's temporaries,
    the median step's minor page faults, and what `inspect(compiled HLO text)` returns, a dict; name -> the untimed step's outputs
    (gradient accumulator, ..., log-probs); the response mask)."""
    import jax
    import numpy as np

    from sparserl_jax.model import precision, transformer
    from sparserl_jax.rl.bucketed import BucketedUpdate
    from sparserl_jax.rl.optim import make_optimizer

    first = next(iter(arms.values()))[0]
    master = jax.device_put(transformer.init_params(first, jax.random.key(0)), jax.devices()[0])
    host = micro_batch(args, first.vocab_size)
    state = {}
    for name, (m, cfg) in arms.items():
        params = precision.compute_copy(master, m)
        up = BucketedUpdate(
            m, cfg, make_optimizer(cfg.optim), max_len=args.width, donate=False, response_len=args.response_tokens
        )
        path = up.paths(args.rows)[0]
        assert path.fused and path.ref_inside, "the bench times the fused path with pi_ref inside"
        mb, norm = up._micro_inputs(host, np.arange(args.rows), args.width, None, fused=True)
        lowered = up._micro.lower(params, params, up._zeros(master), mb, norm, fused=True)
        compiled, compile_s, _ = _timed(lowered.compile)
        state[name] = dict(up=up, params=params, compiled=compiled, mb=mb, norm=norm, compile_s=compile_s)
        state[name].update(walls=[], cpus=[], faults=[], vocab=m.vocab_size)

    def step(a):
        acc = a["up"]._zeros(master)
        jax.block_until_ready(acc)
        p = a["params"]
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        out = _timed(lambda: jax.block_until_ready(a["compiled"](p, p, acc, a["mb"], a["norm"])))
        a["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        return out

    outs = {name: step(a)[0] for name, a in state.items()}  # untimed
    for a in state.values():
        a["faults"].clear()
    for _ in range(args.rounds):
        for a in state.values():
            _, wall, cpu = step(a)
            a["walls"].append(wall)
            a["cpus"].append(cpu)
    records = {}
    for name, a in state.items():
        mem, hlo = a["compiled"].memory_analysis(), a["compiled"].as_text()
        records[name] = {
            "step_s": round(statistics.median(a["walls"]), 3),
            "step_cpu_s": round(statistics.median(a["cpus"]), 3),
            "steps_s": [round(w, 3) for w in a["walls"]],
            "step_faults": int(statistics.median(a["faults"])),  # minor page faults (the kernel's count)
            "compile_s": round(a["compile_s"], 2),
            "head_rows": head_rows(hlo, a["vocab"]),
            "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
            **(inspect(hlo) if inspect else {}),
        }
    mask = np.asarray(next(iter(state.values()))["mb"]["response_mask"])
    return records, outs, mask


def differences(outs_a, outs_b, mask) -> tuple[float, float]:
    """(the largest gradient difference relative to the largest entry of the first arm's, the
    largest absolute log-prob difference on the response positions) between two arms' outputs."""
    import jax
    import numpy as np

    grad_diff = max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max())
        for x, y in zip(jax.tree.leaves(outs_a[0]), jax.tree.leaves(outs_b[0]))
    )
    grad_scale = max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(outs_a[0]))
    logp_diff = float(np.abs(np.asarray(outs_a[3])[mask] - np.asarray(outs_b[3])[mask]).max())
    return grad_diff / grad_scale, logp_diff


def shape_line(args, overrides: list[str]) -> str:
    model = "SmolLM2-135M-Instruct layers (random weights)" if not args.smoke else "tiny model"
    return (
        f"{model}, model.dtype={args.dtype}, {' '.join(overrides) or 'no overrides'}; {args.rows} rows of "
        f"{args.width} positions, each a {args.prompt_tokens}-token prompt and a {args.response_tokens}-token "
        f"response; pi_ref inside the program (loss.beta > 0)"
    )


def report_lines(title: str, data: dict, arms: tuple[str, str], label: str) -> list[str]:
    """The report's header (title, command, provenance, the shape and the arms' differences) and
    its table's timing rows for two arms, `label` naming the setting the columns hold; each script
    adds its own rows (report_tail closes the table)."""
    a, b = (data["arms"][arm] for arm in arms)
    return [
        *figprov.report_head(title, data),
        f"Shape: {data['shape']}. One micro-batch gradient program (rl/bucketed.py BucketedUpdate._micro, "
        f"fused path), compiled per arm, then {data['rounds']} rounds alternating one step of each arm after "
        "one untimed step each. Differences between the arms: gradient "
        f"{data['grad_rel_diff']:.2g} of its largest entry, log-probs on the response positions "
        f"{data['logp_abs_diff']:.2g} (absolute).",
        "",
        f"|{' ' + label if label else ''} | {arms[0]} | {arms[1]} | {arms[1]} / {arms[0]} |",
        "|---|---:|---:|---:|",
        f"| step, median wall s | {a['step_s']} | {b['step_s']} | {b['step_s'] / a['step_s']:.2f}x |",
        f"| step, median CPU s | {a['step_cpu_s']} | {b['step_cpu_s']} | {b['step_cpu_s'] / a['step_cpu_s']:.2f}x |",
        f"| steps, wall s | {', '.join(map(str, a['steps_s']))} | {', '.join(map(str, b['steps_s']))} | |",
    ]


def report_tail(data: dict, arms: tuple[str, str]) -> list[str]:
    a, b = (data["arms"][arm] for arm in arms)
    mib = lambda x: "-" if x is None else f"{x / 2**20:.1f}"  # noqa: E731
    return [
        f"| XLA compile, s | {a['compile_s']} | {b['compile_s']} | |",
        f"| temporaries, MiB | {mib(a['temp_bytes'])} | {mib(b['temp_bytes'])} | |",
    ]


def main(parse_args, run, to_markdown, argv=None) -> dict:
    """A micro-step benchmark's command: parse, run the arms, write the JSON and its report."""
    args = parse_args(argv)
    t0, cores = time.perf_counter(), workers.available_cores()
    provenance = {**figprov.provenance(cores, None), "portable_cpu": "host"}
    data = run(args)
    data.update(command=figprov.command_line(cores), rounds=args.rounds)
    data["provenance"] = {**provenance, "wall_s": round(time.perf_counter() - t0, 1)}
    figprov.write_report(args.out, data, to_markdown(data))
    print(to_markdown(data))
    return data
