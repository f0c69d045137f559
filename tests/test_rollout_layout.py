"""sparserl_jax/rollout/layout.py (rollout.mesh) and experiments/lib/hlo_loops.py: the setting's
values and errors, the reader of a compiled loop's collectives on a hand-written HLO text, and on 8
fake CPU devices (tests/rollout_layout_worker.py) the data and tensor:2 layouts from an FSDP
training mesh: the one-device rollout, and a decode loop with no collective but its stop test.
The slot engine and evaluation on the layout: an insert's rows laid out per device, evaluation on
one device as before, and on 8 fake devices (tests/engine_layout_worker.py) the one-device tokens
with a segment loop holding no collective but its stop test."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest
from test_sharding import run_on_fake_devices

from experiments.lib.hlo_loops import collectives, summary, while_body_collectives
from sparserl_jax import kvcache as kv
from sparserl_jax.config import load_config
from sparserl_jax.data.datasets import PromptExample
from sparserl_jax.evaluate import evaluate_examples
from sparserl_jax.model import sharding as shd
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rollout.config import RolloutConfig
from sparserl_jax.rollout.engine import SlotEngine, _row_layout
from sparserl_jax.rollout.layout import RolloutLayout, rollout_mesh
from sparserl_jax.rollout.sampler import SamplerConfig
from sparserl_jax.rollout.source import check_rows_per_call

TESTS = Path(__file__).parent


def test_rollout_mesh_accepts_train_data_and_tensor_groups():
    assert RolloutConfig().mesh == "train"
    assert RolloutLayout.parse("data") == RolloutLayout("data")
    assert RolloutLayout.parse("tensor:4") == RolloutLayout("tensor", 4)
    for bad in ("fsdp", "tensor", "tensor:0", "tensor:-2", "tensor:two", "", 8, None):
        with pytest.raises(ValueError, match=r"rollout\.mesh=.*accepted values are \('train', 'data', 'tensor:N'\)"):
            RolloutConfig(mesh=bad)


def test_rollout_mesh_on_one_device_decodes_as_the_training_layout():
    """One device: every layout is the plain sampler and `place` hands the weights back as they
    are (no copy); a group larger than the devices is refused, naming the setting."""
    train = shd.make_mesh(shd.MeshConfig(1, 1, 1), jax.devices()[:1])
    params = {"w": jax.numpy.ones((2, 3))}
    for value in ("train", "data", "tensor:1"):
        rm = rollout_mesh(value, train)
        assert not rm.per_device and rm.row_groups == 1 and rm.manual_axes == ()
        assert rm.place(params) is params
    with pytest.raises(ValueError, match=r"rollout\.mesh='tensor:2': 2 devices per group must divide the mesh's 1"):
        rollout_mesh("tensor:2", train)
    check_rows_per_call(3, train, "data")  # one row group: any count


# A compiled program's shape, written by hand: an outer loop (its condition holds a scalar
# all-reduce, the stop test), whose body runs an inner loop (a row all-gather) and a conditional
# whose branch starts an async all-reduce; one all-gather before the loops.
HLO = """HloModule jit_f, entry_computation_layout={(f32[4,8]{1,0})->f32[4,8]{1,0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%inner_body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %ag = f32[32,8]{1,0} all-gather(%x), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %sl = f32[4,8]{1,0} slice(%ag), slice={[0:4], [0:8]}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %sl)
}

%inner_cond (p: (s32[], f32[4,8])) -> pred[] {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%branch_reduce (x: f32[4,8]) -> f32[4,8] {
  %x = f32[4,8]{1,0} parameter(0)
  %ars = f32[4,8]{1,0} all-reduce-start(%x), channel_id=2, replica_groups=[1,8]<=[8], to_apply=%add
  ROOT %ard = f32[4,8]{1,0} all-reduce-done(%ars)
}

%branch_keep (x: f32[4,8]) -> f32[4,8] {
  ROOT %x = f32[4,8]{1,0} parameter(0)
}

%outer_body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %w = (s32[], f32[4,8]{1,0}) while(%p), condition=%inner_cond, body=%inner_body
  %x = f32[4,8]{1,0} get-tuple-element(%w), index=1
  %c = pred[] constant(true)
  %y = f32[4,8]{1,0} conditional(%c, %x, %x), branch_computations={%branch_reduce, %branch_keep}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %y)
}

