"""Figure f: rollout throughput and KV memory against response length, from the decode benchmark
(paper claim: a fixed-size cache makes the saving physical: measured bytes and faster decode).

  python experiments/fig_f_throughput.py                   # plots experiments/results/bench_decode_cpu.json
  python experiments/fig_f_throughput.py --bench-json experiments/results/bench_decode_gpu.json
  python experiments/fig_f_throughput.py --run -- --lengths 1024 4096   # run the benchmark first
  python experiments/fig_f_throughput.py --smoke          # a seconds-long benchmark, then the plot

With --run (or --smoke) experiments/bench_decode.py runs first with the arguments after `--` and
writes the JSON this figure reads.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

import bench_decode
import figlib

SMOKE_BENCH = ["--profile", "cpu", "--n-layers", "1", "--batch", "2", "--prompt-len", "8",
               "--lengths", "16", "32", "--budget", "8", "--buffer", "8", "--window", "2",
               "--policies", "none", "streaming", "snapkv", "--min-seconds", "0"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench-json", default=os.path.join(figlib.HERE, "results", "bench_decode_cpu.json"))
    p.add_argument("--out", help="output directory (default experiments/results/fig_f_throughput)")
    p.add_argument("--run", action="store_true", help="run the decode benchmark first")
    p.add_argument("--smoke", action="store_true", help="run a seconds-long benchmark first")
    p.add_argument("bench_args", nargs="*", help="arguments for bench_decode.py (after --)")
    args = p.parse_args(argv)
    out = args.out or figlib.default_out("fig_f_throughput")
    if args.smoke or args.run:
        os.makedirs(out, exist_ok=True)
        args.bench_json = os.path.join(out, "bench.json")
        bench_decode.main((SMOKE_BENCH if args.smoke else []) + list(args.bench_args)
                          + ["--out", args.bench_json])
    with open(args.bench_json) as f:
        report = json.load(f)
    rows = [r for r in report["results"] if "error" not in r]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    lengths = sorted({r["new_tokens"] for r in rows})
    by = {(r["policy"], r["new_tokens"]): r for r in rows}

    lines = [
        f"From `{report['command']}` on {report['device_kind']} ({report['platform']}), jax "
        f"{report['jax_version']}, {report['date']}. Batch {report['setting']['batch']}, sparse "
        f"budget {report['setting']['budget']} + buffer {report['setting']['buffer']}.",
        "",
        "| policy | " + " | ".join(f"{n} tokens: tok/s (x dense), KV MiB" for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for pol in policies:
        cells = []
        for n in lengths:
            r = by.get((pol, n))
            cells.append("-" if r is None else
                         f"{r['tokens_per_s']:.0f} ({r.get('speedup_vs_dense', float('nan')):.2f}x), "
                         f"{r['kv_bytes'] / 2**20:.1f}")
        lines.append(f"| {pol} | " + " | ".join(cells) + " |")

    fig, axes = figlib.plt.subplots(1, 3, figsize=(14, 3.6))
    for pol in policies:
        xs = [n for n in lengths if (pol, n) in by]
        style = dict(marker="o", label=pol, color="k" if pol == "none" else None)
        axes[0].plot(xs, [by[pol, n]["tokens_per_s"] for n in xs], **style)
        axes[1].plot(xs, [by[pol, n]["step_ms"] for n in xs], **style)
        axes[2].plot(xs, [by[pol, n]["kv_bytes"] / 2**20 for n in xs], **style)
    for ax, title in zip(axes, ("rollout tokens/s", "ms per decode step", "KV cache MiB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("new tokens")
        ax.set_title(title)
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    data = {"bench_json": os.path.relpath(args.bench_json, figlib.REPO), "bench_command": report["command"],
            "rows": rows, "speedup_at_longest": {
                pol: by[pol, lengths[-1]].get("speedup_vs_dense") for pol in policies
                if (pol, lengths[-1]) in by},
            "kv_ratio_at_longest": {
                pol: by[pol, lengths[-1]]["kv_bytes"] / by["none", lengths[-1]]["kv_bytes"]
                for pol in policies if (pol, lengths[-1]) in by and ("none", lengths[-1]) in by}}
    figlib.write_outputs(out, "Figure f: rollout throughput and KV memory vs response length",
                         "\n".join(lines), data, fig, "throughput")
    return data


if __name__ == "__main__":
    main()
