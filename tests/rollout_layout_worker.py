"""Run in a subprocess with 8 fake CPU devices (tests/test_rollout_layout.py): the rollout layouts
(rollout.mesh, sparserl_jax/rollout/layout.py) from an FSDP training mesh (data 1 x fsdp 8 x
tensor 1, params by the partition rules) for a 2-layer model decoding 16 rows, R-KV and dense:

- data: the weights resharded once to a full copy on every device; the compiled sampler's while
  loops hold no collective but a scalar stop test, the whole program none besides it (its
  reshard is apart, in `place`), and every device's cache is its 2 rows' [2, K, C, H]; the
  tokens, lengths, kept counts and compressions equal one device's, the log-probs within
  float_tol's logprob_tol; the rollout source (rollout/source.py BatchSource) decodes with it.
- tensor:2: 4 groups of 2 devices, weights split over a group's 2; the same rollout as one device,
  and its loops move activations only (no weight, no KV cache): each collective is at most a
  group's rows x max(d_model, vocab) elements.
- the training layout's loop (the control: the reader finds what is there) all-gathers rows.

Prints the counts (experiments/lib/hlo_loops.py summary) and ROLLOUT LAYOUT OK."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from float_tol import logprob_tol

from experiments.lib.hlo_loops import collectives, summary, while_body_collectives
from sparserl_jax import kvcache as kv
from sparserl_jax.model import sharding as shd
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.quant.config import QuantConfig
from sparserl_jax.rollout import on_mesh
from sparserl_jax.rollout import sampler as smp
from sparserl_jax.rollout.config import RolloutConfig
from sparserl_jax.rollout.layout import rollout_mesh
from sparserl_jax.rollout.source import BatchSource

CFG = ModelConfig.tiny("qwen2", vocab_size=96, n_layers=2)  # D 64, 4 query / 2 KV heads of 16, F 128
# weights x4: peaked distributions, so the rows finish at different lengths (eos 5) and R-KV's
# scores are far apart
PARAMS = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, tf.init_params(CFG, jax.random.key(0)))
B, P, M = 16, 14, 16
KVS = {
    "rkv": kv.KVConfig(policy="rkv", budget=8, buffer=4, window=2),  # C = max(8, 14) + 4 = 18 slots
    "dense": kv.KVConfig(policy="none", buffer=4),  # C = 14 + 16 = 30
}
PROMPTS = np.asarray(jax.random.randint(jax.random.key(1), (B, P), 1, CFG.vocab_size), np.int32)
LENGTHS = np.asarray(jax.random.randint(jax.random.key(2), (B,), 3, P + 1), np.int32)
IDS = np.arange(B, dtype=np.int32) * 3 + 1  # request ids other than the rows
KEY = jax.random.key(3)


def sampler_cfg(policy: str) -> smp.SamplerConfig:
    return smp.SamplerConfig(max_new_tokens=M, eos_token_ids=(5,), kv=KVS[policy])


def one_device(policy: str) -> smp.Rollout:
    args = (jnp.asarray(PROMPTS), jnp.asarray(LENGTHS), KEY, sampler_cfg(policy), jnp.asarray(IDS))
    return jax.device_get(smp.generate_jit(PARAMS, CFG, *args))


def assert_same_rollout(out, ref, what: str, C: int) -> None:
    """Tokens, lengths, kept counts and compressions exactly; log-probs within logprob_tol (two
    float32 programs of the same model: here each row alone against a batch of 16)."""
    np.testing.assert_array_equal(out.tokens, ref.tokens, err_msg=what)
    np.testing.assert_array_equal(out.lengths, ref.lengths, err_msg=what)
    np.testing.assert_array_equal(out.kept, ref.kept, err_msg=what)
    np.testing.assert_array_equal(out.n_compressions, ref.n_compressions, err_msg=what)
    tol = logprob_tol(CFG, PARAMS, keys=C)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, rtol=0, atol=tol, err_msg=what)
    assert len(set(ref.lengths.tolist())) > 1, ref.lengths  # rows end apart: the stop test matters


def compiled_text(rm, placed, cfg: smp.SamplerConfig, manual) -> str:
    fn = on_mesh._per_device_program(CFG, cfg, rm.mesh, manual)
    return fn.lower(placed, *shd.shard_batch((PROMPTS, LENGTHS, IDS), rm.mesh), KEY).compile().as_text()


def check_data(train, policy: str, ref) -> None:
    cfg = sampler_cfg(policy)
    C = smp.cache_capacity(cfg.kv, P, M)
    rm = rollout_mesh("data", train)
    assert rm.per_device and rm.row_groups == 8 and dict(rm.mesh.shape) == {"data": 8, "fsdp": 1, "tensor": 1}
    placed = rm.place(shd.shard_params(PARAMS, train))
    gate = placed["layers"][0]["gate"]
    assert gate.sharding.spec == jax.sharding.PartitionSpec() and len(gate.sharding.device_set) == 8
    assert {s.data.shape for s in gate.addressable_shards} == {gate.shape}  # a full copy per device
    text = compiled_text(rm, placed, cfg, shd.AXES)  # the program rm.generate then runs (cached)
    out = rm.generate(placed, CFG, PROMPTS, LENGTHS, KEY, cfg, IDS)
    assert_same_rollout(out, ref, f"data {policy}", C)

    loops = while_body_collectives(text)
    print(f"data {policy}: loop collectives {summary(loops)}; whole program {summary(collectives(text))}")
    assert loops and all(c.scalar and c.op == "all-reduce" for c in loops), loops  # the stop test
    assert len(loops) <= 2, loops
    assert all(c.scalar for c in collectives(text)), summary(collectives(text))
    K, H = CFG.n_kv_heads, CFG.head_dim
    assert f"f32[{B // 8},{K},{C},{H}]" in text, "each device's cache: its own 2 rows"
    assert f"f32[{B},{K},{C},{H}]" not in text, "no device holds every row's cache"


def check_source(train, ref) -> None:
    """BatchSource with rollout.mesh=data on the training mesh: the weights placed once, the same
    rollout (the compiled program of check_data, reused)."""

    class Prompts:  # the source's prompt iterator (unused by generate)
        def next_batch(self):
            return []

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    rollout_cfg = RolloutConfig(prompts=B // 2, samples=2, max_new_tokens=M, mesh="data")
    source = BatchSource(
        rollout_cfg, sampler_cfg("rkv"), QuantConfig(), Prompts(), CFG, train, max_prompt_len=P, pad_token_id=0
    )
    params = shd.shard_params(PARAMS, train)
    out = source.generate(params, PROMPTS, LENGTHS, KEY)  # request ids 0 .. B-1
    want = jax.device_get(
        smp.generate_jit(PARAMS, CFG, jnp.asarray(PROMPTS), jnp.asarray(LENGTHS), KEY, sampler_cfg("rkv"))
    )
    np.testing.assert_array_equal(out.tokens, want.tokens)
    assert source.rollout.per_device


def check_tensor(train, ref) -> None:
    cfg = sampler_cfg("rkv")
    C = smp.cache_capacity(cfg.kv, P, M)
    rm = rollout_mesh("tensor:2", train)
    assert rm.row_groups == 4 and dict(rm.mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    placed = rm.place(shd.shard_params(PARAMS, train))
    gate = placed["layers"][0]["gate"]  # [D, F]: F over the group's 2 devices
    assert {s.data.shape for s in gate.addressable_shards} == {(CFG.d_model, CFG.d_ff // 2)}
    text = compiled_text(rm, placed, cfg, shd.BATCH)
    out = rm.generate(placed, CFG, PROMPTS, LENGTHS, KEY, cfg, IDS)
    assert_same_rollout(out, ref, "tensor:2", C)
    loops = while_body_collectives(text)
    print(f"tensor:2 rkv: loop collectives {summary(loops)}")
    rows = B // rm.row_groups
    assert loops and max(c.elements for c in loops) <= rows * max(CFG.d_model, CFG.vocab_size), summary(loops)


def check_train_layout_control(train) -> None:
    """The training layout's loop all-gathers rows and weights: what the data layout removes."""
    cfg = dataclasses.replace(sampler_cfg("rkv"), mesh=train)
    args = (shd.shard_params(PARAMS, train), CFG, *shd.shard_batch((PROMPTS, LENGTHS), train), KEY, cfg)
    text = smp.generate_jit.lower(*args, shd.shard_batch(IDS, train)).compile().as_text()
    loops = while_body_collectives(text)
    print(f"train (1, 8, 1) rkv: loop collectives {summary(loops)}")
    assert sum(c.op == "all-gather" and not c.scalar for c in loops) >= 8, summary(loops)


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.device_count()
    train = shd.make_mesh(shd.MeshConfig(data=1, fsdp=8, tensor=1))  # the 8-GPU overlay's training layout
    refs = {policy: one_device(policy) for policy in KVS}
    assert refs["rkv"].n_compressions.max() >= 2, refs["rkv"].n_compressions
    for policy in KVS:
        check_data(train, policy, refs[policy])
    check_source(train, refs["rkv"])
    check_tensor(train, refs["rkv"])
    check_train_layout_control(train)
    print("ROLLOUT LAYOUT OK")
