"""Benchmark rollout decoding: tokens/s and KV bytes of the dense sampler and of each eviction
policy (budget B + buffer) across generation lengths, on one model and batch, side by side.

A sparse cache holds budget + buffer slots whatever the length, so its per-step time should stay
flat in the generated length while the dense cache (prompt + max new tokens slots) grows with it;
the acceptance targets are sparse tokens/s >= 2x dense at 8k new tokens on the CPU profile
(budget 256 + buffer 64) and >= 3x on the GPU profile (Qwen2.5-1.5B shape, budget 512 + 128).

    python experiments/bench/bench_decode.py                         # cpu profile (default without GPU)
    python experiments/bench/bench_decode.py --profile gpu           # Qwen2.5-1.5B-shaped, bf16
    python experiments/bench/bench_decode.py --profile gpu --dry-run # lower the GPU path at reduced size
    python experiments/bench/bench_decode.py --lengths 1024 4096 --policies none streaming --batch 4
    python experiments/bench/bench_decode.py --quant none w8a16 int8 fp8  # QuRL's quantized weights
    python experiments/bench/bench_decode.py --n-layers 2 --vocab 151936 --agreement-k 0 20 --breakdown

`--quant` adds rows with quantized weights (sparserl_jax.quant): w8a16 (int8 weight-only), int8
(W8A8, int8 dot with int32 accumulation) and fp8 (W8A8 e4m3); weight MiB is what one decode step
reads (quantized values + float32 scales, embedding and lm_head in full precision). On CPU a
quantized dot may be slower than the full-precision one; the GPU target is W8A8 faster than bf16
at batch >= 64 on the 1.5B shape.

`--agreement-k 0 20` runs every row without and with the agreement's top candidates (the sampler
records each token's 20 most probable tokens, a top-k over the vocabulary every step;
rollout.agreement_k), `--vocab` sets the vocabulary (151936: Qwen's), and `--breakdown` times the
pieces of a step beside each row (experiments/lib/decode_breakdown.py: the logits head, sampling,
the candidates, attention, the compression per step, and the rest).

Every sequence decodes exactly max_new_tokens (no EOS). Compile time is an AOT lower + compile;
the timed figure is the median over the calls of a row (at least --repeats, and at least
--min-seconds in all), each with a fresh key. Writes JSON (every row, device kind, jax version,
exact command line, date) and a markdown table next to it.
Not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import json
import math
import os
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from experiments.lib import decode_bounds, decode_breakdown, figprov, workers
from sparserl_jax import kernels, quant
from sparserl_jax.kvcache import KVConfig
from sparserl_jax.kvcache.policies import POLICIES
from sparserl_jax.model import transformer
from sparserl_jax.model.config import DTYPES, ModelConfig
from sparserl_jax.rollout.sampler import SamplerConfig, cache_capacity, generate
from sparserl_jax.rollout.sampling import DRAWS, TOPK_METHODS, SamplingConfig, topk_method

DENSE = "none"
QUANT = {  # --quant label -> (quant.format, quant.mode)
    "none": ("none", "w8a8"),
    "w8a16": ("int8", "w8a16"),
    "int8": ("int8", "w8a8"),
    "fp8": ("fp8", "w8a8"),
}
SPARSE_POLICIES = tuple(p for p in POLICIES if p != DENSE)  # the registry's eviction policies


@dataclasses.dataclass(frozen=True)
class Profile:
    """One benchmark setting: the model, the batch and prompt, lengths, and the sparse cache."""

    model: ModelConfig
    batch: int
    prompt_len: int
    lengths: tuple[int, ...]
    budget: int
    buffer: int
    window: int
    target_length: int  # new tokens at which the acceptance speedup is checked
    target_speedup: float | None  # sparse tokens/s over dense tokens/s required there (None: no target)


PROFILES: dict[str, Profile] = {
    "cpu": Profile(
        model=ModelConfig(
            family="qwen2",
            vocab_size=512,
            d_model=256,
            n_layers=4,
            n_heads=8,
            n_kv_heads=2,
            head_dim=32,
            d_ff=512,
            max_seq_len=9000,
            qkv_bias=True,
        ),
        batch=4,
        prompt_len=64,
        lengths=(1024, 4096, 8192),
        budget=256,
        buffer=64,
        window=8,
        target_length=8192,
        target_speedup=2.0,
    ),
    "gpu": Profile(  # Qwen2.5-1.5B shapes, random bf16 weights
        model=ModelConfig(
            family="qwen2",
            vocab_size=151936,
            d_model=1536,
            n_layers=28,
            n_heads=12,
            n_kv_heads=2,
            head_dim=128,
            d_ff=8960,
            rope_theta=1e6,
            tie_embeddings=True,
            qkv_bias=True,
            max_seq_len=32768,
            dtype="bfloat16",
        ),
        batch=64,
        prompt_len=256,
        lengths=(4096, 8192, 16384),
        budget=512,
        buffer=128,
        window=8,
        target_length=8192,
        target_speedup=3.0,
    ),
}


# the GRPO iteration's rollout on a CPU (bench_vs_trl's and bench_precision's fixed regime): 16
# responses of 128 tokens; the sparse cache at the real-model studies' R-KV 64 + 16
PROFILES["smollm2"] = Profile(
    # SmolLM2-135M-Instruct's shape (experiments/configs/real/arch/smollm2-135m-instruct.json; a test
    # checks they agree), random float32 weights
    model=ModelConfig(
        family="llama",
        vocab_size=49152,
        d_model=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        d_ff=1536,
        rope_theta=100000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
        max_seq_len=8192,
    ),
    batch=16,
    prompt_len=64,
    lengths=(128,),
    budget=64,
    buffer=16,
    window=8,
    target_length=128,
    target_speedup=None,  # a training iteration's rollout: its figure is the step against its bounds
)
# --dry-run lowers the chosen profile with these reductions (layers, batch, one short length).
DRY_RUN = dict(n_layers=2, batch=2, new_tokens_in_buffers=2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--profile", choices=tuple(PROFILES), help="model and defaults (default: gpu on a GPU backend, else cpu)"
    )
    p.add_argument("--lengths", type=int, nargs="+", help="new tokens per sequence")
    p.add_argument("--batch", type=int, help="sequences decoded together")
    p.add_argument("--prompt-len", type=int, help="prompt tokens per sequence")
    p.add_argument(
        "--policies",
        nargs="+",
        default=[DENSE, *SPARSE_POLICIES],
        help=f"'{DENSE}' (dense) and/or eviction policies {SPARSE_POLICIES}",
    )
    p.add_argument(
        "--quant",
        nargs="+",
        default=["none"],
        choices=tuple(QUANT),
        help="weight formats: none (the model dtype), w8a16, int8 (W8A8), fp8 (W8A8)",
    )
    p.add_argument("--budget", type=int, help="kv.budget B of kept entries")
    p.add_argument("--buffer", type=int, help="kv.buffer of new entries between compressions")
    p.add_argument("--window", type=int, help="kv.window w")
    p.add_argument("--n-layers", type=int, help="override the profile's layer count")
    p.add_argument("--vocab", type=int, help="override the profile's vocabulary size (151936: Qwen2.5's)")
    p.add_argument("--dtype", choices=DTYPES, help="override the profile's compute dtype (model.dtype)")
    p.add_argument(
        "--agreement-k",
        type=int,
        nargs="+",
        default=[0],
        help="the agreement's top candidates each token records (0: none); several: a row for each",
    )
    p.add_argument("--agreement-topk", default="auto", choices=TOPK_METHODS, help="how the candidates are found")
    p.add_argument(
        "--draws",
        nargs="+",
        default=["gumbel"],
        choices=DRAWS,
        help="how each token is drawn (rollout.draw); several: a row for each",
    )
    p.add_argument(
        "--bounds",
        action="store_true",
        help="measure the host's matmul peak and read bandwidth and put each row's step against its "
        "compute and bandwidth bounds (experiments/lib/decode_bounds.py)",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the step's pieces at each row's shapes (experiments/lib/decode_breakdown.py)",
    )
    p.add_argument("--repeats", type=int, default=1, help="least timed calls per row (the median is reported)")
    p.add_argument(
        "--min-seconds",
        type=float,
        default=8.0,
        help="keep calling a row until its timed calls add up to this many seconds "
        "(steadies the short rows against background load)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn-impl", default="auto", choices=kernels.IMPLS)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="only eval_shape and .lower() every row at a reduced size; writes nothing",
    )
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default experiments/results/bench_decode_<profile>.json; the markdown goes next to it)",
    )
    return p.parse_args(argv)


def resolve(args: argparse.Namespace) -> tuple[str, Profile]:
    """The profile with command-line overrides applied."""
    name = args.profile or ("gpu" if kernels.current_platform() == "gpu" else "cpu")
    prof = PROFILES[name]
    model = prof.model
    if args.n_layers:
        model = dataclasses.replace(model, n_layers=args.n_layers)
    if args.vocab:
        model = dataclasses.replace(model, vocab_size=args.vocab)
    if args.dtype:
        model = dataclasses.replace(model, dtype=args.dtype)
    over = {k: getattr(args, k) for k in ("batch", "prompt_len", "budget", "buffer", "window")}
    prof = dataclasses.replace(prof, model=model, **{k: v for k, v in over.items() if v})
    if args.lengths:
        prof = dataclasses.replace(prof, lengths=tuple(args.lengths))
    for policy in args.policies:
        if policy != DENSE and policy not in SPARSE_POLICIES:
            raise ValueError(f"--policies {policy!r}: expected {DENSE!r} or one of {SPARSE_POLICIES}")
    need = prof.prompt_len + max(prof.lengths) + prof.buffer
    if prof.model.max_seq_len < need:
        prof = dataclasses.replace(prof, model=dataclasses.replace(prof.model, max_seq_len=need))
    return name, prof


def kv_config(policy: str, prof: Profile) -> KVConfig:
    """Dense decodes in chunks of the same buffer, so both loops have the same structure."""
    return KVConfig(policy=policy, budget=prof.budget, buffer=prof.buffer, window=prof.window)


def kv_bytes(model: ModelConfig, batch: int, capacity: int) -> int:
    """Physical key + value bytes of the decode cache: B * L * 2 * K * C * H * itemsize."""
    itemsize = jnp.dtype(model.dtype).itemsize
    return batch * model.n_layers * 2 * model.n_kv_heads * capacity * model.head_dim * itemsize


def make_inputs(prof: Profile, key: jax.Array) -> tuple[Int[Array, "B P"], Int[Array, " B"]]:
    """Random prompt tokens (never pad) of the profile's full prompt length."""
    prompts_BxP = jax.random.randint(key, (prof.batch, prof.prompt_len), 1, prof.model.vocab_size, jnp.int32)
    lengths_B = jnp.full((prof.batch,), prof.prompt_len, jnp.int32)
    return prompts_BxP, lengths_B


