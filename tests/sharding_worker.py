"""Sharded-vs-single-device checks, run as a script by tests/test_sharding.py with 8 fake CPU
devices (XLA_FLAGS=--xla_force_host_platform_device_count=8); `check_equivalence` is also used by
tests/multihost_worker.py. Prints SHARDING_WORKER_OK when every check passed."""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from float_tol import forward_terms, logit_magnitude, sum_tol
from jax.sharding import PartitionSpec as P

from sparserl_jax import distributed
from sparserl_jax.kvcache import cache as kvc
from sparserl_jax.model import sharding as shd
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig

RTOL, ATOL = 1e-5, 1e-6  # see assert_close


def assert_close(actual, ref, what: str, atol: float = ATOL):
    """Each addressable shard matches its slice of `ref`, and so does the gathered whole.

    Copies (params, tokens) are exact. Logits and caches come from another program: sharded
    dots sum their partial products in another order, float noise bounded by float_tol (the
    callers pass atol = sum_tol(forward_terms, logit_magnitude), 1e-4 to 1e-3 here), while a
    mis-sharded or unreduced dot is off by the size of the values themselves (~0.1 to 1)."""
    ref = np.asarray(ref)
    assert actual.shape == ref.shape, (what, actual.shape, ref.shape)
    for shard in actual.addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), ref[shard.index], rtol=RTOL, atol=atol, err_msg=what)
    np.testing.assert_allclose(distributed.to_host(actual), ref, rtol=RTOL, atol=atol, err_msg=what)


def assert_laid_out(x, expected_sharding, what: str):
    assert x.sharding.is_equivalent_to(expected_sharding, x.ndim), (what, x.sharding, expected_sharding)


def random_params(cfg: ModelConfig, key: jax.Array):
    """Params of init_params' shapes from one normal draw (one small compile instead of one per
    leaf); norms and biases random too, so a mis-sharded one cannot hide behind ones or zeros."""
    shapes = shd.abstract_params(cfg)
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    flat = np.asarray(jax.random.normal(key, (sum(x.size for x in leaves),), jnp.float32))
    offsets = np.cumsum([0] + [x.size for x in leaves])
    values = [
        jnp.asarray((0.02 if x.ndim > 1 else 0.5) * flat[a:b].reshape(x.shape) + (x.ndim == 1))
        for x, a, b in zip(leaves, offsets[:-1], offsets[1:])
    ]
    return jax.tree_util.tree_unflatten(treedef, values)


def check_equivalence(
    mesh,
    cfg: ModelConfig,
    to_global: Callable,
    *,
    batch=4,
    prompt_len=8,
    steps=3,
    seed=0,
    full_logits=True,
) -> None:
    """Sharded logits, prefill and `steps` decode steps equal the unsharded ones on one device.

    `to_global` turns a full [B, ...] host array (the same on every process) into a global array.
    """
    k_param, k_tok, k_len, k_dec = jax.random.split(jax.random.key(seed), 4)
    params = random_params(cfg, k_param)  # every process builds the same values
    tokens = jax.random.randint(k_tok, (batch, prompt_len), 1, cfg.vocab_size)
    lengths = jax.random.randint(k_len, (batch,), 2, prompt_len + 1)
    next_BxS = jax.random.randint(k_dec, (steps, batch), 1, cfg.vocab_size)
    capacity = prompt_len + steps + 1

    # Single-device reference (this process's first local device).
    ref_cache = kvc.init_cache(batch, cfg.n_layers, cfg.n_kv_heads, capacity, cfg.head_dim, n_heads=cfg.n_heads)
    ref_step, ref_cache = jax.jit(tf.prefill, static_argnums=1)(params, cfg, tokens, lengths, ref_cache)
    ref_steps = [ref_step]
    decode = jax.jit(tf.decode_step, static_argnums=1)
    for s in range(steps):
        ref_step, ref_cache = decode(params, cfg, ref_cache, next_BxS[s])
        ref_steps.append(ref_step)

    # Sharded: params placed from host values, and initialised directly into shards (equal).
    sharded = shd.shard_params(params, mesh)
    p_sh = shd.param_shardings(sharded, mesh)
    jax.tree_util.tree_map(lambda x, s: assert_laid_out(x, s, "params"), sharded, p_sh)
    jax.tree_util.tree_map(lambda x, r: assert_close(x, r, "shard_params"), sharded, params)

    g_tokens, g_lengths = to_global(tokens), to_global(lengths)
    assert_close(g_tokens, tokens, "global tokens")
    # float noise of a logit (or a cache entry, a shorter path of smaller values) between the
    # sharded and the one-device program
    noise = sum_tol(forward_terms(cfg, capacity), logit_magnitude(params))
    if full_logits:
        ref_logits = jax.jit(tf.logits, static_argnums=1)(params, cfg, tokens)
        logits = shd.sharded_logits(mesh, cfg)(sharded, g_tokens)
        assert_close(logits, ref_logits, "sharded logits", noise)

    cache = shd.init_sharded_cache(mesh, cfg, batch, capacity)
    c_sh = shd.cache_shardings(cache, mesh)
    prefill = shd.sharded_prefill(mesh, cfg, cache)
    step = shd.sharded_decode_step(mesh, cfg, cache)
    out, cache = prefill(sharded, g_tokens, g_lengths, cache)
    outs = [out]
    for s in range(steps):
        out, cache = step(sharded, cache, to_global(next_BxS[s]))
        outs.append(out)
    for s, (o, r) in enumerate(zip(outs, ref_steps)):
        assert_close(o, r, f"next-token logits after {s} decode steps", noise)
    jax.tree_util.tree_map(lambda x, s: assert_laid_out(x, s, "cache"), cache, c_sh)
    jax.tree_util.tree_map(lambda x, r: assert_close(x, r, "cache", noise), cache, ref_cache)


