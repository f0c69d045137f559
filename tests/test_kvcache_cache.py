"""The fixed-slot KV cache: allocation, prompt and token writes, slot gathers, resizing, and the
cache-level helpers of the eviction API (cache_for, kept_positions)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparserl_jax import kvcache as kv
from sparserl_jax.kvcache import cache as kvc
from sparserl_jax.model.config import ModelConfig

L, B, K, N, H = 2, 3, 2, 4, 8


def rng_from(seed: int) -> np.random.Generator:
    """NumPy generator seeded from a fresh jax.random key (eager jax.random compiles per shape)."""
    return np.random.default_rng(np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32))


def normal(seed, shape):
    return jnp.asarray(rng_from(seed).normal(size=shape), jnp.float32)


def randint(seed, shape, high):
    return jnp.asarray(rng_from(seed).integers(0, high, size=shape), jnp.int32)


def prefilled(capacity=12, T=7, lengths=(7, 4, 1), **kw):
    cache = kvc.init_cache(B, L, K, capacity, H, **kw)
    ks = [normal(10 + l, (B, T, K, H)) for l in range(L)]
    vs = [normal(20 + l, (B, T, K, H)) for l in range(L)]
    return kvc.write_prefill(cache, ks, vs, jnp.array(lengths)), ks, vs


def test_init_cache_shapes_and_state():
    cache = kvc.init_cache(B, L, K, 16, H, jnp.bfloat16, n_heads=N, track_mass=True, window=3)
    assert (cache.capacity, cache.n_layers) == (16, L)
    assert cache.k[1].shape == (B, K, 16, H) and cache.k[0].dtype == jnp.bfloat16
    assert cache.mass[0].shape == (B, K, 16) and cache.mass[0].dtype == jnp.float32
    assert cache.window_q[0].shape == (B, N, 3, H)
    assert (np.asarray(cache.pos[0]) == -1).all() and not np.asarray(cache.valid()).any()
    assert cache.nbytes() == 2 * L * B * K * 16 * H * 2
    bare = kvc.init_cache(B, L, K, 16, H)
    assert bare.mass is None and bare.window_q is None
    with pytest.raises(ValueError, match="n_heads"):
        kvc.init_cache(B, L, K, 16, H, window=3)


def test_write_prefill_ragged():
    lengths = (7, 4, 1)
    cache, ks, vs = prefilled(lengths=lengths)
    np.testing.assert_array_equal(np.asarray(cache.fill), lengths)
    np.testing.assert_array_equal(np.asarray(cache.length), lengths)
    for l in range(L):
        np.testing.assert_array_equal(np.asarray(cache.k[l])[:, :, :7], np.swapaxes(np.asarray(ks[l]), 1, 2))
        np.testing.assert_array_equal(np.asarray(cache.v[l])[:, :, :7], np.swapaxes(np.asarray(vs[l]), 1, 2))
        pos = np.asarray(cache.pos[l])
        for b, n in enumerate(lengths):
            assert pos[b, :, :n].tolist() == [list(range(n))] * K
            assert (pos[b, :, n:] == -1).all()
    np.testing.assert_array_equal(np.asarray(cache.valid()), np.arange(12)[None] < np.array(lengths)[:, None])
    with pytest.raises(ValueError, match="capacity"):
        prefilled(capacity=5, T=7)


def test_write_token_and_advance_per_sequence_slot():
    cache, _, _ = prefilled()
    before = [np.asarray(x) for x in cache.k]
    k_new, v_new = normal(1, (B, K, H)), normal(2, (B, K, H))
    cache = kvc.write_token(cache, 1, k_new, v_new)
    k1, pos1 = np.asarray(cache.k[1]), np.asarray(cache.pos[1])
    for b, slot in enumerate((7, 4, 1)):
        np.testing.assert_array_equal(k1[b, :, slot], np.asarray(k_new)[b])
        np.testing.assert_array_equal(np.asarray(cache.v[1])[b, :, slot], np.asarray(v_new)[b])
        assert (pos1[b, :, slot] == slot).all()  # position = length (no eviction yet)
        others = np.delete(np.arange(12), slot)
        np.testing.assert_array_equal(k1[b, :, others], before[1][b, :, others])
    np.testing.assert_array_equal(np.asarray(cache.k[0]), before[0])  # other layer untouched
    cache = kvc.advance(cache)
    assert np.asarray(cache.fill).tolist() == [8, 5, 2] and np.asarray(cache.length).tolist() == [8, 5, 2]


def test_write_token_into_a_full_cache_is_dropped():
    cache, _, _ = prefilled(capacity=7, lengths=(7, 3, 2))
    before = np.asarray(cache.k[0])
    cache = kvc.write_token(cache, 0, normal(3, (B, K, H)), normal(4, (B, K, H)))
    np.testing.assert_array_equal(np.asarray(cache.k[0])[0], before[0])  # no wrap-around
    assert not np.array_equal(np.asarray(cache.k[0])[1], before[1])


@pytest.mark.parametrize("length", [3, 7])
def test_write_token_at_batch_1_writes_one_slot_or_drops_when_full(length):
    """Batch 1 takes its own path (a scatter with a dropped second row): the same semantics."""
    cache = kvc.init_cache(1, L, K, 7, H)
    cache = kvc.write_prefill(
        cache, [normal(30, (1, length, K, H))] * L, [normal(31, (1, length, K, H))] * L, jnp.array([length])
    )
    k_new = normal(32, (1, K, H))
    out = kvc.write_token(cache, 0, k_new, k_new)
    new_KxH = np.asarray(k_new)[0]
    for got, old, new in ((out.k, cache.k, new_KxH), (out.v, cache.v, new_KxH), (out.pos, cache.pos, length)):
        want = np.asarray(old[0]).copy()
        if length < 7:  # room left: slot `length` gets the token, nothing else changes
            want[0, :, length] = new
        np.testing.assert_array_equal(np.asarray(got[0]), want)


@pytest.mark.parametrize("batch", [1, 3])
def test_the_select_write_equals_the_scatter_on_random_slots(batch):
    """XLA:CPU's path for a 16-bit cache (one select over the buffer) writes what the scatter
    writes, a slot past the buffer (a full sequence) included: every bfloat16 bit equal."""
    C = 6
    for seed in range(4):
        buf = normal(40 + seed, (batch, K, C, H)).astype(jnp.bfloat16)
        new = normal(50 + seed, (batch, K, H)).astype(jnp.bfloat16)
        slot = randint(60 + seed, (batch,), C + 1)  # C: no free slot, the row is dropped
        want = np.asarray(buf).copy()
        for b, s in enumerate(np.asarray(slot)):
            if s < C:
                want[b, :, s] = np.asarray(new)[b]
        for write in (kvc._scatter, kvc._select):
            got = np.asarray(jax.jit(write)(buf, new, slot))
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_a_bfloat16_token_write_on_cpu_is_one_select_without_float32_copies():
    """The compiled CPU program of write_token on a bfloat16 cache: no scatter and no convert of
    a cache-sized buffer among the program's own instructions (XLA:CPU widens a bfloat16
    scatter's whole buffer to float32 and back, each a pass over memory; a convert inside the
    select's loop fusion stays in registers); the float32 cache keeps its scatter."""
    for dtype, scatters in ((jnp.bfloat16, False), (jnp.float32, True)):
        cache = kvc.init_cache(B, 1, K, 16, H, dtype=dtype)
        k_new = normal(70, (B, K, H)).astype(dtype)
        hlo = jax.jit(lambda c, k: kvc.write_token(c, 0, k, k).k[0]).lower(cache, k_new).compile().as_text()
        cache_sized = f"[{B},{K},16,{H}]"
        entry = hlo.split("\nENTRY ", 1)[1].splitlines()
        assert ('op_name="jit(<lambda>)/scatter"' in hlo) == scatters, dtype  # a scatter, or its expansion
        assert not any(" convert(" in x and cache_sized in x for x in entry), dtype


