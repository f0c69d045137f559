"""Benchmark the sparse-KV decode attention kernel alone against the XLA reference and
jax.nn.dot_product_attention, and report achieved HBM bandwidth against a measured copy bandwidth.

Decode attention reads each live K/V slot once and does ~4 flops per byte, so it is bandwidth
bound: the figure of merit is (bytes of K+V in live slots) / time, compared with the bandwidth of
a plain device copy (bytes read + written / time). The reference and dot_product_attention read
the whole capacity C whatever the fill, so they are also shown per capacity byte.

    python experiments/bench/bench_kernel.py                      # GPU defaults: Qwen2.5-1.5B heads
    python experiments/bench/bench_kernel.py --cpu-small          # small shapes, XLA paths only
    python experiments/bench/bench_kernel.py --fill-frac 0.25 --ragged --dtype float32

Writes JSON (device kind, jax version, exact command line, shapes, timings) to --out and prints
a markdown table. Not a test.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import sys

import jax
import jax.numpy as jnp

from experiments.lib.kernel_timing import copy_bandwidth, make_inputs, time_fn
from sparserl_jax import kernels

GPU_DEFAULTS = dict(batch=256, heads=12, kv_heads=2, head_dim=128, capacity=640, dtype="bfloat16")
CPU_DEFAULTS = dict(batch=4, heads=12, kv_heads=2, head_dim=128, capacity=256, dtype="float32")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, help="sequences B (GPU default 256)")
    p.add_argument("--heads", type=int, help="query heads N (default 12)")
    p.add_argument("--kv-heads", type=int, help="KV heads K (default 2)")
    p.add_argument("--head-dim", type=int, help="head dim H (default 128)")
    p.add_argument("--capacity", type=int, help="cache slots C (GPU default 640)")
    p.add_argument("--fill-frac", type=float, default=1.0, help="live slots / C per row")
    p.add_argument(
        "--ragged", action="store_true", help="fills uniform in [1, 2 * fill_frac * C] (clipped to C) instead of equal"
    )
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--iters", type=int, default=20, help="calls per timed repeat")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats (median is reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--block-c", type=int, default=None, help="kernel slots per tile")
    p.add_argument("--num-splits", type=int, default=None, help="kernel splits of C")
    p.add_argument("--copy-mib", type=int, default=None, help="size of the copy-bandwidth probe (GPU/TPU 1024, CPU 64)")
    p.add_argument(
        "--cpu-small", action="store_true", help="small CPU shapes (automatic when the default backend is cpu)"
    )
    p.add_argument(
        "--interpret", action="store_true", help="on CPU, also time the Pallas kernel in interpret mode (slow)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default experiments/results/bench_kernel_<platform>.json)")
    return p.parse_args(argv)


def candidates(platform: str, args) -> dict:
    """name -> (jitted fn, takes BKCH cache?) for every implementation timed on this platform."""
    opts = dict(block_c=args.block_c, num_splits=args.num_splits)
    fns = {"xla_reference": jax.jit(functools.partial(kernels.decode_attention, impl="xla"))}
    if platform in kernels.PALLAS_PLATFORMS:
        fns["pallas_kernel"] = jax.jit(lambda q, k, v, f: kernels.decode_attention(q, k, v, f, impl="pallas", **opts))
    elif args.interpret:
        fns["pallas_interpret"] = jax.jit(
            lambda q, k, v, f: kernels.decode_attention(q, k, v, f, impl="interpret", **opts)
        )

    def sdpa(implementation):
        # q [B, 1, N, H] against the cache laid out [B, C, K, H] (transposed once, untimed).
        def run(q, k_BCKH, v_BCKH, f):
            o, lse = jax.nn.dot_product_attention(
                q[:, None],
                k_BCKH,
                v_BCKH,
                key_value_seq_lengths=f,
                implementation=implementation,
                return_residual=True,
            )
            return o[:, 0], lse[:, 0]

        return jax.jit(run)

    fns["jax_nn_dpa_xla"] = sdpa("xla")
    if platform == "gpu":
        fns["jax_nn_dpa_cudnn"] = sdpa("cudnn")
    return fns


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    platform = kernels.current_platform()
    defaults = CPU_DEFAULTS if (args.cpu_small or platform == "cpu") else GPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    B, N, K, H, C = args.batch, args.heads, args.kv_heads, args.head_dim, args.capacity
    dtype = jnp.dtype(args.dtype)
    timing = dict(iters=args.iters, repeats=args.repeats, warmup=args.warmup)

    q, k, v, fill = make_inputs(B, N, K, C, H, dtype, args.fill_frac, args.ragged, args.seed)
    k_BCKH, v_BCKH = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    live_slots = int(jnp.minimum(fill, C).sum())
    live_bytes = 2 * live_slots * K * H * dtype.itemsize  # K and V of live slots
    capacity_bytes = 2 * B * C * K * H * dtype.itemsize
    copy_mib = args.copy_mib or (64 if platform == "cpu" else 1024)
    copy_bps = copy_bandwidth(copy_mib, **timing)
    o_ref, lse_ref = jax.jit(kernels.decode_attention_ref)(q, k, v, fill)
    o_ref32 = o_ref.astype(jnp.float32)

    rows = []
    for name, fn in candidates(platform, args).items():
        inputs = (q, k_BCKH, v_BCKH, fill) if name.startswith("jax_nn") else (q, k, v, fill)
        row = {"impl": name}
        try:
            o, lse = fn(*inputs)
            seconds = time_fn(fn, inputs, **timing)
        except Exception as err:  # e.g. cuDNN rejecting a shape: record it and go on
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            rows.append(row)
            continue
        row.update(
            ms=seconds * 1e3,
            live_GBps=live_bytes / seconds / 1e9,
            capacity_GBps=capacity_bytes / seconds / 1e9,
            live_frac_of_copy=live_bytes / seconds / copy_bps,
            max_abs_err_o=float(jnp.max(jnp.abs(o.astype(jnp.float32) - o_ref32))),
            max_abs_err_lse=float(jnp.max(jnp.abs(lse.astype(jnp.float32) - lse_ref))),
        )
        rows.append(row)

    device = jax.devices()[0]
    report = {
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "platform": platform,
        "device_kind": device.device_kind,
        "jax_version": jax.__version__,
        "shapes": dict(
            batch=B,
            heads=N,
            kv_heads=K,
            head_dim=H,
            capacity=C,
            dtype=dtype.name,
            fill_frac=args.fill_frac,
            ragged=args.ragged,
            live_slots=live_slots,
        ),
        "kernel_options": dict(block_c=args.block_c, num_splits=args.num_splits),
        "timing": timing,
        "bytes": dict(live_kv=live_bytes, capacity_kv=capacity_bytes),
        "copy_GBps": copy_bps / 1e9,
        "copy_probe_MiB": copy_mib,
        "results": rows,
    }
    out = args.out or os.path.join("experiments", "results", f"bench_kernel_{platform}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as fh:
        json.dump(report, fh, indent=2)
    print(markdown(report))
    print(f"\nwrote {out}")
    return report


def markdown(report: dict) -> str:
    s = report["shapes"]
    lines = [
        f"{report['device_kind']} ({report['platform']}), jax {report['jax_version']}; "
        f"B={s['batch']} N={s['heads']} K={s['kv_heads']} H={s['head_dim']} C={s['capacity']} "
        f"{s['dtype']} fill_frac={s['fill_frac']}{' ragged' if s['ragged'] else ''}; "
        f"copy bandwidth {report['copy_GBps']:.1f} GB/s",
        "",
        "| impl | ms | live GB/s | capacity GB/s | live / copy | max err o | max err lse |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"| {r['impl']} | error: {r['error'][:80]} | | | | | |")
            continue
        lines.append(
            f"| {r['impl']} | {r['ms']:.4f} | {r['live_GBps']:.1f} | {r['capacity_GBps']:.1f} | "
            f"{r['live_frac_of_copy']:.1%} | {r['max_abs_err_o']:.2e} | "
            f"{r['max_abs_err_lse']:.2e} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
