"""The device check's engine step: two rollout speed-ups beside the static sampler, on the
sampler step's model (bench_decode.py's profile, random weights in model.dtype).

- QuRL's int8 W8A8 weights (decode_bench.QUANT["int8"]: an int8 dot with int32 accumulation)
  against the model's own dtype, dense and R-KV, at one batch: tokens/s and their ratio.
- SortedRL's slot engine (rollout/engine.py) against the static sampler on one long-tailed
  workload of forced response lengths, the same for both arms (experiments/lib/engine_bench.py):
  tokens/s, speed-up, the static bubble and the engine's, and the compilations inside the timed
  runs (0 expected).
Every row is recorded as it finishes; a row that raises is recorded with its error and the next runs.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax

from experiments.device import gpu_report
from experiments.device.gpu_report import check
from experiments.device.gpu_sizes import Sizes

POLICIES = ("none", "rkv")  # the int8 rows' caches: dense and R-KV
QUANTS = ("none", "int8")  # model.dtype and W8A8
ENGINE_POLICY = "rkv"  # the slot engine rows' cache


def _error(err: Exception) -> str:
    return f"{type(err).__name__}: {gpu_report.one_line(str(err))}"


def step_engine(sizes: Sizes, ctx: dict, record):
    """int8 rows, then the slot engine rows; DIR/engine/engine.json rewritten after each row."""
    from experiments.lib import decode_bench as bench_decode
    from experiments.lib import engine_bench
    from sparserl_jax import kernels
    from sparserl_jax.model import transformer

    args = bench_decode.parse_args(list(sizes.sampler_argv))
    name, prof = bench_decode.resolve(args)
    prof = dataclasses.replace(prof, batch=sizes.engine_batch, lengths=(sizes.engine_new_tokens,))
    m, work = prof.model, dict(sizes.engine_workload)
    params = jax.block_until_ready(  # the compute copy (model.dtype), which rollouts read
        jax.tree.map(lambda x: x.astype(m.dtype), transformer.init_params(m, jax.random.key(args.seed)))
    )
    quant_rows, engine_rows, t0 = [], [], time.perf_counter()
    report = {
        "date": gpu_report.now(),
        "profile": name,
        "platform": kernels.current_platform(),
        "device_kind": jax.devices()[0].device_kind,
        "jax_version": jax.__version__,
        "model": dataclasses.asdict(m),
        "int8_setting": dict(
            batch=prof.batch,
            prompt_len=prof.prompt_len,
            new_tokens=sizes.engine_new_tokens,
            budget=prof.budget,
            buffer=prof.buffer,
            window=prof.window,
            attn_impl=args.attn_impl,
        ),
        "engine_setting": dict(work, policy=ENGINE_POLICY, budget=prof.budget, buffer=prof.buffer, window=prof.window),
        "int8_rows": quant_rows,
        "engine_rows": engine_rows,
    }
    out = os.path.join(ctx["out"], "engine", "engine.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)

    def save() -> None:
        report["total_s"] = time.perf_counter() - t0
        gpu_report.write_json(out, report)
        record({"int8_rows": quant_rows, "engine_rows": engine_rows})

    # QuRL: int8 W8A8 beside the model's dtype, dense and R-KV
    prompts_BxP, lengths_B = bench_decode.make_inputs(prof, jax.random.key(args.seed + 1))
    weights = {}
    for policy in POLICIES:
        for label in QUANTS:
            try:
                if label not in weights:
                    weights[label] = bench_decode.quantized(params, label)
                row = bench_decode.bench_row(
                    weights[label],
                    prof,
                    policy,
                    sizes.engine_new_tokens,
                    prompts_BxP,
                    lengths_B,
                    repeats=args.repeats,
                    min_seconds=args.min_seconds,
                    seed=args.seed,
                    attn_impl=args.attn_impl,
                    quant_label=label,
                )
            except Exception as err:  # recorded, the next row runs
                row = dict(policy=policy, quant=label, new_tokens=sizes.engine_new_tokens, batch=prof.batch)
                row["error"] = _error(err)
            quant_rows.append(row)
            bench_decode.add_speedups(quant_rows)
            save()
    weights.clear()

    # SortedRL: the slot engine against the static sampler on one workload
    limits_N = engine_bench.workload(
        work["requests"], max_new=work["max_new"], short=work["short"], long_frac=work["long_frac"]
    )
    prompts_NxP, plens_N = engine_bench.requests(
        work["requests"], prompt_len=prof.prompt_len, vocab=m.vocab_size, min_len=max(1, prof.prompt_len // 4)
    )
    t_row = time.perf_counter()
    try:
        row, lengths = engine_bench.compare(
            params,
            m,
            prompts_NxP,
            plens_N,
            limits_N,
            policy=ENGINE_POLICY,
            slots=work["slots"],
            max_new=work["max_new"],
            budget=prof.budget,
            buffer=prof.buffer,
            window=prof.window,
            segment_chunks=work["segment_chunks"],
            attn_impl=args.attn_impl,
        )
        row["forced_lengths_decoded"] = {arm: bool((n_N == limits_N).all()) for arm, n_N in lengths.items()}
    except Exception as err:
        row = dict(policy=ENGINE_POLICY, tokens=int(limits_N.sum()), error=_error(err))
    row["seconds_with_compile"] = time.perf_counter() - t_row
    engine_rows.append(row)
    save()
    return (*summary(quant_rows, engine_rows, prof, work, args.attn_impl), report)


def _ratios(rows: list[dict]) -> dict[str, float]:
    """int8 tokens/s over the model dtype's, per policy (rows that ran)."""
    by = {(r["policy"], r["quant"]): r["tokens_per_s"] for r in rows if "error" not in r}
    return {p: by[(p, "int8")] / by[(p, "none")] for p in POLICIES if (p, "int8") in by and (p, "none") in by}


