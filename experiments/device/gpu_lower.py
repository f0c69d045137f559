"""The device check's full-size programs lowered for cuda on a machine without a GPU: jax.export
from ShapeDtypeStructs (nothing compiled for the device, nothing big allocated), so that a shape,
a setting or a lowering rule the check would trip on shows here, not in the lease.

  python experiments/device/gpu_check.py --lower [--quick] [--out DIR]

Lowered: the Pallas kernel (Triton) at every numerics shape, plain and under shard_map on a
one-device mesh; one sampler call at every batch and KV policy of the sampler step (4096 new
tokens, attn_impl=pallas for gpu); the update step at its config. Not lowered: the end-to-end
step (the trainer builds its own programs; tests/test_lowering.py lowers a sampler call and the
update step at both real models' shapes) and the copy probe. What only a device shows: that Triton
compiles the kernel, numerics, speed and memory. The Triton custom call has no export
compatibility guarantee, so that check is disabled (lowering only).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from jax import export

from experiments.device import gpu_kernel_check as gk
from experiments.device import gpu_report, gpu_sizes, gpu_update

TRITON = "__gpu$xla.gpu.triton"
DISABLED = [export.DisabledSafetyCheck.custom_call(TRITON)]


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def lower(fn, *args) -> str:
    return export.export(fn, platforms=["cuda"], disabled_checks=DISABLED)(*args).mlir_module()


def programs(sizes: gpu_sizes.Sizes):
    """(step, program, shape, build) of every program the check lowers; build() -> (jitted fn,
    abstract args)."""
    from experiments.lib import decode_bench as bench_decode
    from sparserl_jax.config import load_config
    from sparserl_jax.dryrun import model_config
    from sparserl_jax.model import sharding
    from sparserl_jax.model.precision import for_platform
    from sparserl_jax.rl.optim import make_optimizer
    from sparserl_jax.rl.update import make_update_fn
    from sparserl_jax.rollout import sampler as smp

    mesh = gk.one_device_mesh()
    for label, (N, K, H, C, dtype) in gpu_sizes.kernel_shapes(sizes).items():
        for B in sizes.kernel_batches:
            args = (sds((B, N, H), dtype), sds((B, K, C, H), dtype), sds((B, K, C, H), dtype), sds((B,), "int32"))
            for tag, m in (("kernel", None), ("kernel under shard_map", mesh)):
                yield (
                    "numerics",
                    tag,
                    f"{label} B={B}",
                    lambda m=m, B=B, K=K, args=args: (
                        gk.kernel_fn("pallas", sizes.block_c, m, B, K, platform="gpu", put=False),
                        args,
                    ),
                )

    def sampler(B, policy):
        args = bench_decode.parse_args(list(sizes.sampler_argv))
        _, prof = bench_decode.resolve(args)
        cfg = smp.SamplerConfig(
            max_new_tokens=prof.lengths[0],
            kv=bench_decode.kv_config(policy, prof),
            eos_token_ids=(),
            attn_impl="pallas",
            attn_platform="gpu",
        )
        model = for_platform(prof.model, "gpu")
        fn = jax.jit(lambda p, t, n, k: smp.generate(p, model, t, n, k, cfg))
        return fn, (
            sharding.abstract_params(model),
            sds((B, prof.prompt_len), "int32"),
            sds((B,), "int32"),
            jax.eval_shape(jax.random.key, 0),
        )

    policies = bench_decode.parse_args(list(sizes.sampler_argv)).policies
    for B in sizes.sampler_batches:
        for policy in policies:
            yield "sampler", f"generate ({policy})", f"B={B}", lambda B=B, policy=policy: sampler(B, policy)

    def update():
        cfg = load_config(list(sizes.update_configs), list(sizes.update_overrides))
        m, _ = model_config(cfg, sizes.update_arch)
        m = for_platform(m, "gpu")
        rows, P = cfg.rollout.prompts * cfg.rollout.samples, cfg.data.max_prompt_len
        params = sharding.abstract_params(m)
        optimizer = make_optimizer(cfg.rl.optim)
        batch = jax.eval_shape(
            lambda key: gpu_update.update_batch(rows, P + cfg.rollout.max_new_tokens, P, m.vocab_size, key),
            jax.eval_shape(jax.random.key, 1),
        )
        return (
            make_update_fn(m, cfg.rl, optimizer, donate=cfg.rl.update.donate),
            (params, jax.eval_shape(optimizer.init, params), batch),
        )

    yield "update", "update step", "the update step's config", update


def lower_all(sizes: gpu_sizes.Sizes, steps=None, log=print) -> list[dict]:
    """Lower every program (of `steps`, default all); a failure (building or lowering) is
    recorded with one line and the next is lowered."""
    rows = []
    for step, program, shape, build in programs(sizes):
        if steps is not None and step not in steps:
            continue
        t0 = time.perf_counter()
        try:
            text = _lower_built(build)
            row = {
                "step": step,
                "program": program,
                "shape": shape,
                "ok": True,
                "triton_calls": text.count(TRITON),
                "chars": len(text),
            }
        except Exception as err:
            row = {
                "step": step,
                "program": program,
                "shape": shape,
                "ok": False,
                "error": f"{type(err).__name__}: {gpu_report.one_line(str(err))}",
            }
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        log(
            f"{step:>9} {program:>24} {shape:>28}: "
            + (
                f"lowered in {row['seconds']:.1f} s, {row['triton_calls']} Triton call(s)"
                if row["ok"]
                else row["error"]
            ),
            flush=True,
        )
    return rows


def _lower_built(build) -> str:
    fn, args = build()
    return lower(fn, *args)


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        "# The device check's programs lowered for cuda (no GPU)",
        "",
        f"Command: `{command}`; jax {jax.__version__}, {gpu_report.now()}.",
        "",
        "| step | program | shape | lowered | Triton calls | s |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['step']} | {r['program']} | {r['shape']} | {'yes' if r['ok'] else r['error']} | "
        f"{r.get('triton_calls', '-')} | {r['seconds']:.1f} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"
