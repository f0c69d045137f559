"""Run in a subprocess with 8 fake CPU devices (tests/test_rollout_layout.py): SortedRL's slot
engine and evaluation on the rollout layout rollout.mesh=data (sparserl_jax/rollout/layout.py),
from an FSDP training mesh (data 1 x fsdp 8 x tensor 1), for rollout_layout_worker's 2-layer
model with R-KV:

- the engine (16 slots, 2 a device, 24 requests with staggered length limits: refills into
  either slot of a device, segments of 2 chunks) gives the one-device engine's tokens, lengths,
  kept counts and compressions exactly, its log-probs within float_tol's logprob_tol, and the same
  slot-steps (the stop test keeps every device stepping as long as one device does); its compiled
  segment holds no collective but scalars (the stop test in its while loop, the active count's sum
  after it), its insert and harvest none at all; every device holds its own 2 slots' cache. The
  XLA-partitioned engine on the same mesh (the control: the reader finds what is there) gathers
  rows in its loop. SortedSource builds its engine per device. Weights on the rollout mesh
  already are not placed again (RolloutMesh.place; the evaluation CLI places them before).
- evaluation (evaluate.py evaluate_examples with layout "data") gives the one-device accuracy,
  lengths, KV saving and responses, decoding on the data layout.

With the argument `more`, instead: requests resumed by prefill (sorted.resume=prefill) into
other devices' slots end as on one device; and rollout.mesh=tensor:2 (4 groups of 2 devices, 4
slots a group) gives the one-device engine's rollout, each device holding its group's slots and
one of the 2 KV heads, its segment loop moving activations only.

Prints the counts (experiments/lib/hlo_loops.py summary) and ENGINE LAYOUT OK."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from float_tol import logprob_tol
from rollout_layout_worker import CFG, PARAMS, sampler_cfg

from experiments.lib.hlo_loops import collectives, summary, while_body_collectives
from sparserl_jax.data.datasets import PromptExample
from sparserl_jax.evaluate import evaluate_examples
from sparserl_jax.model import sharding as shd
from sparserl_jax.quant.config import QuantConfig
from sparserl_jax.rollout import on_mesh
from sparserl_jax.rollout import sampler as smp
from sparserl_jax.rollout.config import RolloutConfig, SortedConfig
from sparserl_jax.rollout.engine import Finished, SlotEngine
from sparserl_jax.rollout.layout import rollout_mesh
from sparserl_jax.rollout.source import SortedSource

Q, P, N = 16, 14, 24  # slots (2 a device), prompt width, requests
KEY = jax.random.key(5)


def requests():
    tokens = np.array(jax.random.randint(jax.random.key(6), (N, P), 1, CFG.vocab_size), np.int32)
    lengths = np.asarray(jax.random.randint(jax.random.key(7), (N,), 3, P + 1), np.int32)
    tokens[np.arange(P)[None] >= lengths[:, None]] = 0
    ids = np.arange(N, dtype=np.int32) * 5 + 2
    limits = np.asarray(jax.random.randint(jax.random.key(8), (N,), 2, 17), np.int32)  # staggered finishes
    return tokens, lengths, ids, limits


def scalar_only(text: str, what: str) -> list:
    """The program's collectives, each of them a scalar."""
    found = collectives(text)
    assert all(c.scalar for c in found), f"{what}: {summary(found)}"
    return found


