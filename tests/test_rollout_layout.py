"""sparserl_jax/rollout/layout.py (rollout.mesh) and experiments/lib/hlo_loops.py: the setting's
values and errors, the reader of a compiled loop's collectives on a hand-written HLO text, and on 8
fake CPU devices (tests/rollout_layout_worker.py) the data and tensor:2 layouts from an FSDP
training mesh: the one-device rollout, and a decode loop with no collective but its stop test."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import pytest
from test_sharding import run_on_fake_devices

from experiments.lib.hlo_loops import collectives, summary, while_body_collectives
from sparserl_jax.config import load_config
from sparserl_jax.model import sharding as shd
from sparserl_jax.rollout.config import RolloutConfig
from sparserl_jax.rollout.layout import RolloutLayout, rollout_mesh
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
        assert not rm.per_device and rm.row_groups == 1
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


@pytest.mark.slow
def test_data_layout_decodes_from_fsdp_weights_with_no_collective_in_the_loop():
    """tests/rollout_layout_worker.py on 8 fake CPU devices, training mesh (1, 8, 1): rollout.mesh
    data (R-KV and dense) and tensor:2 give the one-device rollout; data's compiled decode loop
    holds only the scalar stop test (the training layout's, the control, gathers rows and weights);
    tensor:2's moves activations only; the rollout source decodes with the layout."""
    run_on_fake_devices("rollout_layout_worker.py", "ROLLOUT LAYOUT OK")


def test_8gpu_data_overlay_trains_fsdp_and_decodes_data_parallel():
    """experiments/configs/real/mesh/8gpu_rollout_data.yaml on Qwen2.5-1.5B: the training layout
    of 8gpu.yaml (fsdp 8), rollout.mesh=data, and sampler calls whose rows split over the 8 GPUs."""
    real = TESTS.parent / "experiments/configs/real"
    cfg = load_config([str(real / "qwen2.5-1.5b.yaml"), str(real / "mesh/8gpu_rollout_data.yaml")], [])
    fsdp = load_config([str(real / "qwen2.5-1.5b.yaml"), str(real / "mesh/8gpu.yaml")], [])
    assert cfg.mesh == fsdp.mesh == shd.MeshConfig(data=1, fsdp=8, tensor=1)
    assert cfg.rl == fsdp.rl and cfg.rollout == dataclasses.replace(fsdp.rollout, mesh="data")
    assert cfg.rollout.call_rows % 8 == 0 and cfg.rollout.call_rows // 8 == 64  # 64 rows a GPU a call
