"""Run in a subprocess with 8 fake CPU devices (tests/test_engine.py): the slot engine on a mesh
data 2 x fsdp 2 x tensor 2 (slots over data x fsdp, params by the partition rules), with Q = 4
slots < N = 7 requests (refills), equals the same engine on one device per request (tokens
exactly, sampler log-probs to 1e-5) for a dense cache and SnapKV (sampled with top-p within a
top-k, recording each token's kept set and top candidates: the same records), and its slot
state's KV cache is split over the slots (a quarter of them per device). Prints ENGINE SHARDED OK."""

import jax
import numpy as np

from sparserl_jax import kvcache as kv
from sparserl_jax.model import sharding as shd
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rollout import sampler as smp
from sparserl_jax.rollout.engine import SlotEngine
from sparserl_jax.rollout.sampling import SamplingConfig

CFG = ModelConfig.tiny("qwen2", vocab_size=64, n_layers=1)
PARAMS = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, tf.init_params(CFG, jax.random.key(0)))
P, M, Q, N = 8, 10, 4, 7


def prompts():
    tokens = np.array(jax.random.randint(jax.random.key(3), (N, P), 1, CFG.vocab_size), np.int32)
    lengths = np.asarray(jax.random.randint(jax.random.key(4), (N,), 3, P + 1), np.int32)
    tokens[np.arange(P)[None] >= lengths[:, None]] = 0
    return tokens, lengths


def check(policy: str, mesh, records: bool) -> None:
    kv_cfg = kv.KVConfig(policy=policy, budget=6, buffer=4, window=2)
    extra = dict(sampling=SamplingConfig(top_p=0.9, top_k=20), replay_filters=True, agreement_k=8) if records else {}
    cfg = smp.SamplerConfig(max_new_tokens=M, eos_token_ids=(5,), kv=kv_cfg, **extra)
    tokens, lengths = prompts()
    ids = np.array([4, 0, 9, 2, 7, 1, 3], np.int32)
    limits = np.array([3, 10, 5, 8, 2, 10, 6], np.int32)  # staggered finishes: refills mid-run
    key = jax.random.key(2)
    ref_eng = SlotEngine(CFG, cfg, Q, P, segment_chunks=1)
    ref = ref_eng.run(PARAMS, key, tokens, lengths, ids, limits=limits)

    eng = SlotEngine(CFG, cfg, Q, P, segment_chunks=1, mesh=mesh)
    assert eng.dp == 4 and eng.mesh is mesh
    params = shd.shard_params(PARAMS, mesh)
    assert len(params["layers"][0]["gate"].sharding.device_set) == 8
    got = eng.run(params, key, tokens, lengths, ids, limits=limits)

    assert (ref.lengths >= 1).all() and len(set(ref.lengths.tolist())) > 1, ref.lengths
    np.testing.assert_array_equal(got.request, ref.request)
    np.testing.assert_array_equal(got.lengths, ref.lengths)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_allclose(got.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.kept, ref.kept)
    np.testing.assert_array_equal(got.n_compressions, ref.n_compressions)
    if records:
        np.testing.assert_array_equal(got.kept_ids, ref.kept_ids)
        np.testing.assert_array_equal(got.top_ids, ref.top_ids)
        np.testing.assert_allclose(got.top_logp, ref.top_logp, rtol=1e-5, atol=1e-5)
        assert (ref.kept_ids[:, :, 0] >= 0).any()
    if policy != "none":
        assert ref.n_compressions.max() >= 1, ref.n_compressions

    # the slot state (fresh, after an insert, and after a segment) keeps its KV cache split over
    # the slots: Q / (data x fsdp) = 1 slot per device
    state = eng.init_state()
    state = eng.insert(params, state, key, [0, 1, 2], tokens[:3], lengths[:3], ids[:3])
    state, _, _ = eng.segment(params, state, key, 0)
    for leaf in (state.cache.k[0], state.cache.v[0], state.cache.fill, state.tokens):
        assert len(leaf.sharding.device_set) == 8, leaf.sharding
        shapes = {s.data.shape for s in leaf.addressable_shards}
        assert shapes == {(Q // 4,) + leaf.shape[1:]} or (
            leaf.ndim == 4 and shapes == {(Q // 4, leaf.shape[1] // 2) + leaf.shape[2:]}
        ), (shapes, leaf.shape)
    assert ref_eng.stats.slot_steps > 0 and eng.stats.slot_steps == ref_eng.stats.slot_steps + Q * 4
    print(policy, "k shard", state.cache.k[0].addressable_shards[0].data.shape, "of", state.cache.k[0].shape)
    print(policy, "lengths", got.lengths.tolist(), "compressions", got.n_compressions.tolist())


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.device_count()
    mesh = shd.make_mesh(shd.MeshConfig(data=2, fsdp=2, tensor=2))
    for policy in ("none", "snapkv"):
        check(policy, mesh, records=policy == "snapkv")
    print("ENGINE SHARDED OK")
