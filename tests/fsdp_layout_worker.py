"""FSDP as data parallelism, read from the compiled programs: run as a script by
tests/test_fsdp_layout.py with 8 fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8).

For each mesh (data, fsdp, tensor) of MESHES it compiles, for a toy model (2 layers, D = 64,
F = 128, B = 16 rows of T = 48 tokens), the trainer's own programs: the micro-batch gradient
program (rl/bucketed.py BucketedUpdate._micro: the fused path, pi_ref teacher-forced inside,
kept sets and top candidates), the scoring program (BucketedUpdate._score) and prefill
(model/sharding.py sharded_prefill). In each one's HLO text (experiments/lib/hlo_layout.py) no token
activation may hold more than B / (data x fsdp) rows, no [T, T] attention scores more than
B / (data x fsdp) x N / tensor (row, head) pairs, and every fsdp-sharded layer weight must be
all-gathered (ZeRO-3: at least once per layer). The micro-batch program's gradient, numerator
and log-probs must equal one device's. Prints one JSON line per program (rows per device,
collectives), every failure, and FSDP_LAYOUT_OK when none. `--mesh d,f,t` runs one mesh.
`--head-window R`: rl.update.head_window=response with R-position windows (each row's response
one contiguous span of at most R positions): the same checks, the numbers against one device's
with the same window."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

import jax
import numpy as np
from float_tol import EPS32, forward_terms, logprob_tol
from sharding_worker import random_params

from experiments.lib import hlo_layout
from sparserl_jax import distributed, rl
from sparserl_jax.model import sharding as shd
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rl.bucketed import BucketedUpdate
from sparserl_jax.rl.optim import make_optimizer

MESHES = ((1, 8, 1), (2, 4, 1), (1, 4, 2))
B, T, KEPT_K, TOP_K = 16, 48, 5, 3  # T divides no weight dim, so no weight reads as rows (hlo_layout)
CHUNK = 32  # update.chunk_tokens: each device's 2 x 48 tokens in 3 chunks, the last one padded
MC = ModelConfig.tiny()  # D 64, F 128, N 4, K 2, H 16, V 256, 2 layers, q/k/v biases
RL = rl.RLConfig(
    loss=rl.LossConfig(beta=0.01),  # pi_ref teacher-forced inside the micro-batch program
    update=rl.UpdateConfig(minibatch_size=B, micro_batch_size=B, chunk_tokens=CHUNK, score_batch_size=B),
)


def rl_config(window: int | None) -> rl.RLConfig:
    if window is None:
        return RL
    return rl.RLConfig(loss=RL.loss, update=dataclasses.replace(RL.update, head_window="response"))


def host_batch(seed: int, window: int | None = None) -> dict:
    """One micro-batch of random rows (every row's mask partly on), with kept sets and top ids;
    with a head `window`, each row's response one span of 1..window positions from a random start."""
    rng = np.random.default_rng(seed)
    mask = rng.random((B, T)) < 0.7
    if window is not None:
        starts, spans = rng.integers(1, T - window, B), rng.integers(1, window + 1, B)
        mask = (np.arange(T)[None] >= starts[:, None]) & (np.arange(T)[None] < (starts + spans)[:, None])
    kept = rng.integers(0, MC.vocab_size, (B, T, KEPT_K)).astype(np.int32)
    kept[:, ::3] = -1  # positions sampled without a kept set: the whole vocabulary
    return {
        "tokens": rng.integers(1, MC.vocab_size, (B, T)).astype(np.int32),
        "response_mask": mask,
        "sampler_logp": -rng.uniform(0.1, 3.0, (B, T)).astype(np.float32),
        "kept_ids": kept,
        "top_ids": rng.integers(0, MC.vocab_size, (B, T, TOP_K)).astype(np.int32),
        "advantages": rng.normal(size=B).astype(np.float32),
    }


def gathered_weight_sizes(mesh) -> dict[int, int]:
    """Per-device elements of each fsdp-sharded weight of one layer once gathered over fsdp (its
    tensor split kept) -> how many weights of a layer have that size."""
    sizes = dict(mesh.shape)
    specs = shd.param_specs(shd.abstract_params(MC), sizes)["layers"][0]
    shapes = shd.abstract_params(MC)["layers"][0]
    out: dict[int, int] = {}
    for name, spec in specs.items():
        names = [n for e in spec if e is not None for n in (e if isinstance(e, tuple) else (e,))]
        if "fsdp" not in names:
            continue
        tensor_split = math.prod(sizes[n] for n in names if n != "fsdp")
        n = math.prod(shapes[name].shape) // tensor_split
        out[n] = out.get(n, 0) + 1
    return out


def read(program: str, hlo: str, mesh, failures: list[str]) -> dict:
    """The program's per-device rows and collectives; a failure for every broken property."""
    d, f, t = (mesh.shape[a] for a in ("data", "fsdp", "tensor"))
    rows_max = B // (d * f)
    rows = hlo_layout.activation_rows_per_device(hlo, T, (MC.d_model, MC.d_ff))
    pairs = hlo_layout.attention_rows_per_device(hlo, T)
    gathered = [math.prod(g) for g in hlo_layout.gathered_arrays(hlo)]
    weights = gathered_weight_sizes(mesh)
    gathers = {n: gathered.count(n) for n in weights}
    record = {
        "program": program,
        "mesh": [d, f, t],
        "activation_rows_per_device": rows,
        "widest": [list(a.dims) for a in hlo_layout.activations(hlo, T, (MC.d_model, MC.d_ff))[:3]],
        "attention_row_heads_per_device": pairs,
        "collectives": hlo_layout.collective_counts(hlo),
        "layer_weight_gathers": gathers,
    }
    where = f"{program} on mesh (data, fsdp, tensor) = {(d, f, t)}"
    if not 0 < rows <= rows_max:
        failures.append(
            f"{where}: a token activation holds {rows} rows per device, expected <= B/(data x fsdp) = {rows_max}"
        )
    if pairs > rows_max * MC.n_heads // t:
        failures.append(
            f"{where}: [T, T] scores of {pairs} (row, head) pairs per device > {rows_max * MC.n_heads // t}"
        )
    for n, per_layer in weights.items():
        if gathers[n] < per_layer * MC.n_layers:
            failures.append(
                f"{where}: {gathers[n]} all-gathers of {n}-element layer weights, expected >= {per_layer * MC.n_layers} "
                "(each of the layers' weights gathered where it runs)"
            )
    return record


def micro_program(up: BucketedUpdate, params, host: dict):
    """(the compiled micro-batch program, its inputs) as the update runs them."""
    mb, norm = up._micro_inputs(host, np.arange(B), T, None, fused=True)
    args = (params, params, up._zeros(params), mb, norm)
    return up._micro.lower(*args, fused=True).compile(), args


def update_for(window: int | None, mesh=None) -> BucketedUpdate:
    cfg = rl_config(window)
    return BucketedUpdate(
        MC, cfg, make_optimizer(cfg.optim), max_len=T, mesh=mesh, kept_k=KEPT_K, top_k=TOP_K, response_len=window
    )


def check_mesh(mesh_shape, params, host, want, failures: list[str], window: int | None = None) -> list[dict]:
    mesh = shd.make_mesh(shd.MeshConfig(*mesh_shape))
    sharded = shd.shard_params(params, mesh)
    up = update_for(window, mesh)
    micro, args = micro_program(up, sharded, host)
    records = [read("update micro-batch", micro.as_text(), mesh, failures)]
    mb = args[3]
    mask = mb["response_mask"] if window else None
    score = up._score.lower(sharded, mb["tokens"], mb["kept_ids"], mb["top_ids"], mask).compile()
    records.append(read("scoring", score.as_text(), mesh, failures))
    cache = jax.eval_shape(shd._cache_factory(MC, B, T + 8))
    tokens, lengths = shd.shard_batch(host["tokens"], mesh), shd.shard_batch(np.full(B, T, np.int32), mesh)
    prefill = shd.sharded_prefill(mesh, MC, cache).lower(sharded, tokens, lengths, cache).compile()
    records.append(read("prefill", prefill.as_text(), mesh, failures))

    # the same numbers as one device: the gradient, the loss numerator and the log-probs
    acc, num, _, logp, top = distributed.to_host(micro(*args))
    w_acc, w_num, _, w_logp, w_top = want
    # log-probs: two float32 programs of the same model (float_tol.logprob_tol over T keys)
    lp_tol = logprob_tol(MC, params, T)
    for what, got, ref in (("log-probs", logp, w_logp), ("top candidates' log-probs", top, w_top)):
        if not np.allclose(got, ref, rtol=0, atol=lp_tol):
            failures.append(f"mesh {mesh_shape}: {what} differ from one device's by {np.abs(got - ref).max():.3g}")
    # the gradient: each entry sums B x T token terms, each a path of forward_terms float32 sums,
    # in another order (partial sums per device, then the reduction): n EPS32 relative to the
    # largest entry, n = B T + forward_terms. A lost or unreduced shard moves entries by ~1/8.
    n = B * T + forward_terms(MC, T)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(acc), jax.tree.leaves(w_acc), strict=True):
        tol = n * EPS32 * np.abs(r).max()
        if not np.allclose(g, r, rtol=0, atol=tol):
            failures.append(
                f"mesh {mesh_shape}: gradient {jax.tree_util.keystr(path)} off by {np.abs(g - r).max():.3g}"
            )
    if not np.isclose(num, w_num, rtol=n * EPS32):
        failures.append(f"mesh {mesh_shape}: loss numerator {num} != one device's {w_num}")
    return records


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", help="one mesh, data,fsdp,tensor (default: every one of MESHES)")
    parser.add_argument("--head-window", type=int, help="rl.update.head_window=response with this window")
    cli = parser.parse_args()
    meshes = [tuple(int(x) for x in a.split(",")) for a in [cli.mesh] if a] or list(MESHES)
    assert jax.device_count() == 8, f"run with 8 fake devices, got {jax.device_count()}"
    params = jax.tree.map(np.asarray, random_params(MC, jax.random.key(0)))
    window = cli.head_window
    host = host_batch(0, window)
    one = update_for(window)
    device = jax.devices()[0]
    micro, args = micro_program(one, jax.device_put(params, device), host)
    want = distributed.to_host(micro(*args))
    failures: list[str] = []
    for mesh_shape in meshes:
        for record in check_mesh(mesh_shape, params, host, want, failures, window):
            print("FSDP_LAYOUT", json.dumps(record))
    for f in failures:
        print("FAILED", f)
    if not failures:
        print("FSDP_LAYOUT_OK")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