def quantized(params, label: str):
    fmt, mode = QUANT[label]
    return quant.quantize_params(params, quant.QuantConfig(format=fmt, mode=mode))


def low_precision_dots(hlo_text: str) -> int:
    """dot_generals of the lowered text with an int8 or float8 operand."""
    return sum(
        1 for line in hlo_text.splitlines() if "dot_general" in line and ("xi8>" in line or "xf8E4M3FN>" in line)
    )


def bench_row(
    params,
    prof: Profile,
    policy: str,
    new_tokens: int,
    prompts_BxP,
    lengths_B,
    *,
    repeats: int,
    min_seconds: float,
    seed: int,
    attn_impl: str,
    quant_label: str = "none",
    agreement_k: int = 0,
    agreement_topk: str = "auto",
    draw: str = "gumbel",
    trace_dir: str | None = None,
) -> dict:
    """Compile (timed apart), then time full rollouts with fresh keys: at least `repeats` calls
    and at least `min_seconds` in all; the median call is reported. `agreement_k`: the top
    candidates each token records (found as `agreement_topk` says), 0 none; `draw`: how each token
    is drawn (rollout/sampling.py DRAWS; temperature 1, no filters). `trace_dir`: the
    timed calls run inside a jax.profiler trace written there (the compile is not traced)."""
    kv_cfg = kv_config(policy, prof)
    cfg = SamplerConfig(
        max_new_tokens=new_tokens,
        sampling=SamplingConfig(draw=draw),
        kv=kv_cfg,
        eos_token_ids=(),
        attn_impl=attn_impl,
        agreement_k=agreement_k,
        agreement_topk=agreement_topk,
    )
    capacity = cache_capacity(kv_cfg, prof.prompt_len, new_tokens)
    t0 = time.perf_counter()
    compiled = (
        jax.jit(generate, static_argnames=("model_cfg", "cfg"))
        .lower(params, prof.model, prompts_BxP, lengths_B, jax.random.key(seed), cfg)
        .compile()
    )
    compile_s = time.perf_counter() - t0
    seconds = []
    trace = contextlib.nullcontext() if trace_dir is None else jax.profiler.trace(trace_dir, create_perfetto_link=False)
    with trace:
        while len(seconds) < max(repeats, 1) or sum(seconds) < min_seconds:
            key = jax.random.fold_in(jax.random.key(seed), len(seconds) + 1)
            t0 = time.perf_counter()
            rollout = jax.block_until_ready(compiled(params, prompts_BxP, lengths_B, key))
            seconds.append(time.perf_counter() - t0)
            if int(jnp.min(rollout.lengths)) != new_tokens:  # the timing assumes full-length rows
                raise RuntimeError(f"policy={policy}: a sequence stopped before {new_tokens} tokens")
    wall_s = statistics.median(seconds)
    return dict(
        policy=policy,
        quant=quant_label,
        agreement_k=agreement_k,
        agreement_topk=topk_method(agreement_topk) if agreement_k else None,
        draw=draw,
        weight_bytes=quant.quantized_bytes(params),
        new_tokens=new_tokens,
        batch=prof.batch,
        prompt_len=prof.prompt_len,
        tokens_per_s=prof.batch * new_tokens / wall_s,
        step_ms=wall_s / new_tokens * 1e3,
        wall_s=wall_s,
        wall_s_all=seconds,
        compile_s=compile_s,
        kv_capacity=capacity,
        kv_bytes=kv_bytes(prof.model, prof.batch, capacity),
        n_compressions=int(jnp.max(rollout.n_compressions)),
        evicted_fraction=float(jnp.mean(rollout.evicted_fraction)),
    )