def test_gather_slots_matches_numpy():
    x = normal(5, (B, K, 9, H))
    idx = randint(6, (B, K, 4), 9)
    got = np.asarray(kvc.gather_slots(x, idx))
    xn, idn = np.asarray(x), np.asarray(idx)
    for b, h, j in np.ndindex(B, K, 4):
        np.testing.assert_array_equal(got[b, h, j], xn[b, h, idn[b, h, j]])
    pos = randint(7, (B, K, 9), 100)
    np.testing.assert_array_equal(np.asarray(kvc.gather_slots(pos, idx)), np.take_along_axis(np.asarray(pos), idn, 2))


def test_resize_grows_and_shrinks():
    cache, _, _ = prefilled(capacity=9, n_heads=N, track_mass=True, window=2)
    cache = cache.replace(mass=tuple(jnp.abs(normal(30 + l, (B, K, 9))) for l in range(L)))
    assert kvc.resize(cache, 9) is cache
    big = kvc.resize(cache, 13)
    assert big.capacity == 13 and big.window_q[0].shape == (B, N, 2, H)
    for l in range(L):
        np.testing.assert_array_equal(np.asarray(big.k[l])[:, :, :9], np.asarray(cache.k[l]))
        np.testing.assert_array_equal(np.asarray(big.mass[l])[:, :, :9], np.asarray(cache.mass[l]))
        assert (np.asarray(big.pos[l])[:, :, 9:] == -1).all()
        assert (np.asarray(big.mass[l])[:, :, 9:] == 0).all() and (np.asarray(big.k[l])[:, :, 9:] == 0).all()
    small = kvc.resize(big, 7)
    np.testing.assert_array_equal(np.asarray(small.fill), np.asarray(cache.fill))
    for a, b in zip(
        jax.tree.leaves(small.k + small.pos + small.mass), jax.tree.leaves(cache.k + cache.pos + cache.mass)
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[:, :, :7])