%outer_cond (p: (s32[], f32[4,8])) -> pred[] {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %all = s32[] all-reduce(%i), channel_id=3, replica_groups=[1,8]<=[8], to_apply=%add
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%all, %n), direction=LT
}

ENTRY %main (x: f32[4,8]) -> f32[4,8] {
  %x = f32[4,8]{1,0} parameter(0)
  %pre = f32[32,8]{1,0} all-gather(%x), channel_id=4, replica_groups=[1,8]<=[8], dimensions={0}
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,8]{1,0}) tuple(%zero, %x)
  %loop = (s32[], f32[4,8]{1,0}) while(%init), condition=%outer_cond, body=%outer_body
  ROOT %out = f32[4,8]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_while_body_collectives_follow_calls_into_nested_loops_and_branches():
    found = {(c.op, c.computation): c for c in while_body_collectives(HLO)}
    assert set(found) == {
        ("all-gather", "inner_body"),
        ("all-reduce", "branch_reduce"),
        ("all-reduce", "outer_cond"),
    }  # not the entry's all-gather, nor the async all-reduce twice (its -done)
    assert found["all-gather", "inner_body"].loop == "w"  # the innermost loop reaching it
    assert found["all-reduce", "branch_reduce"].loop == "loop"
    assert found["all-reduce", "outer_cond"].scalar and not found["all-gather", "inner_body"].scalar
    assert found["all-gather", "inner_body"].elements == 32 * 8
    assert [c.loop for c in collectives(HLO) if c.computation == "main"] == [None]
    assert summary(while_body_collectives(HLO)) == {
        "all-gather f32[32,8]": 1,
        "all-reduce f32[4,8]": 1,
        "all-reduce s32[]": 1,
    }
    with pytest.raises(ValueError, match="no HLO computations"):
        while_body_collectives("not HLO")


def test_engine_lays_out_an_insert_over_every_slot_or_per_device():
    """SlotEngine's insert rows (Q = 8 slots, 4 row groups of 2): over every slot in order, the
    padding after them aimed at slot Q; per device, each group's rows are the requests aimed at
    its own slots, by their index in the group (2: padding), in a bucket of the busiest group's
    rows x 4; a row aimed at slot Q (warm_up's) is padding."""
    slots = np.array([5, 0, 7, 1, 6])  # groups 2, 0, 3, 0, 3
    take, index = _row_layout(slots, 8, 4, False)
    assert take.tolist() == [0, 1, 2, 3, 4, -1, -1, -1] and index.tolist() == [5, 0, 7, 1, 6, 8, 8, 8]
    take, index = _row_layout(slots, 8, 4, True)  # 2 rows a group
    assert take.tolist() == [1, 3, -1, -1, 0, -1, 2, 4] and index.tolist() == [0, 1, 2, 2, 1, 2, 1, 0]
    take, index = _row_layout(np.array([3]), 8, 4, True)  # one request: one row a group
    assert take.tolist() == [-1, 0, -1, -1] and index.tolist() == [2, 1, 2, 2]
    take, index = _row_layout(np.array([8] * 8), 8, 4, True, rows=8)  # warm_up's bucket of 8
    assert take.tolist() == [-1] * 8 and index.tolist() == [2] * 8
    cfg = SamplerConfig(max_new_tokens=4)
    with pytest.raises(ValueError, match=r"manual_axes=\('tensor',\): accepted values are"):
        SlotEngine(ModelConfig.tiny("qwen2", vocab_size=32, n_layers=1), cfg, 8, 4, manual_axes=("tensor",))


class _Digits:
    """A tokenizer for evaluate_examples: token ids as space-separated numbers."""

    pad_token_id = 0

    def decode(self, ids):
        return " ".join(map(str, ids))