def add_speedups(rows: list[dict]) -> None:
    """speedup_vs_dense = tokens/s over the dense row's at the same length, batch, weights and
    candidates (None without one); speedup_vs_full_precision likewise over the same policy's
    unquantized row; speedup_vs_no_candidates over the same row without the agreement's
    candidates (agreement_k 0)."""
    rows = [r for r in rows if "error" not in r]

    def quant_of(r):
        return r.get("quant", "none")

    def k_of(r):
        return r.get("agreement_k", 0)

    def draw_of(r):
        return r.get("draw", "gumbel")

    dense = {
        (r["new_tokens"], r["batch"], quant_of(r), k_of(r), draw_of(r)): r["tokens_per_s"]
        for r in rows
        if r["policy"] == DENSE
    }
    full = {
        (r["policy"], r["new_tokens"], r["batch"], k_of(r), draw_of(r)): r["tokens_per_s"]
        for r in rows
        if quant_of(r) == "none"
    }
    bare = {
        (r["policy"], r["new_tokens"], r["batch"], quant_of(r), draw_of(r)): r["tokens_per_s"]
        for r in rows
        if not k_of(r)
    }
    gumbel = {
        (r["policy"], r["new_tokens"], r["batch"], quant_of(r), k_of(r)): r["tokens_per_s"]
        for r in rows
        if draw_of(r) == "gumbel"
    }
    for r in rows:
        base = dense.get((r["new_tokens"], r["batch"], quant_of(r), k_of(r), draw_of(r)))
        r["speedup_vs_dense"] = r["tokens_per_s"] / base if base else None
        base = full.get((r["policy"], r["new_tokens"], r["batch"], k_of(r), draw_of(r)))
        r["speedup_vs_full_precision"] = r["tokens_per_s"] / base if base else None
        base = bare.get((r["policy"], r["new_tokens"], r["batch"], quant_of(r), draw_of(r)))
        r["speedup_vs_no_candidates"] = r["tokens_per_s"] / base if base else None
        base = gumbel.get((r["policy"], r["new_tokens"], r["batch"], quant_of(r), k_of(r)))
        r["speedup_vs_gumbel"] = r["tokens_per_s"] / base if base else None


