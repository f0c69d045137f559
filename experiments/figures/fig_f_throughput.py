"""Figure f: rollout throughput and KV memory against response length, from the decode benchmark
(paper claim: a fixed-size cache makes the saving physical: measured bytes and faster decode).

  python experiments/figures/fig_f_throughput.py                   # plots experiments/results/bench_decode_cpu.json
  python experiments/figures/fig_f_throughput.py --bench-json experiments/results/bench_decode_gpu.json
  python experiments/figures/fig_f_throughput.py --run -- --lengths 1024 4096   # run the benchmark first
  python experiments/figures/fig_f_throughput.py --smoke          # a seconds-long benchmark, then the plot
  python experiments/figures/fig_f_throughput.py --replot experiments/results/fig_f_throughput

With --run (or --smoke) experiments/bench/bench_decode.py runs first with the arguments after `--` and
writes the JSON this figure reads.
"""

from __future__ import annotations

import json
import os

from experiments.lib import decode_bench as bench_decode
from experiments.lib import figlib

SMOKE_BENCH = [
    "--profile",
    "cpu",
    "--n-layers",
    "1",
    "--batch",
    "2",
    "--prompt-len",
    "8",
    "--lengths",
    "16",
    "32",
    "--budget",
    "8",
    "--buffer",
    "8",
    "--window",
    "2",
    "--policies",
    "none",
    "streaming",
    "snapkv",
    "--min-seconds",
    "0",
]


def arguments(p) -> None:
    p.add_argument("--bench-json", default=os.path.join(figlib.HERE, "results", "bench_decode_cpu.json"))
    p.add_argument("--run", action="store_true", help="run the decode benchmark first")
    p.add_argument("bench_args", nargs="*", help="arguments for bench_decode.py (after --)")


def run(args, _study) -> dict:
    if args.smoke or args.run:
        os.makedirs(args.out, exist_ok=True)
        args.bench_json = os.path.join(args.out, "bench.json")
        bench_decode.main((SMOKE_BENCH if args.smoke else []) + list(args.bench_args) + ["--out", args.bench_json])
    with open(args.bench_json) as f:
        report = json.load(f)
    rows = [r for r in report["results"] if "error" not in r]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    longest = max(r["new_tokens"] for r in rows)
    by = {(r["policy"], r["new_tokens"]): r for r in rows}
    return {
        "bench_json": os.path.relpath(args.bench_json, figlib.REPO),
        "bench_command": report["command"],
        "bench": {k: report[k] for k in ("device_kind", "platform", "jax_version", "date", "setting")},
        "rows": rows,
        "speedup_at_longest": {
            pol: by[pol, longest].get("speedup_vs_dense") for pol in policies if (pol, longest) in by
        },
        "kv_ratio_at_longest": {
            pol: by[pol, longest]["kv_bytes"] / by["none", longest]["kv_bytes"]
            for pol in policies
            if (pol, longest) in by and ("none", longest) in by
        },
    }


def render(data: dict, _base, _command: str) -> figlib.Rendered:
    rows = data["rows"]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    lengths = sorted({r["new_tokens"] for r in rows})
    by = {(r["policy"], r["new_tokens"]): r for r in rows}
    head = f"From `{data['bench_command']}`" + (
        f" on {b['device_kind']} ({b['platform']}), jax {b['jax_version']}, {b['date']}. Batch "
        f"{b['setting']['batch']}, sparse budget {b['setting']['budget']} + buffer {b['setting']['buffer']}."
        if (b := data.get("bench"))
        else f" ({data['bench_json']})."
    )
    body = []  # per policy and length: tokens/s (x dense), KV MiB
    for pol in policies:
        body.append(
            [
                pol,
                *(
                    "-"
                    if r is None
                    else f"{r['tokens_per_s']:.0f} ({r.get('speedup_vs_dense', float('nan')):.2f}x), "
                    f"{r['kv_bytes'] / 2**20:.1f}"
                    for r in (by.get((pol, n)) for n in lengths)
                ),
            ]
        )
    lines = [head, "", *figlib.md_table(["policy", *(f"{n} tokens: tok/s (x dense), KV MiB" for n in lengths)], body)]

    fig, axes = figlib.panels(2, 5.4)
    panels = (
        ("tokens_per_s", "rollout throughput", "tokens / s", 1.0),
        ("speedup_vs_dense", "throughput relative to dense", "x dense tokens / s", 1.0),
        ("step_ms", "decode step time", "ms per step", 1.0),
        ("kv_bytes", "KV cache memory", "MiB", 2.0**-20),
    )
    for ax, (key, title, ylabel, scale) in zip(axes, panels):
        for pol in policies:
            xs = [n for n in lengths if (pol, n) in by and key in by[pol, n]]
            ax.plot(
                xs,
                [by[pol, n][key] * scale for n in xs],
                marker="o",
                ms=3,
                label=pol,
                color=figlib.POLICY_COLOURS.get(pol, "black"),
            )
        ax.set_xscale("log", base=2)
        ax.set(xlabel="new tokens per sequence", ylabel=ylabel, title=title)
    axes[3].set_yscale("log")
    figlib.band_legend_below(fig, axes[0], ncol=len(policies))
    fig.suptitle(
        "Figure f: decode throughput and KV memory vs response length\n"
        f"{os.path.basename(data['bench_json'])}; sparse policies at a fixed budget + buffer"
    )
    caption = (
        "Figure: decode throughput (tokens per second over the batch), its ratio to dense decoding, "
        "the time of one decode step and the KV cache's size against the number of new tokens, "
        "per KV policy ('none': the dense cache, in the dense arm's blue), as "
        "experiments/bench/bench_decode.py measured them (no spread recorded: no error bars). The dense "
        "path reads every preallocated slot of its cache from the first step (bench_decode's notes), "
        "so the speed-up is against that dense path, not one that reads only the filled slots."
    )
    return figlib.Rendered(
        "Figure f: rollout throughput and KV memory vs response length", "\n".join(lines), {"throughput": fig}, caption
    )


FIGURE = figlib.Figure("fig_f_throughput", __doc__, run, render, arguments, seeds=None, trains=False)

main = FIGURE.main


if __name__ == "__main__":
    main()
