"""The learner's micro-batch gradient program with the materialised attention's backward by jax's
autodiff vs at FlashAttention-2's precision (model.attention_backward autodiff / compute), side by
side in one process.

  taskset -c 1 python experiments/bench/bench_attention_backward.py   # experiments/results/bench_attention_backward.{json,md}
  python experiments/bench/bench_attention_backward.py --smoke --out /tmp/ab.json

The program, its shape and the alternating timing are experiments/lib/micro_step_bench.py's (the
learner's fused micro-batch program at the real-model GRPO iteration's shape, SmolLM2-135M's layers
with random weights, 4 rows of a 57-token prompt and a 128-token response at width 192 by
default), here with --overrides applied to both arms (default: the bfloat16 options the
benchmarks run with) and --head-window. Per arm: the step's median wall and CPU seconds, the
products of the compiled program by operand and result types (XLA:CPU's bfloat16 kernels take
bfloat16 x bfloat16 -> float32; a float32 product is widened or float32 work), XLA's
temporaries; and the largest difference of the arms' gradients (relative to its largest entry)
and response log-probs: bfloat16 roundings of P and dS in the backward, none in the forward but
the summation order. A timing of this CPU: the host's own numerics (no portable settings),
recorded with the machine (experiments/lib/figprov.py).
"""

from __future__ import annotations

import argparse
import collections
import os
import re

from experiments.lib import micro_step_bench  # import no JAX

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/
ARMS = ("autodiff", "compute")  # model.attention_backward
DEFAULT_OVERRIDES = ["model.head_backward=compute"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    micro_step_bench.add_shape_args(p)
    p.add_argument("--overrides", nargs="*", default=DEFAULT_OVERRIDES, help="model.key=value, both arms")
    p.add_argument("--head-window", default="response", help="rl.update.head_window, both arms")
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_attention_backward.json"))
    return micro_step_bench.check_shape_args(p, p.parse_args(argv))


def product_types(hlo: str) -> dict[str, int]:
    """How many dots of a compiled program take each (lhs, rhs -> out) element type: the
    operands' types read from the instructions (or fused parameters) they name."""
    types = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (\w+)\[", line)
        if m:
            types[m.group(1)] = m.group(2)
    counts = collections.Counter()
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = (\w+)\[[^\]]*\]\S* dot\(%([^,\s]+), %([^,\s)]+)", line)
        if m:
            out, lhs, rhs = m.groups()
            counts[f"{types.get(lhs, '?')} x {types.get(rhs, '?')} -> {out}"] += 1
    return dict(sorted(counts.items()))


def run(args) -> dict:
    arms = {
        arm: (
            micro_step_bench.model_config(args, [*args.overrides, f"model.attention_backward={arm}"]),
            micro_step_bench.rl_config(args, head_window=args.head_window),
        )
        for arm in ARMS
    }
    records, outs, mask = micro_step_bench.run_arms(args, arms, inspect=lambda hlo: {"products": product_types(hlo)})
    grad_rel_diff, logp_abs_diff = micro_step_bench.differences(outs["autodiff"], outs["compute"], mask)
    return {
        "arms": records,
        "grad_rel_diff": grad_rel_diff,
        "logp_abs_diff": logp_abs_diff,
        "shape": micro_step_bench.shape_line(args, [*args.overrides, f"rl.update.head_window={args.head_window}"]),
    }


def to_markdown(data: dict) -> str:
    a, c = data["arms"]["autodiff"], data["arms"]["compute"]
    title = "The learner's micro-batch program: the attention's backward by autodiff vs at FlashAttention-2's precision"
    lines = [
        *micro_step_bench.report_lines(title, data, ARMS, "model.attention_backward"),
        *(
            f"| products {k} (compiled) | {a['products'].get(k, 0)} | {c['products'].get(k, 0)} | |"
            for k in sorted(set(a["products"]) | set(c["products"]))
        ),
        *micro_step_bench.report_tail(data, ARMS),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    return micro_step_bench.main(parse_args, run, to_markdown, argv)


if __name__ == "__main__":
    main()