def acceptance(rows: list[dict], prof: Profile) -> dict:
    """The target speedup at prof.target_length, and per policy the flatness ratio of step time
    (longest / shortest length; 1.0 = flat in the generated length)."""
    lo, hi = min(prof.lengths), max(prof.lengths)
    rows = [r for r in rows if "error" not in r and r.get("quant", "none") == "none"]
    fewest = min((r.get("agreement_k", 0) for r in rows), default=0)  # the rows with the fewest candidates
    rows = [r for r in rows if r.get("agreement_k", 0) == fewest]
    by = {(r["policy"], r["new_tokens"]): r for r in rows}
    at_target = {
        r["policy"]: r["speedup_vs_dense"]
        for r in rows
        if r["new_tokens"] == prof.target_length and r["policy"] != DENSE and r["speedup_vs_dense"] is not None
    }
    flatness = {
        p: by[(p, hi)]["step_ms"] / by[(p, lo)]["step_ms"]
        for p in dict.fromkeys(r["policy"] for r in rows)
        if (p, lo) in by and (p, hi) in by and lo != hi
    }
    return dict(
        target_length=prof.target_length,
        target_speedup=prof.target_speedup,
        speedup_at_target=at_target,
        min_speedup_at_target=min(at_target.values()) if at_target else None,
        passed=bool(at_target) and prof.target_speedup is not None and min(at_target.values()) >= prof.target_speedup,
        flatness_lengths=[lo, hi],
        step_ms_ratio_longest_over_shortest=flatness,
    )