def test_evaluation_on_one_device_decodes_as_before_on_any_layout():
    """evaluate_examples on a one-device mesh with rollout.mesh=data or tensor:1 is the mesh-less
    evaluation, response for response (the same compiled sampler); a bad layout names the setting."""
    cfg = ModelConfig.tiny("qwen2", vocab_size=32, n_layers=1)
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, tf.init_params(cfg, jax.random.key(0)))
    rows = np.asarray(jax.random.randint(jax.random.key(1), (6, 5), 1, 32))
    examples = [PromptExample("", tuple(r[: 2 + i % 4].tolist()), str(i % 2), f"row {i}") for i, r in enumerate(rows)]
    sampler = SamplerConfig(max_new_tokens=6, eos_token_ids=(5,), kv=kv.KVConfig(policy="none", buffer=2))

    def reward(text: str, label: str) -> float:
        return float(str(len(text.split()) % 2) == label)

    def run(**kw):
        return evaluate_examples(params, cfg, _Digits(), examples, reward, sampler, k=2, batch_size=12, **kw)

    want = run()
    one = shd.make_mesh(shd.MeshConfig(1, 1, 1), jax.devices()[:1])
    for layout in ("data", "tensor:1"):
        got = run(mesh=one, layout=layout)
        assert got["samples"] == want["samples"] and got["accuracy"] == want["accuracy"]
    assert len({s["length"] for s in want["samples"]}) > 1, want["samples"]
    with pytest.raises(ValueError, match=r"rollout\.mesh='fsdp': accepted values"):
        run(layout="fsdp")


@pytest.mark.slow
def test_data_layout_decodes_from_fsdp_weights_with_no_collective_in_the_loop():
    """tests/rollout_layout_worker.py on 8 fake CPU devices, training mesh (1, 8, 1): rollout.mesh
    data (R-KV and dense) and tensor:2 give the one-device rollout; data's compiled decode loop
    holds only the scalar stop test (the training layout's, the control, gathers rows and weights);
    tensor:2's moves activations only; the rollout source decodes with the layout."""
    run_on_fake_devices("rollout_layout_worker.py", "ROLLOUT LAYOUT OK")


@pytest.mark.slow
def test_engine_and_evaluation_on_the_data_layout_decode_per_device():
    """tests/engine_layout_worker.py on 8 fake CPU devices, training mesh (1, 8, 1), rollout.mesh
    data: the slot engine (2 slots a device, refills) gives the one-device engine's tokens and
    slot-steps, its compiled segment holds only the scalar stop test in its loop (the
    XLA-partitioned engine's, the control, gathers rows), its insert and harvest no collective;
    SortedSource builds it so; evaluation gives the one-device accuracy and responses."""
    run_on_fake_devices("engine_layout_worker.py", "ENGINE LAYOUT OK")


@pytest.mark.extended
def test_engine_resumes_per_device_and_on_tensor_groups_moves_activations_only():
    """tests/engine_layout_worker.py more: on data, requests resumed by prefill into other devices'
    slots end as on one device; rollout.mesh=tensor:2 (4 groups of 2 devices, 4 slots a group)
    gives the one-device engine's tokens, its segment loop moving activations only, each device
    holding its group's 4 slots and one of the 2 KV heads."""
    run_on_fake_devices("engine_layout_worker.py", "ENGINE LAYOUT OK", "more")


def test_8gpu_data_overlay_trains_fsdp_and_decodes_data_parallel():
    """experiments/configs/real/mesh/8gpu_rollout_data.yaml on Qwen2.5-1.5B: the training layout
    of 8gpu.yaml (fsdp 8), rollout.mesh=data, and sampler calls whose rows split over the 8 GPUs."""
    real = TESTS.parent / "experiments/configs/real"
    cfg = load_config([str(real / "qwen2.5-1.5b.yaml"), str(real / "mesh/8gpu_rollout_data.yaml")], [])
    fsdp = load_config([str(real / "qwen2.5-1.5b.yaml"), str(real / "mesh/8gpu.yaml")], [])
    assert cfg.mesh == fsdp.mesh == shd.MeshConfig(data=1, fsdp=8, tensor=1)
    assert cfg.rl == fsdp.rl and cfg.rollout == dataclasses.replace(fsdp.rollout, mesh="data")
    assert cfg.rollout.call_rows % 8 == 0 and cfg.rollout.call_rows // 8 == 64  # 64 rows a GPU a call
