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

from experiments.lib import micro_step_bench  # import no JAX

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
    title = "The learner's micro-batch program: the LM head over every position vs the response window"
    lines = [
        *micro_step_bench.report_lines(title, data, ARMS, ""),
        f"| the head's rows per chunk (compiled) | {', '.join(map(str, f['head_rows']))} | "
        f"{', '.join(map(str, r['head_rows']))} | |",
        *micro_step_bench.report_tail(data, ARMS),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    return micro_step_bench.main(parse_args, run, to_markdown, argv)


if __name__ == "__main__":
    main()