def summary(quant_rows: list[dict], engine_rows: list[dict], prof, work: dict, attn_impl: str):
    """(checks, markdown lines, figure) of the step's rows."""
    m = prof.model
    ratios = _ratios(quant_rows)
    errors = [f"{r['policy']} {r['quant']}: {r['error']}" for r in quant_rows if "error" in r]
    errors += [f"engine {r['policy']}: {r['error']}" for r in engine_rows if "error" in r]
    ran = [r for r in engine_rows if "error" not in r]
    checks = [
        check("every row decodes", "all" if not errors else "; ".join(errors)[:300], "no error", not errors),
        check(
            f"int8 W8A8 tokens/s over {m.dtype} per policy (QuRL's claim)",
            ", ".join(f"{p}: {x:.2f}x" for p, x in ratios.items()) or "n/a",
            "> 1",
            bool(ratios) and min(ratios.values()) > 1.0,
            kind="goal",
        ),
    ]
    for r in ran:
        checks += [
            check(
                "both arms decode exactly the forced lengths",
                ", ".join(f"{arm}: {'yes' if ok else 'no'}" for arm, ok in r["forced_lengths_decoded"].items()),
                "yes",
                all(r["forced_lengths_decoded"].values()),
            ),
            check(
                "compilations inside the timed runs",
                f"static {r['static_compiles']}, engine {r['engine_compiles']}",
                "0",
                r["static_compiles"] == r["engine_compiles"] == 0,
            ),
            check(
                "slot engine tokens/s over the static sampler (SortedRL's claim)",
                f"{r['speedup']:.2f}x",
                ">= 1",
                r["speedup"] >= 1.0,
                kind="goal",
            ),
        ]
    lines = [
        f"Random {m.dtype} weights (L={m.n_layers}, D={m.d_model}, N/K={m.n_heads}/{m.n_kv_heads}, "
        f"V={m.vocab_size}), attention {attn_impl}; JSON: engine/engine.json.",
        "",
        f"QuRL's int8 W8A8 weights (an int8 dot with int32 accumulation) beside {m.dtype}: "
        f"experiments/bench/bench_decode.py's rows at batch {prof.batch}, prompt {prof.prompt_len} "
        f"tokens, {prof.lengths[0]} new tokens (no EOS), R-KV {prof.budget} + {prof.buffer}; one timed "
        "call after an AOT compile.",
        "",
        f"| policy | weights | tokens/s | ms / step | compile s | weight MiB | int8 / {m.dtype} |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in quant_rows:
        if "error" in r:
            lines.append(f"| {r['policy']} | {r['quant']} | error: {gpu_report.one_line(r['error'], 120)} | | | | |")
            continue
        x = r.get("speedup_vs_full_precision") if r["quant"] != "none" else None
        lines.append(
            f"| {r['policy']} | {r['quant']} | {r['tokens_per_s']:.0f} | {r['step_ms']:.2f} | "
            f"{r['compile_s']:.1f} | {r['weight_bytes'] / 2**20:.0f} | {'-' if x is None else f'{x:.2f}'} |"
        )
    lo, hi = work["short"]
    lines += [
        "",
        f"SortedRL's slot engine against the static sampler (experiments/lib/engine_bench.py): "
        f"{work['requests']} requests, Q = {work['slots']} slots (static: batches of {work['slots']}), "
        f"forced lengths {work['long_frac']:.0%} at the cap {work['max_new']}, the rest uniform in "
        f"[{lo}, {hi}]; R-KV {prof.budget} + {prof.buffer}, engine segments of "
        f"{work['segment_chunks']} x {prof.buffer} steps; wall time after a run that compiles, any "
        "compile time left subtracted. Bubbles: static 1 - tokens / (Q x steps); engine over the "
        "whole run (until the queue ran empty), slot-steps and wall (Eq. 4).",
        "",
        "| cache | tokens | static tok/s | engine tok/s | speedup | static bubble | engine bubble (slot-steps) "
        "| engine bubble (wall) | compiles timed | s with compile |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in engine_rows:
        if "error" in r:
            err = gpu_report.one_line(r["error"], 120)
            lines.append(
                f"| {r['policy']} | {r['tokens']} | error: {err} | | | | | | | {r['seconds_with_compile']:.0f} |"
            )
            continue
        lines.append(
            f"| {r['policy']} | {r['tokens']} | {r['static_tokens_per_s']:.0f} | {r['engine_tokens_per_s']:.0f} | "
            f"{r['speedup']:.2f}x | {r['static_bubble']:.1%} | {r['engine_bubble_slots']:.1%} "
            f"({r['engine_bubble_slots_until_drain']:.1%}) | {r['engine_bubble_wall']:.1%} "
            f"({r['engine_bubble_wall_until_drain']:.1%}) | {r['static_compiles']} / {r['engine_compiles']} | "
            f"{r['seconds_with_compile']:.0f} |"
        )
    parts = [
        f"int8/{m.dtype}: " + ", ".join(f"{p} {x:.2f}x" for p, x in ratios.items()) if ratios else "no int8 pair ran"
    ]
    parts += [
        f"engine {r['engine_tokens_per_s']:.0f} vs static {r['static_tokens_per_s']:.0f} tok/s "
        f"({r['speedup']:.2f}x; bubble {r['static_bubble']:.0%} -> {r['engine_bubble_slots']:.0%})"
        for r in ran
    ] or ["no engine row ran"]
    return checks, lines, "; ".join(parts)
