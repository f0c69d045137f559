"""Run in a subprocess with 8 fake CPU devices (tests/test_sharding.py): decode attention under
shard_map on data, fsdp and tensor layouts equals one device (XLA reference and interpreted
kernel) and its compiled HLO gathers no KV cache; a sharded decode step with the interpreted
kernel likewise; the sparse sampler with params sharded by the partition rules and the batch over
data x fsdp equals the single-device rollout; and a sampler whose batch is split 8 ways holds
about 1/8 of the single-device KV cache per device; the sampler lowers for TPU and GPU on the
mesh with per-device cache shards in the kernel call. Prints SAMPLER SHARDED OK."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from sparserl_jax import kernels
from sparserl_jax import kvcache as kv
from sparserl_jax.kvcache import cache as kvc
from sparserl_jax.model import sharding as shd
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rollout import sampler as smp

COLLECTIVE = re.compile(r"= .*\b(all-gather|all-to-all)(-start)?\(")
SHAPE = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")


def cache_collectives(hlo: str, C: int, H: int) -> list[str]:
    """All-gather / all-to-all lines of compiled HLO with an operand or result shaped like (a
    shard of) the K/V cache [..., C, H] or of per-slot data [..., C] (positions, mass, eviction
    scores); pick C and H distinct from every other dim."""
    hits = []
    for line in hlo.splitlines():
        if COLLECTIVE.search(line):
            shapes = [tuple(int(d) for d in s.split(",") if d) for s in SHAPE.findall(line)]
            if any(len(s) >= 2 and (s[-1] == C or s[-2:] == (C, H)) for s in shapes):
                hits.append(line.strip()[:200])
    return hits


def check_attention_layouts() -> None:
    B, N, K, C, H = 8, 8, 4, 24, 16
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, N, H))
    k, v = (jax.random.normal(x, (B, K, C, H)) for x in keys[1:3])
    fill = jax.random.randint(keys[3], (B,), 1, C + 1)
    cache = jax.eval_shape(lambda: kvc.init_cache(B, 1, K, C, H))
    layouts = {  # name: (data, fsdp, tensor) and the cache spec it implies
        "data": (8, 1, 1),
        "fsdp": (1, 8, 1),
        "tensor": (2, 1, 4),  # 2 x 2 x 2: check_decode_step
        "tensor not dividing K (replicated heads)": (1, 1, 8),
    }
    for impl in ("xla", "interpret"):
        ref = jax.jit(lambda *a: kernels.decode_attention(*a, impl=impl))(q, k, v, fill)  # noqa: B023 (called within the iteration)
        for name, sizes in layouts.items():
            mesh = shd.make_mesh(shd.MeshConfig(*sizes))
            kv_sh = shd.cache_shardings(cache, mesh).k[0]
            ks, vs = jax.device_put(k, kv_sh), jax.device_put(v, kv_sh)
            fn = jax.jit(lambda *a, m=mesh: kernels.decode_attention(*a, impl=impl, mesh=m))  # noqa: B023 (called within the iteration)
            compiled = fn.lower(q, ks, vs, fill).compile()
            assert not cache_collectives(compiled.as_text(), C, H), (impl, name)
            o, lse = compiled(q, ks, vs, fill)
            np.testing.assert_allclose(np.asarray(o), np.asarray(ref[0]), atol=1e-5, err_msg=name)
            np.testing.assert_allclose(np.asarray(lse), np.asarray(ref[1]), atol=1e-5, err_msg=name)
            if sizes[2] == 4:  # heads really split: each device holds 1 of 4 KV heads
                assert o.addressable_shards[0].data.shape == (B // 2, N // 4, H), o.sharding
        if impl == "interpret":  # the check can fail: without shard_map XLA gathers the cache
            mesh = shd.make_mesh(shd.MeshConfig(8, 1, 1))
            kv_sh = shd.cache_shardings(cache, mesh).k[0]
            bare = jax.jit(lambda *a: kernels.decode_attention(*a, impl=impl))  # noqa: B023 (called within the iteration)
            hlo = bare.lower(q, jax.device_put(k, kv_sh), jax.device_put(v, kv_sh), fill)
            assert cache_collectives(hlo.compile().as_text(), C, H), "no gather without shard_map"


def check_decode_step() -> None:
    """transformer.decode_step with the interpreted kernel on a 2 x 2 x 2 mesh."""
    cfg = ModelConfig.tiny(n_heads=4, n_kv_heads=2, head_dim=16, n_layers=1)
    B, P, C = 4, 6, 20
    params = tf.init_params(cfg, jax.random.key(5))
    tokens = jax.random.randint(jax.random.key(6), (B, P), 1, cfg.vocab_size)
    lengths = jnp.array([6, 3, 5, 2])
    nxt = jnp.array([3, 4, 5, 6])
    cache = kvc.init_cache(B, 1, cfg.n_kv_heads, C, cfg.head_dim, n_heads=cfg.n_heads)
    _, cache = jax.jit(tf.prefill, static_argnums=1)(params, cfg, tokens, lengths, cache)
    step = jax.jit(tf.decode_step, static_argnums=1, static_argnames="attn_impl")
    ref, _ = step(params, cfg, cache, nxt, attn_impl="interpret")
    mesh = shd.make_mesh(shd.MeshConfig(2, 2, 2))
    g_cache = jax.device_put(cache, shd.cache_shardings(cache, mesh))
    fn = shd.sharded_decode_step(mesh, cfg, cache, attn_impl="interpret")
    args = (shd.shard_params(params, mesh), g_cache, shd.shard_batch(nxt, mesh))
    compiled = fn.lower(*args).compile()
    assert not cache_collectives(compiled.as_text(), C, cfg.head_dim)
    out, _ = compiled(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def check_sampler_matches_one_device() -> None:
    cfg = ModelConfig.tiny("qwen2", vocab_size=64)
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, tf.init_params(cfg, jax.random.key(0)))
    B, P = 8, 12
    prompts = jax.random.randint(jax.random.key(1), (B, P), 1, cfg.vocab_size)
    lengths = jnp.array([5, 12, 7, 9, 12, 3, 8, 10])
    scfg = smp.SamplerConfig(max_new_tokens=14, kv=kv.KVConfig(policy="snapkv", budget=8, buffer=4, window=2))
    key = jax.random.key(3)
    ref = smp.generate_jit(params, cfg, prompts, lengths, key, scfg)

    mesh = shd.make_mesh(shd.MeshConfig(data=2, fsdp=2, tensor=2))
    out = smp.generate_jit(
        shd.shard_params(params, mesh),
        cfg,
        shd.shard_batch(prompts, mesh),
        shd.shard_batch(lengths, mesh),
        key,
        dataclasses.replace(scfg, mesh=mesh),
    )
    assert len(out.tokens.sharding.device_set) == 8, out.tokens.sharding
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=2e-5)
    assert int(np.asarray(ref.n_compressions).min()) >= 2


def check_sampler_memory() -> None:
    """Compiled memory analysis: a sampler (SnapKV, budget 200 + buffer 40) whose batch is split
    8 ways holds ~1/8 of the single-device cache per device, and no K/V cache is all-gathered."""
    cfg = ModelConfig.tiny(
        "qwen2", vocab_size=64, d_model=32, n_heads=4, n_kv_heads=4, head_dim=32, d_ff=64, n_layers=2
    )
    params = tf.init_params(cfg, jax.random.key(0))
    B, P = 8, 12
    prompts = jax.random.randint(jax.random.key(1), (B, P), 1, cfg.vocab_size)
    lengths = jnp.full((B,), P)
    kv_cfg = kv.KVConfig(policy="snapkv", budget=200, buffer=40, window=2)
    scfg = smp.SamplerConfig(max_new_tokens=8, kv=kv_cfg)
    C = kv_cfg.capacity(P)
    key = jax.random.key(3)
    one = smp.generate_jit.lower(params, cfg, prompts, lengths, key, scfg).compile()
    mesh = shd.make_mesh(shd.MeshConfig(data=8))
    eight = smp.generate_jit.lower(
        shd.shard_params(params, mesh),
        cfg,
        shd.shard_batch(prompts, mesh),
        shd.shard_batch(lengths, mesh),
        key,
        dataclasses.replace(scfg, mesh=mesh),
    ).compile()
    cache_bytes = 2 * cfg.n_layers * B * cfg.n_kv_heads * C * cfg.head_dim * 4
    temp_one = one.memory_analysis().temp_size_in_bytes
    temp_eight = eight.memory_analysis().temp_size_in_bytes
    assert temp_one >= cache_bytes, (temp_one, cache_bytes)  # the cache lives in temp memory
    assert temp_eight <= temp_one / 8 * 1.15, (temp_eight, temp_one)
    assert temp_eight <= cache_bytes / 8 * 2.5, (temp_eight, cache_bytes)
    assert not cache_collectives(eight.as_text(), C, cfg.head_dim)
    print(f"MEMORY cache {cache_bytes} B; temp one device {temp_one} B, per device of 8 {temp_eight} B")


def check_sharded_lowering() -> None:
    """The sampler for TPU and GPU on a 2 x 2 x 2 mesh of fake devices, at Qwen2.5-1.5B's
    attention shapes (12 query / 2 KV heads, head_dim 128, bf16, R-KV 512 + 128 slots; 2 of its
    28 layers: tests/test_lowering.py lowers all of them unsharded): the kernel's custom call
    sees one device's shard of the cache, [64 / 4, 2 / 2, 640, 128]."""
    from test_lowering import PLATFORMS, lower, real, sds

    from sparserl_jax.kernels import decode_attention_gpu as gpu

    cfg, m = real("qwen2.5-1.5b")
    m = dataclasses.replace(m, n_layers=2)
    mesh = shd.make_mesh(shd.MeshConfig(2, 2, 2))
    B, P = 64, 128
    params = jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
        shd.abstract_params(m),
        shd.param_shardings(shd.abstract_params(m), mesh),
    )
    batch = shd.data_sharding(mesh)
    key = jax.eval_shape(jax.random.key, 0)
    for platform, (kernel_platform, marker) in PLATFORMS.items():
        if platform == "cuda" and not gpu.TRITON_AVAILABLE:
            continue
        scfg = smp.SamplerConfig(
            max_new_tokens=256, kv=cfg.kv, attn_impl="pallas", attn_platform=kernel_platform, mesh=mesh
        )
        gen = jax.jit(lambda p, t, n, k, c=scfg: smp.generate(p, m, t, n, k, c))
        text = lower(gen, platform, params, sds((B, P), "int32", batch), sds((B,), "int32", batch), key)
        local_kv = f"tensor<{B // 4}x{m.n_kv_heads // 2}x640x{m.head_dim}xbf16>"
        assert marker in text and local_kv in text, platform


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.device_count()
    check_attention_layouts()
    check_decode_step()
    check_sampler_matches_one_device()
    check_sampler_memory()
    check_sharded_lowering()
    print("SAMPLER SHARDED OK")
