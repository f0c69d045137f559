"""model.scan_layers on a mesh, read from the compiled programs: run as a script by
tests/test_scan_layers.py with 8 fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8).

On the mesh (data, fsdp, tensor) = (1, 4, 2) it compiles, for a toy model (3 layers, D = 64,
F = 128, B = 16 rows of T = 48 tokens), the gradient of the summed token log-probs (remat full
inside the scan body) and the scoring pass's log-probs, each unrolled and scanned, and checks in the scanned programs'
HLO text (experiments/lib/hlo_layout.py, hlo_loops.py) that each device holds B / (data x fsdp)
rows of every token activation (the residual stream pinned inside the scan body), that the stack
of the layers' weights (the concatenate) keeps each layer leaf's split with the new leading axis
whole (q's as [L, D / fsdp, N / tensor, H] per device, never [L, D, N / tensor, H]), and that each fsdp-sharded layer weight is
all-gathered inside a while loop (one layer where it runs) and never outside one (no whole stack
gathered at once); and that the scanned loss, gradient and log-probs equal the
unrolled programs' on the same mesh. Prints one JSON line per program and SCAN_LAYERS_OK when
every check passed, else a FAILED line for each."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys

import jax
import numpy as np
from float_tol import EPS32, forward_terms, logprob_tol
from sharding_worker import random_params

from experiments.lib import hlo_layout, hlo_loops
from sparserl_jax import distributed
from sparserl_jax.model import sharding as shd
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig

MESH = (1, 4, 2)
B, T = 16, 48  # T divides no weight dim, so no weight reads as rows (hlo_layout)
# D 64, F 128, N 4, K 2, H 16, q/k/v biases; V 320 so that no gathered activation ([B / 4, V] logits)
# has a layer weight's size (1024, 2048 or 4096 elements gathered), which tells the gathers apart
MC = ModelConfig.tiny(n_layers=3, attention="xla", vocab_size=320)
SCANNED = dataclasses.replace(MC, scan_layers=True)


# a concatenate's result (the stack of the layers' weights, fused or not): its element type and dims
_STACK = re.compile(r"=\s*([a-z]+\d*)\[([\d,]*)\]\S*\s+concatenate\(")


def layer_weight_sizes(mesh) -> dict[str, tuple[int, int]]:
    """Each fsdp-sharded layer weight -> (per-device elements once gathered over fsdp, its tensor
    split kept; per-device elements as stored)."""
    sizes = dict(mesh.shape)
    shapes = shd.abstract_params(MC)["layers"][0]
    specs = shd.param_specs(shd.abstract_params(MC), sizes)["layers"][0]
    out = {}
    for name, spec in specs.items():
        axes = [n for e in spec if e is not None for n in (e if isinstance(e, tuple) else (e,))]
        if "fsdp" in axes:
            whole = math.prod(shapes[name].shape)
            out[name] = (
                whole // math.prod(sizes[a] for a in axes if a != "fsdp"),
                whole // math.prod(sizes[a] for a in axes),
            )
    return out


def read(program: str, hlo: str, mesh, failures: list[str]) -> dict:
    """The scanned program's rows, stacked q shapes and where it gathers the layer weights."""
    d, f, t = (mesh.shape[a] for a in ("data", "fsdp", "tensor"))
    L, D, N, H = MC.n_layers, MC.d_model, MC.n_heads, MC.head_dim
    rows = hlo_layout.activation_rows_per_device(hlo, T, (MC.d_model, MC.d_ff))
    stacks = {dims for _, dims in _STACK.findall(hlo)}
    stacks = {tuple(int(x) for x in dims.split(",") if x) for dims in stacks}
    gathers = hlo_loops.collectives(hlo)
    weights = layer_weight_sizes(mesh)
    in_loop = {
        n: sum(c.op == "all-gather" and c.elements == g and c.loop is not None for c in gathers)
        for n, (g, _) in weights.items()
    }
    outside = {
        n: sum(c.op == "all-gather" and c.elements == g and c.loop is None for c in gathers)
        for n, (g, _) in weights.items()
    }
    stacked_whole = sum(c.op == "all-gather" and c.elements in {L * g for g, _ in weights.values()} for c in gathers)
    record = {
        "program": program,
        "mesh": [d, f, t],
        "activation_rows_per_device": rows,
        "stacked_q_shard": (L, D // f, N // t, H) in stacks,
        "stacked_q_gathered": (L, D, N // t, H) in stacks,
        "layer_weight_gathers_in_loops": in_loop,
        "layer_weight_gathers_outside_loops": outside,
    }
    where = f"{program} (scanned) on mesh (data, fsdp, tensor) = {(d, f, t)}"
    if rows != B // (d * f):
        failures.append(
            f"{where}: a token activation holds {rows} rows per device, expected B/(data x fsdp) = {B // (d * f)}"
        )
    if not record["stacked_q_shard"] or record["stacked_q_gathered"]:
        failures.append(f"{where}: the q stack is not [L, D/fsdp, N/tensor, H] = {(L, D // f, N // t, H)} per device")
    for n in weights:
        if in_loop[n] < 1 or outside[n]:
            failures.append(
                f"{where}: layer weight {n} gathered {in_loop[n]} times in loops, {outside[n]} outside (want >= 1, 0)"
            )
    if stacked_whole:
        failures.append(f"{where}: {stacked_whole} all-gathers of a whole stack of {L} layers")
    return record


def close(what: str, got, want, tol: float, failures: list[str]) -> None:
    got, want = np.asarray(distributed.to_host(got)), np.asarray(distributed.to_host(want))
    if got.shape != want.shape or not np.allclose(got, want, rtol=0, atol=tol):
        failures.append(f"{what}: scanned differs from unrolled by {np.abs(got - want).max():.3g} (tol {tol:.3g})")


def main() -> None:
    assert jax.device_count() == 8, f"run with 8 fake devices, got {jax.device_count()}"
    mesh = shd.make_mesh(shd.MeshConfig(*MESH))
    params = random_params(MC, jax.random.key(0))
    sharded = shd.shard_params(params, mesh)
    rng = np.random.default_rng(0)
    tokens = shd.shard_batch(rng.integers(1, MC.vocab_size, (B, T)).astype(np.int32), mesh)
    failures: list[str] = []
    lp_tol = logprob_tol(MC, params, T)

    def grad_fn(cfg):
        loss = lambda p, t: tf.token_logprobs(p, cfg, t, chunk_tokens=32, remat="full", mesh=mesh)[0].sum()  # noqa: E731
        return jax.jit(jax.value_and_grad(loss)).lower(sharded, tokens).compile()

    want_fn, got_fn = grad_fn(MC), grad_fn(SCANNED)
    print("SCAN_LAYERS", json.dumps(read("token_logprobs gradient", got_fn.as_text(), mesh, failures)))
    (want_loss, want_g), (got_loss, got_g) = want_fn(sharded, tokens), got_fn(sharded, tokens)
    close("summed log-probs", got_loss, want_loss, B * T * lp_tol, failures)
    n = B * T + forward_terms(MC, T)  # a gradient entry: B T token terms of forward_terms sums each
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_g), jax.tree.leaves(want_g), strict=True):
        close(
            f"gradient {jax.tree_util.keystr(path)}",
            g,
            w,
            n * EPS32 * float(np.abs(distributed.to_host(w)).max()),
            failures,
        )

    def score_fn(cfg):  # the pi_old scoring pass: log-probs only
        score = lambda p, t: tf.token_logprobs(p, cfg, t, chunk_tokens=32, mesh=mesh)[0]  # noqa: E731
        return jax.jit(score).lower(sharded, tokens).compile()

    want_fn, got_fn = score_fn(MC), score_fn(SCANNED)
    print("SCAN_LAYERS", json.dumps(read("token_logprobs", got_fn.as_text(), mesh, failures)))
    close("scored log-probs", got_fn(sharded, tokens), want_fn(sharded, tokens), lp_tol, failures)
    for f in failures:
        print("FAILED", f)
    if not failures:
        print("SCAN_LAYERS_OK")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