def reduced(prof: Profile) -> Profile:
    """The --dry-run size: fewer layers, a tiny batch, one short length; the same widths."""
    return dataclasses.replace(
        prof,
        model=dataclasses.replace(prof.model, n_layers=DRY_RUN["n_layers"]),
        batch=DRY_RUN["batch"],
        lengths=(DRY_RUN["new_tokens_in_buffers"] * prof.buffer,),
    )


def dry_run(
    prof: Profile, policies: list[str], seed: int, attn_impl: str, quant_labels: tuple[str, ...] = ("none",)
) -> dict:
    """eval_shape the full params (no allocation), give the full-size KV bytes of every row, and
    lower every (policy, length) of the reduced profile (no compile, no run)."""
    key_shape = jax.eval_shape(lambda: jax.random.key(seed))

    def param_shapes(model):
        return jax.eval_shape(lambda k: transformer.init_params(model, k), key_shape)

    def n_params(params):
        return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))

    full_rows = []
    for new_tokens in prof.lengths:
        for policy in policies:
            capacity = cache_capacity(kv_config(policy, prof), prof.prompt_len, new_tokens)
            full_rows.append(
                dict(
                    policy=policy,
                    new_tokens=new_tokens,
                    batch=prof.batch,
                    kv_capacity=capacity,
                    kv_bytes=kv_bytes(prof.model, prof.batch, capacity),
                )
            )
    small = reduced(prof)
    params = param_shapes(small.model)
    prompts = jax.ShapeDtypeStruct((small.batch, small.prompt_len), jnp.int32)
    lengths = jax.ShapeDtypeStruct((small.batch,), jnp.int32)
    lowered = []
    for new_tokens, label, policy in itertools.product(small.lengths, quant_labels, policies):
        fmt, mode = QUANT[label]
        qcfg = quant.QuantConfig(format=fmt, mode=mode)
        row_params = quant.abstract_quantized(params, qcfg) if qcfg.enabled else params
        cfg = SamplerConfig(
            max_new_tokens=new_tokens, kv=kv_config(policy, small), eos_token_ids=(), attn_impl=attn_impl
        )
        t0 = time.perf_counter()
        text = (
            jax.jit(generate, static_argnames=("model_cfg", "cfg"))
            .lower(row_params, small.model, prompts, lengths, key_shape, cfg)
            .as_text()
        )
        lowered.append(
            dict(
                policy=policy,
                quant=label,
                new_tokens=new_tokens,
                batch=small.batch,
                n_layers=small.model.n_layers,
                lower_s=time.perf_counter() - t0,
                hlo_chars=len(text),
                low_precision_dots=low_precision_dots(text),
            )
        )
    return dict(
        n_params_full=n_params(param_shapes(prof.model)),
        n_params_lowered=n_params(params),
        full_size_rows=full_rows,
        lowered=lowered,
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    name, prof = resolve(args)
    platform = kernels.current_platform()
    device = jax.devices()[0]
    report = {
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "profile": name,
        "platform": platform,
        "device_kind": device.device_kind,
        "jax_version": jax.__version__,
        "model": dataclasses.asdict(prof.model),
        "provenance": {
            **figprov.provenance(workers.available_cores(), None),
            # a benchmark runs with the host's own CPU numerics unless XLA_FLAGS carries the portable ones
            "portable_cpu": all(f in os.environ.get("XLA_FLAGS", "") for f in workers.PORTABLE_XLA_FLAGS),
        },
        "setting": dict(
            batch=prof.batch,
            prompt_len=prof.prompt_len,
            lengths=list(prof.lengths),
            budget=prof.budget,
            buffer=prof.buffer,
            window=prof.window,
            repeats=args.repeats,
            min_seconds=args.min_seconds,
            attn_impl=args.attn_impl,
            quant=list(args.quant),
            agreement_k=list(args.agreement_k),
            agreement_topk=args.agreement_topk,
            draws=list(args.draws),
            breakdown=args.breakdown,
        ),
    }
    if args.dry_run:
        report["dry_run"] = dry_run(prof, args.policies, args.seed, args.attn_impl, tuple(args.quant))
        print(json.dumps(report["dry_run"], indent=2))
        return report

    params = jax.block_until_ready(transformer.init_params(prof.model, jax.random.key(args.seed)))
    params_by_quant = {label: quantized(params, label) for label in args.quant}
    prompts_BxP, lengths_B = make_inputs(prof, jax.random.key(args.seed + 1))
    out = args.out or os.path.join("experiments", "results", f"bench_decode_{name}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    rows = report["results"] = []
    t_start = time.perf_counter()
    pieces: dict = {}  # the breakdown's piece timings, shared by the rows of the same shapes
    if args.bounds:
        report["host"] = decode_bounds.host(prof.model.dtype)
        print(
            f"host: {report['host']['peak_flops'] / 1e9:.0f} GFLOP/s ({prof.model.dtype} matmul), "
            f"{report['host']['read_bytes_per_s'] / 1e9:.1f} GB/s read",
            flush=True,
        )
    # every (weights, policy, candidates, draw) at one length before the next length
    grid = itertools.product(prof.lengths, args.quant, args.policies, args.agreement_k, args.draws)
    for new_tokens, label, policy, agreement_k, draw in grid:
        try:
            row = bench_row(
                params_by_quant[label],
                prof,
                policy,
                new_tokens,
                prompts_BxP,
                lengths_B,
                repeats=args.repeats,
                min_seconds=args.min_seconds,
                seed=args.seed,
                attn_impl=args.attn_impl,
                quant_label=label,
                agreement_k=agreement_k,
                agreement_topk=args.agreement_topk,
                draw=draw,
            )
            print(
                f"{policy:>9} {label:>5} {new_tokens:>6} top-{agreement_k:<3} {draw:>11}: {row['tokens_per_s']:9.1f} tok/s "
                f"{row['step_ms']:8.3f} ms/step  compile {row['compile_s']:.1f}s",
                flush=True,
            )
            if args.bounds:
                row["bounds"] = decode_bounds.row_bounds(
                    row["step_ms"],
                    prof.model,
                    prof.batch,
                    _mean_fill(row, prof),
                    row["weight_bytes"] if label != "none" else None,  # else the compute copy's
                    report["host"],
                )
            if args.breakdown:
                row["breakdown"] = row_breakdown(row, params_by_quant[label], prof, args, pieces)
                print("  " + ", ".join(f"{k} {v:.3f}" for k, v in row["breakdown"].items() if "_share" not in k))
        except Exception as err:  # e.g. a dense cache out of device memory: record, go on
            row = dict(
                policy=policy,
                quant=label,
                agreement_k=agreement_k,
                draw=draw,
                new_tokens=new_tokens,
                batch=prof.batch,
                error=f"{type(err).__name__}: {str(err)[:300]}",
            )
            print(f"{policy:>9} {new_tokens:>6}: {row['error']}", flush=True)
        rows.append(row)
        add_speedups(rows)
        report["acceptance"] = acceptance(rows, prof)
        report["total_s"] = time.perf_counter() - t_start
        report["provenance"].update(wall_s=round(report["total_s"], 1))
        report["provenance"].pop("commit_at", None)
        write(report, out)  # after every row, so a run cut short keeps what it measured
    print(markdown(report))
    print(f"\nwrote {out}")
    return report


def _mean_fill(row: dict, prof: Profile) -> int:
    """The cache slots the row's attention reads on average over its generation."""
    kv_cfg = kv_config(row["policy"], prof)
    return decode_breakdown.mean_fill(kv_cfg, prof.prompt_len, row["new_tokens"], row["kv_capacity"])


def row_breakdown(row: dict, params, prof: Profile, args: argparse.Namespace, cache: dict) -> dict:
    """The row's step in pieces (experiments/lib/decode_breakdown.py), each piece timed once per
    shapes (`cache`: the rows with and without candidates share their other pieces)."""
    kv_cfg = kv_config(row["policy"], prof)
    shapes = decode_breakdown.Shapes(
        model=prof.model,
        batch=prof.batch,
        capacity=row["kv_capacity"],
        mean_fill=_mean_fill(row, prof),
        kv=kv_cfg,
        agreement_k=row["agreement_k"],
        agreement_topk=args.agreement_topk,
        attn_impl=args.attn_impl,
        draw=row.get("draw", "gumbel"),
    )
    ms = {}
    for name in decode_breakdown.pieces_of(shapes):
        key = (row["quant"], decode_breakdown.piece_key(name, shapes))
        if key not in cache:
            cache[key] = decode_breakdown.piece_ms(
                name, shapes, params, repeats=args.repeats, min_seconds=args.min_seconds, seed=args.seed
            )
        ms[name] = cache[key]
    return decode_breakdown.breakdown(row["step_ms"], ms)


def write(report: dict, out: str) -> None:
    """The JSON at `out` and the markdown next to it (same name, .md)."""
    figprov.write_report(out, report, markdown(report), indent=2)


def breakdown_lines(rows: list[dict]) -> list[str]:
    """The table of the rows' steps in pieces (--breakdown), or nothing without one."""
    rows = [r for r in rows if "breakdown" in r]
    if not rows:
        return []
    names = (*decode_breakdown.PIECES, "rest")
    lines = [
        "",
        "## The step in pieces",
        "",
        "ms per decode step (share of the step); each piece timed alone at the row's shapes, the rest "
        "is the step less the pieces (experiments/lib/decode_breakdown.py); compression: one every "
        "kv.buffer steps, per step.",
        "",
        "| policy | new tokens | weights | candidates | draw | step ms | " + " | ".join(names) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(names),
    ]
    for r in rows:
        b, k = r["breakdown"], r.get("agreement_k", 0)
        cells = [f"{b[n]:.3f} ({100 * b[f'{n}_share']:.0f}%)" if n in b else "-" for n in names]
        lines.append(
            f"| {r['policy']} | {r['new_tokens']} | {r.get('quant', 'none')} | {f'top-{k}' if k else 'none'} | "
            f"{r.get('draw', 'gumbel')} | {r['step_ms']:.3f} | " + " | ".join(cells) + " |"
        )
    return lines


def bounds_lines(report: dict) -> list[str]:
    """The rows' steps against the host's bounds (--bounds), or nothing without them."""
    rows = [r for r in report["results"] if "bounds" in r]
    if not rows:
        return []
    hw = report["host"]
    lines = [
        "",
        "## The step against its bounds",
        "",
        f"This host, measured in the same run (experiments/lib/decode_bounds.py): "
        f"{hw['peak_flops'] / 1e9:.0f} GFLOP/s for a dense {hw['dtype']} matmul "
        f"({decode_bounds.PEAK_M} x {decode_bounds.PEAK_K} x {decode_bounds.PEAK_N}), "
        f"{hw['read_bytes_per_s'] / 1e9:.1f} GB/s read ({decode_bounds.READ_MIB} MiB sum). Compute bound: "
        "the step's FLOPs at that peak; bandwidth bound: the weights read once and the cache's mean "
        "fill at that bandwidth.",
        "",
        "| policy | new tokens | weights | candidates | draw | step ms | GFLOP / step | MB read / step | "
        "compute bound ms | bandwidth bound ms | step / compute bound | step / larger bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b, k = r["bounds"], r.get("agreement_k", 0)
        lines.append(
            f"| {r['policy']} | {r['new_tokens']} | {r.get('quant', 'none')} | {f'top-{k}' if k else 'none'} | "
            f"{r.get('draw', 'gumbel')} | {r['step_ms']:.2f} | {b['flops'] / 1e9:.2f} | {b['bytes'] / 1e6:.0f} | "
            f"{b['compute_ms']:.2f} | {b['bandwidth_ms']:.2f} | {b['step_over_compute']:.1f}x | "
            f"{b['step_over_bound']:.1f}x |"
        )
    return lines


def _fmt(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    m, s, acc = report["model"], report["setting"], report["acceptance"]
    lines = [
        f"# Decode benchmark ({report['profile']} profile)",
        "",
        f"{report['device_kind']} ({report['platform']}), jax {report['jax_version']}, {report['date']}",
        f"`{report['command']}`",
        *([figprov.provenance_line(report)] if "provenance" in report else []),
        "",
        f"Model: {m['family']} V={m['vocab_size']} D={m['d_model']} L={m['n_layers']} "
        f"N={m['n_heads']} K={m['n_kv_heads']} H={m['head_dim']} F={m['d_ff']} {m['dtype']}; "
        f"batch {s['batch']}, prompt {s['prompt_len']} tokens, sparse budget {s['budget']} + "
        f"buffer {s['buffer']} (window {s['window']}); no EOS (every row decodes all new tokens); "
        f"median of >= {s['repeats']} timed call(s) and >= {s['min_seconds']:g} s per row after "
        f"an AOT compile (calls per row in the JSON); ms/step = wall time / new "
        f"tokens (prefill and compressions included). Run time {report['total_s']:.0f} s.",
        "",
        "| policy | new tokens | batch | tokens/s | ms/step | compile s | calls | KV slots C | "
        "KV MiB | speedup vs dense | weights | weight MiB | speedup vs full precision | "
        "agreement candidates | speedup vs no candidates | draw | speedup vs gumbel |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        k = r.get("agreement_k", 0)
        candidates = f"top-{k} ({r.get('agreement_topk')})" if k else "none"
        if "error" in r:
            lines.append(
                f"| {r['policy']} | {r['new_tokens']} | {r['batch']} | "
                f"error: {r['error'][:100]} | | | | | | | {r.get('quant', 'none')} | | | {candidates} | | "
                f"{r.get('draw', 'gumbel')} | |"
            )
            continue
        lines.append(
            f"| {r['policy']} | {r['new_tokens']} | {r['batch']} | {r['tokens_per_s']:.1f} | "
            f"{r['step_ms']:.3f} | {r['compile_s']:.1f} | {len(r['wall_s_all'])} | "
            f"{r['kv_capacity']} | "
            f"{r['kv_bytes'] / 2**20:.1f} | {_fmt(r['speedup_vs_dense'], '.2f')} | "
            f"{r.get('quant', 'none')} | {_fmt(r.get('weight_bytes', 0) / 2**20, '.1f')} | "
            f"{_fmt(r.get('speedup_vs_full_precision'), '.2f')} | {candidates} | "
            f"{_fmt(r.get('speedup_vs_no_candidates'), '.3f')} | {r.get('draw', 'gumbel')} | "
            f"{_fmt(r.get('speedup_vs_gumbel'), '.3f')} |"
        )
    lines += breakdown_lines(report["results"])
    lines += bounds_lines(report)
    lo, hi = acc["flatness_lengths"]
    lines += [
        "",
        "## Acceptance",
        "",
        (
            "- Target: none for this profile; sparse / dense tokens/s at "
            + (", ".join(f"{p} {v:.2f}x" for p, v in acc["speedup_at_target"].items()) or "n/a")
        )
        if acc["target_speedup"] is None
        else f"- Target: every sparse policy >= {acc['target_speedup']:g}x dense tokens/s at "
        f"{acc['target_length']} new tokens: "
        + (
            ", ".join(f"{p} {v:.2f}x" for p, v in acc["speedup_at_target"].items())
            + f"; min {acc['min_speedup_at_target']:.2f}x -> "
            + ("PASS" if acc["passed"] else "FAIL")
            if acc["speedup_at_target"]
            else "not measured (no dense and sparse rows at that length)"
        ),
        f"- Per-step time flat in generated length (ms/step at {hi} / at {lo}; 1.0 = flat): "
        + (
            ", ".join(f"{p} {v:.2f}" for p, v in acc["step_ms_ratio_longest_over_shortest"].items())
            or "n/a (one length)"
        ),
    ]
    if report["platform"] not in kernels.PALLAS_PLATFORMS or s["attn_impl"] == "xla":
        lines += [
            "",
            "Attention ran on the XLA reference, which reads all C slots every step (masking the "
            "empty ones): the dense per-step time follows the capacity (prompt + max new tokens) "
            "from the first step, where the fill-aware Pallas kernel (GPU/TPU) follows the fill.",
        ]
    if report["platform"] != "gpu":
        lines += ["", "GPU rows pending: no GPU in this session."]
    return "\n".join(lines)