def main() -> None:
    assert jax.device_count() == 8, f"run with 8 fake devices, got {jax.device_count()}"
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("sparserl_jax.mesh_axes").addHandler(handler)
    logging.getLogger("sparserl_jax.mesh_axes").setLevel(logging.INFO)

    # Mesh: -1 takes the rest; a product that does not match names the setting.
    mesh = shd.make_mesh(shd.MeshConfig(data=-1, fsdp=2, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}, mesh.shape
    assert mesh.devices.size == 8 and len({d.id for d in mesh.devices.flat}) == 8
    try:
        shd.make_mesh(shd.MeshConfig(data=4, fsdp=2, tensor=2))
        raise AssertionError("16-device mesh on 8 devices did not raise")
    except ValueError as e:
        assert "mesh.data=4" in str(e) and "8" in str(e), e

    # Tiny model with every dim divisible by 2: params really are split.
    cfg = ModelConfig.tiny(n_heads=4, n_kv_heads=2)
    params = shd.shard_params(random_params(cfg, jax.random.key(1)), mesh)
    layer = params["layers"][0]
    D, N, K, H, F, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size
    expect = {
        "q": (P("fsdp", "tensor", None), (D // 2, N // 2, H)),
        "k": (P("fsdp", "tensor", None), (D // 2, K // 2, H)),
        "o": (P("tensor", None, "fsdp"), (N // 2, H, D // 2)),
        "gate": (P("fsdp", "tensor"), (D // 2, F // 2)),
        "down": (P("tensor", "fsdp"), (F // 2, D // 2)),
        "q_bias": (P("tensor", None), (N // 2, H)),
        "attn_norm": (P(), (D,)),
    }
    for name, (spec, shard_shape) in expect.items():
        assert layer[name].sharding.spec == spec, (name, layer[name].sharding.spec)
        assert layer[name].addressable_shards[0].data.shape == shard_shape, name
    assert params["embed"].sharding.spec == P("tensor", "fsdp")
    assert params["embed"].addressable_shards[0].data.shape == (V // 2, D // 2)

    # init_sharded_params draws straight into the shards (one layer: compiling init_params'
    # many random draws would dominate this script; the layers use the same rules as above).
    direct = shd.init_sharded_params(
        dataclasses.replace(cfg, n_layers=1, tie_embeddings=False), jax.random.key(1), mesh
    )
    assert direct["lm_head"].sharding.spec == P("fsdp", "tensor")
    assert direct["lm_head"].addressable_shards[0].data.shape == (D // 2, V // 2)
    assert np.all(np.asarray(direct["final_norm"]) == 1.0)
    head_std = float(np.std(np.asarray(direct["lm_head"])))
    assert 0.015 < head_std < 0.025, head_std  # init_params' std 0.02
    assert all(float(np.std(np.asarray(s.data))) > 0.015 for s in direct["embed"].addressable_shards)
    check_equivalence(mesh, cfg, lambda x: shd.shard_batch(x, mesh), steps=3)

    # Non-divisible dims fall back to replication (one KV head, odd vocabulary) and still match.
    odd = ModelConfig.tiny(n_heads=4, n_kv_heads=1, vocab_size=255, n_layers=1)
    specs = shd.param_specs(shd.abstract_params(dataclasses.replace(odd, n_layers=3)), dict(mesh.shape))
    assert specs["embed"] == P(None, "fsdp"), specs["embed"]
    assert specs["layers"][1]["k"] == P("fsdp", None, None), specs["layers"][1]["k"]
    assert specs["layers"][1]["q"] == P("fsdp", "tensor", None), specs["layers"][1]["q"]
    cache_spec = shd.cache_specs(jax.eval_shape(lambda: kvc.init_cache(4, 2, 1, 8, 16)), dict(mesh.shape))
    assert cache_spec.k[0] == P(("data", "fsdp"), None), cache_spec.k[0]
    kv_logs = [r.getMessage() for r in records if "'layers/*/k'" in r.getMessage()]
    assert len(kv_logs) == 1, kv_logs  # once for all 3 layers, at info level
    assert records[0].levelno == logging.INFO
    check_equivalence(mesh, odd, lambda x: shd.shard_batch(x, mesh), steps=1, seed=2, full_logits=False)

    # A batch that data x fsdp does not divide is refused with the sizes named.
    try:
        shd.shard_batch(jnp.ones((3, 5), jnp.int32), mesh)
        raise AssertionError("batch 3 on data x fsdp = 4 did not raise")
    except ValueError as e:
        assert "batch size 3" in str(e) and "4" in str(e), e
    print("SHARDING_WORKER_OK")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