def test_cache_for_sizes_and_state():
    mcfg = ModelConfig.tiny(n_layers=L, n_heads=N, n_kv_heads=K, head_dim=H, dtype="bfloat16")
    rkv = kv.KVConfig(policy="rkv", budget=16, buffer=8, window=4)
    cache = kv.cache_for(rkv, mcfg, B, prompt_len=10)
    assert cache.capacity == 24 and cache.k[0].dtype == jnp.bfloat16
    assert cache.window_q[0].shape == (B, N, 4, H) and cache.mass is None
    assert kv.cache_for(rkv, mcfg, B, prompt_len=20).capacity == 28  # whole prompt + buffer
    h2o = kv.cache_for(kv.KVConfig(policy="h2o", budget=16, buffer=8, window=4), mcfg, B, 10, jnp.float32)
    assert h2o.mass is not None and h2o.window_q is None and h2o.k[0].dtype == jnp.float32
    prompt_sized = kv.cache_for(
        kv.KVConfig(policy="snapkv", budget=16, buffer=8, window=4, compress_prompt=True), mcfg, B, 40, capacity=40
    )
    assert prompt_sized.capacity == 40
    dense = kv.KVConfig()
    assert kv.cache_for(dense, mcfg, B, 10, capacity=50).capacity == 50
    with pytest.raises(ValueError, match="capacity"):
        kv.cache_for(dense, mcfg, B, 10)
    with pytest.raises(ValueError, match="prompt_len"):
        kv.cache_for(rkv, mcfg, B, 10, capacity=5)


def test_kept_positions_masks_empty_slots():
    cache, _, _ = prefilled()
    stale = tuple(p.at[:, :, 10].set(99) for p in cache.pos)  # a stale entry beyond fill
    got = kv.kept_positions(cache.replace(pos=stale))
    for l in range(L):
        want = np.where(np.asarray(cache.valid())[:, None, :], np.asarray(stale[l]), -1)
        np.testing.assert_array_equal(np.asarray(got[l]), want)
        assert (np.asarray(got[l])[:, :, 10] == -1).all()
