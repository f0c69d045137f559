"""FSDP as data parallelism (model/activation_sharding.py): the reader of compiled HLO
(experiments/lib/hlo_layout.py) on a small HLO text, and the trainer's programs compiled for 8 fake
CPU devices read with it (tests/fsdp_layout_worker.py, a subprocess)."""

from __future__ import annotations

import json

import pytest
from test_sharding import run_on_fake_devices

from experiments.lib import hlo_layout

# B = 16 rows of T = 48 tokens, D = 64, F = 128 on 8 devices: a data-parallel program's activations
# (2 rows, one flattened, one transposed), weights that must not read as rows ([64, 128], merged
# gate and up [64, 2, 128]) nor XLA's merged gate and up outputs [2, 48, 2, 128, 1] (their 2 is
# no row), a combined all-gather of two weights, an asynchronous all-reduce (start and done: one),
# a reduce-scatter and [T, T] attention scores of 2 rows x 4 heads.
HLO = """HloModule jit_step, entry_computation_layout={(f32[8,128]{1,0}, f32[2,48,64]{2,1,0})->f32[2,48,64]{2,1,0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %a, f32[] %b)
}

ENTRY %main (w: f32[8,128], x: f32[2,48,64]) -> f32[2,48,64] {
  %w = f32[8,128]{1,0} parameter(0)
  %x = f32[2,48,64]{2,1,0} parameter(1)
  %all-gather.1 = (f32[64,128]{1,0}, f32[128,64]{1,0}) all-gather(f32[8,128]{1,0} %w, f32[16,64]{1,0} %w2), dimensions={0}
  %flat = f32[96,64]{1,0} bitcast(f32[2,48,64]{2,1,0} %x)
  %h = f32[96,128]{1,0} dot(f32[96,64]{1,0} %flat, f32[64,128]{1,0} %g), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %t = f32[128,2,48]{2,1,0} transpose(f32[2,48,128]{2,1,0} %h3), dimensions={2,0,1}
  %gu = f32[2,48,2,128,1]{4,3,2,1,0} dot(f32[96,64]{1,0} %flat, f32[64,2,128]{2,1,0} %gate_up)
  %s = f32[2,4,48,48]{3,2,1,0} dot(f32[2,4,48,16]{3,2,1,0} %q, f32[2,4,48,16]{3,2,1,0} %k)
  %all-reduce-start.2 = f32[64,128]{1,0} all-reduce-start(f32[64,128]{1,0} %gw), to_apply=%add
  %all-reduce-done.2 = f32[64,128]{1,0} all-reduce-done(f32[64,128]{1,0} %all-reduce-start.2)
  %reduce-scatter.3 = f32[8,128]{1,0} reduce-scatter(f32[64,128]{1,0} %gw), dimensions={0}, to_apply=%add
  ROOT %y = f32[2,48,64]{2,1,0} add(f32[2,48,64]{2,1,0} %x, f32[2,48,64]{2,1,0} %x)
}
"""


def test_hlo_layout_reads_rows_scores_and_collectives():
    found = hlo_layout.activations(HLO, 48, (64, 128))
    assert {a.dims for a in found} == {(2, 48, 64), (96, 64), (96, 128), (128, 2, 48), (2, 48, 128)}
    assert {a.rows for a in found} == {2}
    assert hlo_layout.activation_rows_per_device(HLO, 48, (64, 128)) == 2
    # the whole batch on every device, its model dim split (flattened, or with a size-1 dim): 16 rows
    for whole in ("f32[768,8]", "f32[16,1,48,8]"):
        assert hlo_layout.activation_rows_per_device(HLO.replace("f32[96,128]", whole), 48, (64, 128, 8)) == 16
    assert hlo_layout.activation_rows_per_device(HLO, 40, (64, 128)) == 0  # no activation of that length
    assert hlo_layout.attention_rows_per_device(HLO, 48) == 8
    assert hlo_layout.attention_rows_per_device(HLO, 64) == 0
    counts = hlo_layout.collective_counts(HLO)
    assert (counts["all-gather"], counts["all-reduce"], counts["reduce-scatter"], counts["all-to-all"]) == (1, 1, 1, 0)
    assert hlo_layout.gathered_arrays(HLO) == [(64, 128), (128, 64)]


@pytest.mark.slow
def test_fsdp_programs_split_the_batch_and_gather_the_weights_on_8_devices():
    """Meshes (data, fsdp, tensor) = (1, 8, 1), (2, 4, 1), (1, 4, 2): the trainer's micro-batch
    gradient program, its scoring program and prefill give each device B / (data x fsdp) rows,
    all-gather every layer weight, and the update's numbers equal one device's."""
    out = run_on_fake_devices("fsdp_layout_worker.py", "FSDP_LAYOUT_OK")
    records = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("FSDP_LAYOUT ")]
    assert len(records) == 9  # 3 programs x 3 meshes
    for r in records:
        d, f, t = r["mesh"]
        assert r["activation_rows_per_device"] == 16 // (d * f), r
        assert r["collectives"]["all-gather"] > 0, r


@pytest.mark.slow
def test_head_window_programs_split_the_batch_on_8_devices():
    """rl.update.head_window=response on the mesh (1, 4, 2): the micro-batch and scoring programs
    with the head over each row's 32-position window still give each device its own rows and
    gather every layer weight, and the update's numbers equal one device's with the same window
    (the worker's checks)."""
    out = run_on_fake_devices("fsdp_layout_worker.py", "FSDP_LAYOUT_OK", "--mesh", "1,4,2", "--head-window", "32")
    records = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("FSDP_LAYOUT ")]
    assert len(records) == 3  # update, scoring, prefill
    assert all(r["activation_rows_per_device"] == 16 // 4 for r in records), records  # B = 16 over fsdp 4
