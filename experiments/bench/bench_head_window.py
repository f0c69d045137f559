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
import time

from experiments.lib import figprov, micro_step_bench, workers  # import no JAX

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/
ARMS = ("full", "response")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    micro_step_bench.add_shape_args(p)
    p.add_argument("--overrides", nargs="*", default=["model.head_backward=compute"], help="model.key=value")
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_head_window.json"))
    return micro_step_bench.check_shape_args(p, p.parse_args(argv))


def run(args) -> dict:
    m = micro_step_bench.model_config(args, args.overrides)
    arms = {arm: (m, micro_step_bench.rl_config(args, head_window=arm)) for arm in ARMS}
    records, outs, mask = micro_step_bench.run_arms(args, arms)
    grad_rel_diff, logp_abs_diff = micro_step_bench.differences(outs["full"], outs["response"], mask)
    return {
        "arms": records,
        "grad_rel_diff": grad_rel_diff,
        "logp_abs_diff": logp_abs_diff,
        "shape": micro_step_bench.shape_line(args, args.overrides),
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
