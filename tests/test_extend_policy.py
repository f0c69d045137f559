"""Adding an eviction policy, walked through once as docs/layout.md ("How to extend") says, with a
toy "oldest" policy that keeps the earliest entries (the opposite of StreamingLLM's recency):

1. its file, sparserl_jax/kvcache/policies/oldest.py in the package (here in this test): a score
   per slot, larger kept first, and a Policy registered where it is defined:
   POLICY = register(Policy(...));
2. its name on the import line of sparserl_jax/kvcache/policies/__init__.py, which runs that
   registration (here the fixture registers it, and takes it out of the registry after the test).

kv.policy=oldest then validates, compress keeps what the score says, and the rollout sampler
decodes with it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparserl_jax import kvcache as kv
from sparserl_jax.kvcache.policies import POLICIES, Policy, register
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rollout import sampler as smp

# ----------------------------------------------------------------------------- 1. the file


def oldest_first(kv_cfg, cache, layer, key=None):
    """Score = -original position: the earliest entries win."""
    return -cache.pos[layer].astype(jnp.float32)


POLICY = Policy(name="oldest", score=oldest_first)


# ----------------------------------------------------------------------------- the walk-through


@pytest.fixture
def registered(monkeypatch):
    with pytest.raises(ValueError, match=r"kv\.policy='oldest'"):
        kv.KVConfig(policy="oldest")
    register(POLICY)  # 1.-2. what importing oldest.py from the package does
    yield
    del POLICIES["oldest"]


def test_a_toy_policy_compresses_through_the_registry(registered):
    budget, window, C = 6, 2, 10
    cfg = kv.KVConfig(policy="oldest", budget=budget, buffer=C - budget, window=window)
    fills = np.array([10, 8, 5])  # over the budget, over it, under it (left alone)
    L, B, K, H = 2, len(fills), 2, 4
    cache = kv.init_cache(B, L, K, C, H)
    pos = np.where(np.arange(C)[None] < fills[:, None], np.arange(C)[None], -1)  # in order
    cache = cache.replace(
        k=tuple(jax.random.normal(jax.random.key(i), (B, K, C, H)) for i in range(L)),
        pos=tuple(jnp.broadcast_to(jnp.asarray(pos, jnp.int32)[:, None], (B, K, C)) for _ in range(L)),
        fill=jnp.asarray(fills, jnp.int32),
        length=jnp.asarray(fills, jnp.int32),
    )
    out = jax.jit(kv.compress, static_argnums=0)(cfg, cache)
    for b, f in enumerate(fills):
        if f > budget:  # the oldest budget - window entries, then the always-kept window
            want = [*range(budget - window), *range(f - window, f)]
        else:
            want = list(range(f))
        for kept in kv.kept_positions(out):
            for k in range(K):
                got = np.asarray(kept[b, k])
                assert got[got >= 0].tolist() == want, (b, k)


def test_a_toy_policy_runs_in_the_sampler(registered):
    model_cfg = ModelConfig.tiny("qwen2", vocab_size=64)
    params = tf.init_params(model_cfg, jax.random.key(0))
    budget, window = 12, 2
    kv_cfg = kv.KVConfig(policy="oldest", budget=budget, buffer=4, window=window)
    scfg = smp.SamplerConfig(max_new_tokens=12, record_kept=True, kv=kv_cfg)
    lengths = jnp.array([6, 10, 8])
    tokens = jax.random.randint(jax.random.key(7), (3, 10), 1, model_cfg.vocab_size)
    tokens = jnp.where(jnp.arange(10)[None] < lengths[:, None], tokens, 0)
    out = smp.generate_jit(params, model_cfg, tokens, lengths, jax.random.key(1), scfg)
    assert int(out.n_compressions.min()) >= 1
    assert np.all(np.isfinite(np.asarray(out.logprobs)[np.asarray(out.mask)]))
    # every cache the sampler held kept its oldest entries
    kept = np.asarray(out.kept_positions)  # [R, L, B, K, C]
    for idx in np.ndindex(kept.shape[:4]):
        held = set(kept[idx][kept[idx] >= 0].tolist())
        assert set(range(min(len(held), budget - window))) <= held, idx