def check_engine(train) -> None:
    cfg = sampler_cfg("rkv")
    C = smp.cache_capacity(cfg.kv, P, cfg.max_new_tokens)
    tokens, lengths, ids, limits = requests()
    ref_eng = SlotEngine(CFG, cfg, Q, P, segment_chunks=2)
    ref = ref_eng.run(PARAMS, KEY, tokens, lengths, ids, limits=limits)
    assert len(set(ref.lengths.tolist())) > 4 and ref.n_compressions.max() >= 2, (ref.lengths, ref.n_compressions)

    rm = rollout_mesh("data", train)
    placed = rm.place(shd.shard_params(PARAMS, train))
    assert rollout_mesh("data", train).place(placed) is placed  # on the rollout mesh already: kept
    eng = SlotEngine(CFG, cfg, Q, P, segment_chunks=2, mesh=rm.mesh, manual_axes=rm.manual_axes)
    assert eng.dp == 8 and eng.manual_axes == shd.AXES
    got = eng.run(placed, KEY, tokens, lengths, ids, limits=limits)
    for name in ("request", "lengths", "tokens", "kept", "n_compressions"):
        np.testing.assert_array_equal(getattr(got, name), getattr(ref, name), err_msg=name)
    tol = logprob_tol(CFG, PARAMS, keys=C)  # two float32 programs: 2 slots a device against 16
    np.testing.assert_allclose(got.logprobs, ref.logprobs, rtol=0, atol=tol)
    st, rt = eng.stats, ref_eng.stats
    assert (st.slot_steps, st.active_slot_steps) == (rt.slot_steps, rt.active_slot_steps), (st, rt)

    # the compiled programs (the ones run above: jit's cache), fed as run feeds them
    state = eng.init_state()
    state = eng.insert(placed, state, KEY, [1, 2, 5], tokens[:3], lengths[:3], ids[:3])  # devices 0, 1, 2
    k0 = state.cache.k[0]
    assert {s.data.shape for s in k0.addressable_shards} == {(Q // 8, *k0.shape[1:])}, "2 slots a device"
    seg = eng._segment.lower(placed, state, KEY, jnp.int32(0)).compile().as_text()
    loops = while_body_collectives(seg)
    print(f"engine data: segment loop collectives {summary(loops)}; whole program {summary(collectives(seg))}")
    assert loops and all(c.scalar and c.op == "all-reduce" for c in loops) and len(loops) <= 2, summary(loops)
    scalar_only(seg, "segment")
    assert f"f32[{Q // 8},{CFG.n_kv_heads},{C},{CFG.head_dim}]" in seg, "each device's cache: its own 2 slots"
    assert f"f32[{Q},{CFG.n_kv_heads},{C},{CFG.head_dim}]" not in seg, "no device holds every slot's cache"
    harvest = eng._harvest.lower(state, eng._all_slots).compile().as_text()
    assert not collectives(harvest), summary(collectives(harvest))
    args, prefix = eng.insert_args(np.arange(0, Q, 2), tokens[:8], lengths[:8], ids[:8])  # one a device
    insert = eng._insert.lower(placed, state, KEY, *args, prefix, jnp.int32(0), resume=False)
    assert not collectives(insert.compile().as_text()), "each device prefills its own requests"

    control = SlotEngine(CFG, cfg, Q, P, segment_chunks=2, mesh=rm.mesh)  # XLA-partitioned, same mesh
    text = control._segment.lower(placed, control.init_state(), KEY, jnp.int32(0)).compile().as_text()
    gathered = [c for c in while_body_collectives(text) if c.op == "all-gather" and not c.scalar]
    print(f"engine data, XLA-partitioned (control): segment loop collectives {summary(while_body_collectives(text))}")
    assert len(gathered) >= 8, summary(while_body_collectives(text))


def resumed(eng: SlotEngine, params):
    """SortedRL's resume by prefill (sorted.resume=prefill): 8 requests (one a device) decoded one
    segment, harvested, released, and the unfinished ones resumed (prompt + partial response
    prefilled again) in other slots and run to their end; the resumed requests' responses."""
    tokens, lengths, ids, _ = requests()
    slots = np.arange(0, Q, 2)
    state = eng.init_state()
    state = eng.insert(params, state, KEY, slots, tokens[:8], lengths[:8], ids[:8])
    state, done, _ = eng.segment(params, state, KEY, 0)
    partial = eng.harvest(state, slots)
    state = eng.release_all(state)
    going = np.flatnonzero(~done[slots])
    assert len(going) >= 2, done
    where = (slots[going] + 9) % Q  # each to another device's other slot
    part = Finished.concat([partial.row(i) for i in going])
    state = eng.insert(params, state, KEY, where, tokens[going], lengths[going], ids[going], partial=part, version=1)
    done = np.zeros((Q,), bool)
    while not done[where].all():
        state, done, _ = eng.segment(params, state, KEY, 1)
    return eng.harvest(state, where)


def check_resume(train) -> None:
    """Requests resumed by prefill on the data layout end as on one device."""
    cfg = sampler_cfg("rkv")
    rm = rollout_mesh("data", train)
    eng = SlotEngine(CFG, cfg, Q, P, segment_chunks=2, mesh=rm.mesh, manual_axes=rm.manual_axes)
    got = resumed(eng, rm.place(shd.shard_params(PARAMS, train)))
    want = resumed(SlotEngine(CFG, cfg, Q, P, segment_chunks=2), PARAMS)
    for name in ("request", "lengths", "tokens", "kept", "n_compressions", "version"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=f"resumed {name}")
    C = smp.cache_capacity(cfg.kv, P, cfg.max_new_tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=logprob_tol(CFG, PARAMS, keys=C))
    assert (want.version == 0).any() and (want.version == 1).any(), want.version
    print(f"engine data: {len(want.request)} requests resumed by prefill, lengths {want.lengths.tolist()}")


def check_engine_tensor(train) -> None:
    """rollout.mesh=tensor:2: 4 groups of 2 devices, each group's 4 slots alone, XLA splitting its
    step over the group's 2: the one-device engine's rollout, a loop moving activations only."""
    cfg = sampler_cfg("rkv")
    C = smp.cache_capacity(cfg.kv, P, cfg.max_new_tokens)
    tokens, lengths, ids, limits = requests()
    ref = SlotEngine(CFG, cfg, Q, P, segment_chunks=2).run(PARAMS, KEY, tokens, lengths, ids, limits=limits)
    rm = rollout_mesh("tensor:2", train)
    placed = rm.place(shd.shard_params(PARAMS, train))
    eng = SlotEngine(CFG, cfg, Q, P, segment_chunks=2, mesh=rm.mesh, manual_axes=rm.manual_axes)
    assert eng.dp == 4 and eng.manual_axes == shd.BATCH
    got = eng.run(placed, KEY, tokens, lengths, ids, limits=limits)
    for name in ("request", "lengths", "tokens", "kept", "n_compressions"):
        np.testing.assert_array_equal(getattr(got, name), getattr(ref, name), err_msg=name)
    np.testing.assert_allclose(got.logprobs, ref.logprobs, rtol=0, atol=logprob_tol(CFG, PARAMS, keys=C))
    state = eng.init_state()
    k0 = state.cache.k[0]  # [Q, K, C, H]: a group's 4 slots, one KV head a device
    assert {s.data.shape for s in k0.addressable_shards} == {(Q // 4, CFG.n_kv_heads // 2, C, CFG.head_dim)}
    text = eng._segment.lower(placed, state, KEY, jnp.int32(0)).compile().as_text()
    loops = while_body_collectives(text)
    print(f"engine tensor:2: segment loop collectives {summary(loops)}")
    rows = Q // 4
    assert loops and max(c.elements for c in loops) <= rows * max(CFG.d_model, CFG.vocab_size), summary(loops)


def check_sorted_source(train) -> None:
    """rollout.mesh=data, rollout.scheduler=sorted: the source's engine runs per device."""

    class Prompts:  # the source's prompt iterator (unused here)
        def next_batch(self):
            return []

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    r = RolloutConfig(prompts=4, samples=2, max_new_tokens=16, mesh="data", scheduler="sorted")
    source = SortedSource(
        r,
        sampler_cfg("rkv"),
        QuantConfig(),
        SortedConfig(slots=Q),
        Prompts(),
        CFG,
        train,
        max_prompt_len=P,
        pad_token_id=0,
        seed=0,
    )
    engine = source.scheduler.engine
    assert engine.manual_axes == shd.AXES and engine.mesh == source.rollout.mesh and engine.dp == 8


class Digits:
    """A tokenizer for evaluate_examples: token ids as space-separated numbers."""

    pad_token_id = 0

    def decode(self, ids):
        return " ".join(map(str, ids))


def check_evaluation(train) -> None:
    """evaluate_examples on rollout.mesh=data from the training layout: the one-device numbers,
    every sampler call through the per-device program."""
    tokens, lengths, _, _ = requests()
    examples = [
        PromptExample(prompt="", prompt_ids=tuple(t[:n].tolist()), label=str(i % 3), source=f"row {i}")
        for i, (t, n) in enumerate(zip(tokens[:12], lengths[:12]))
    ]

    def reward(text: str, label: str) -> float:  # depends on the response: equal rewards need equal tokens
        return float(str(len(text.split()) % 3) == label)

    cfg = sampler_cfg("rkv")
    kw = dict(k=2, seed=3, batch_size=12, max_prompt_len=P)
    one = evaluate_examples(PARAMS, CFG, Digits(), examples, reward, cfg, **kw)
    before = on_mesh._per_device_program.cache_info()
    data = evaluate_examples(
        shd.shard_params(PARAMS, train), CFG, Digits(), examples, reward, cfg, mesh=train, layout="data", **kw
    )
    after = on_mesh._per_device_program.cache_info()
    assert after.hits + after.misses - before.hits - before.misses == 2, "both calls on the data layout"
    assert [s["response"] for s in data["samples"]] == [s["response"] for s in one["samples"]]
    for name in ("accuracy", "mean_length", "kv_saving", "nonfinite_rows"):
        assert data[name] == one[name], (name, data[name], one[name])
    assert 0 < one["accuracy"] < 1 and one["kv_saving"] > 0, one
    print(f"evaluation data: accuracy {data['accuracy']:.4f}, mean length {data['mean_length']:.2f}")


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.device_count()
    train = shd.make_mesh(shd.MeshConfig(data=1, fsdp=8, tensor=1))  # the 8-GPU overlay's training layout
    if sys.argv[1:] == ["more"]:
        check_resume(train)
        check_engine_tensor(train)
    else:
        check_engine(train)
        check_sorted_source(train)
        check_evaluation(train)
    print("ENGINE LAYOUT OK")
