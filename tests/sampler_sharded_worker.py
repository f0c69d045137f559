"""Run in a subprocess with 8 fake CPU devices: the sparse sampler with params sharded by the
partition rules and the batch sharded over data x fsdp equals the single-device rollout."""

import jax
import jax.numpy as jnp
import numpy as np

from sparserl_jax import kvcache as kv
from sparserl_jax.model import sharding as shd
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rollout import sampler as smp

assert jax.device_count() == 8, jax.device_count()
cfg = ModelConfig.tiny("qwen2", vocab_size=64)
params = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, tf.init_params(cfg, jax.random.key(0)))
B, P = 8, 12
prompts = jax.random.randint(jax.random.key(1), (B, P), 1, cfg.vocab_size)
lengths = jnp.array([5, 12, 7, 9, 12, 3, 8, 10])
scfg = smp.SamplerConfig(max_new_tokens=14, kv=kv.KVConfig(policy="snapkv", budget=8, buffer=4, window=2))
key = jax.random.key(3)
ref = smp.generate_jit(params, cfg, prompts, lengths, key, scfg)

mesh = shd.make_mesh(shd.MeshConfig(data=2, fsdp=2, tensor=2))
out = smp.generate_jit(shd.shard_params(params, mesh), cfg, shd.shard_batch(prompts, mesh),
                       shd.shard_batch(lengths, mesh), key, scfg)
assert len(out.tokens.sharding.device_set) == 8, out.tokens.sharding
np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=2e-5)
assert int(np.asarray(ref.n_compressions).min()) >= 2
print("SAMPLER SHARDED OK")
