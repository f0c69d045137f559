"""The TPU compile table (experiments/device/tpu_compile.py): its topologies, its reading of XLA's
refusals and memory plans, the overlay scaled to a topology's chips, and one toy row compiled by
libtpu for a v5e:2x2 slice on this CPU (skipped where libtpu is not installed:
requirements-tpu.txt)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from experiments.device import tpu_hlo, tpu_table, tpu_topology

REPO = Path(__file__).resolve().parent.parent
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
# XLA:TPU's refusal of Qwen2.5-1.5B's update on v5e-8 (issue 58), word for word
REFUSAL = (
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
    "(21.77G) exceeds available HBM (15.75G)."
)


def test_topologies_name_their_chips_and_cloud_type():
    v5e, v5p = tpu_topology.parse("v5e:2x4"), tpu_topology.parse("v5p:2x2x2")
    assert (v5e.chips, v5e.accelerator_type, v5e.hbm_gib) == (8, "v5litepod-8", 16.0)
    assert (v5p.chips, v5p.accelerator_type) == (8, "v5p-16")  # Cloud counts v5p's cores: 2 a chip
    assert tpu_topology.parse("v5p:2x2x1").accelerator_type == "v5p-8"
    env = tpu_topology.environment(v5e)
    assert env["JAX_PLATFORMS"] == "cpu" and env["TPU_ACCELERATOR_TYPE"] == "v5litepod-8"
    for bad in ("v5e-8", "v9:2x2", "v5e:2"):
        with pytest.raises(ValueError, match="--topologies"):
            tpu_topology.parse(bad)


def test_a_refusal_for_memory_is_an_answer_and_other_errors_are_not():
    assert tpu_table.oom(REFUSAL) == {"needed_g": 21.77, "available_g": 15.75}
    assert tpu_table.oom("Ran out of memory in memory space hbm. Used 30.5G of 15.48G hbm.") == {
        "needed_g": 30.5,
        "available_g": 15.48,
    }
    assert tpu_table.refused(REFUSAL)["fits"] is False
    other = tpu_table.refused("NotImplementedError: Mosaic kernels cannot be automatically partitioned.")
    assert other["fits"] is None and other["oom"] is None


def test_a_compiled_programs_chip_total_adds_what_the_trainer_holds_beside_it():
    stats = types.SimpleNamespace(
        argument_size_in_bytes=3 * tpu_table.GIB,
        output_size_in_bytes=2 * tpu_table.GIB,
        alias_size_in_bytes=2 * tpu_table.GIB,  # the donated accumulator
        temp_size_in_bytes=5 * tpu_table.GIB,
        generated_code_size_in_bytes=1,
    )
    hlo = "ENTRY %main (p: f32[4]) -> f32[4] {\n  ROOT %n = f32[4]{0} negate(%p)\n}\n"
    beside = {"master": 6 * tpu_table.GIB, "optimizer state": 2 * tpu_table.GIB}
    cols = tpu_table.compiled_columns(stats, hlo, beside, 16.0, length=None, widths=[])
    assert cols["program_bytes"] == 8 * tpu_table.GIB and cols["chip_bytes"] == 16 * tpu_table.GIB
    assert cols["fits"] is True
    assert tpu_table.compiled_columns(stats, hlo, beside, 15.75, length=None, widths=[])["fits"] is False
    report = {
        "phase_bytes": {"persistent": 10 * tpu_table.GIB, "update": 6 * tpu_table.GIB},
        "items": [{"name": "update activations", "phase": "update", "bytes": 6 * tpu_table.GIB}],
        "peak_bytes": 16 * tpu_table.GIB,
        "peak_phase": "update",
    }
    dry = tpu_table.dry_run_columns("update", report, cols["chip_bytes"])
    assert dry["dryrun"]["per_chip"] == 16 * tpu_table.GIB and dry["ratio"] == 1.0


def test_largest_arrays_weigh_dtypes():
    hlo = (
        "ENTRY %main (p: bf16[16,5120,192]) -> f32[6,16,2,64,64] {\n"
        "  %a = bf16[16,5120,192]{2,1,0} negate(%p)\n"
        "  %b = (f32[6,16,2,64,64]{4,3,2,1,0}, s32[]) custom-call(%a)\n"
        "  ROOT %c = f32[6,16,2,64,64]{4,3,2,1,0} get-tuple-element(%b), index=0\n"
        "}\n"
    )
    top = tpu_hlo.largest_arrays(hlo, n=2)
    assert [t["array"] for t in top] == ["bf16[16,5120,192]", "f32[6,16,2,64,64]"]
    assert top[0]["bytes"] == 16 * 5120 * 192 * 2 and top[1]["bytes"] == 6 * 16 * 2 * 64 * 64 * 4


def test_an_overlay_is_scaled_to_the_topologys_chips():
    """The 8-device overlay on a 4-chip slice: fsdp over the 4, each chip keeping its rows."""
    from experiments.device import tpu_programs

    cfg = tpu_programs.load_config(tpu_programs.overlay_paths("qwen2.5-1.5b", "8gpu")[0])
    assert tpu_programs.scaled_overrides(cfg, 8) == []
    assert tpu_programs.scaled_overrides(cfg, 4) == [
        "mesh.data=1",
        "mesh.fsdp=4",
        "rl.update.micro_batch_size=8",
        "rl.update.score_batch_size=8",
        "rollout.rows_per_call=256",
    ]
    with pytest.raises(ValueError, match="--configs"):
        tpu_programs.overlay_paths("qwen9", "8gpu")


def test_a_setup_resolves_the_models_autos_for_the_tpu_not_this_host():
    """model.attention and model.dot_accumulation "auto" read JAX's backend at trace time, which
    here is the CPU's: a setup compiled for a TPU names what a TPU host would pick."""
    from experiments.device import tpu_programs, tpu_topology

    s = tpu_programs.setup("qwen2.5-1.5b", tpu_topology.parse("v5e:2x2"))
    assert (s.model.dtype, s.attention_setting) == ("bfloat16", "auto")
    assert (s.model.attention, s.model.dot_accumulation) == ("splash", "output")
    assert s.overrides[-2:] == ("model.attention=splash", "model.dot_accumulation=output")
    # a setting the row names is kept
    s = tpu_programs.setup("qwen2.5-1.5b", tpu_topology.parse("v5e:2x2"), overrides=["model.dot_accumulation=float32"])
    assert s.model.dot_accumulation == "float32" and s.overrides[-1] == "model.attention=splash"
    s = tpu_programs.setup("qwen2.5-1.5b", tpu_topology.parse("v5e:2x2"), overrides=["model.dtype=auto"])
    assert s.model.dtype == "bfloat16" and "model.dtype=bfloat16" in s.overrides


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (pip install -r requirements-tpu.txt)")
def test_a_toy_row_compiles_for_a_v5e_slice(tmp_path):
    """The toy model's update compiled by XLA:TPU for v5e:2x2 on this CPU: a row with XLA's memory,
    the dry run beside it and the HLO's columns, written as JSON and markdown."""
    out = tmp_path / "quick.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    argv = ["experiments/device/tpu_compile.py", "--quick", "--programs", "update", "--out", str(out)]
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    table = json.loads(out.read_text())
    (row,) = table["rows"]
    assert (row["config"], row["topology"], row["program"], row["chips"]) == ("toy", "v5e:2x2", "update", 4)
    assert row["ok"] and row["fits"] is True
    x = row["xla"]
    assert x["argument"] > 0 and x["temp"] > 0 and x["output"] > 0
    assert row["program_bytes"] == x["argument"] + x["output"] - x["alias"] + x["temp"]
    assert row["chip_bytes"] == row["program_bytes"] + sum(row["held_beside"].values())
    assert row["held_beside"]["optimizer state"] > 0
    assert row["dryrun"]["phase"] == "update" and row["dryrun"]["per_chip"] > 0 and row["ratio"] > 0
    assert row["compile_s"] > 0 and row["rows"] == 8 and row["rows_per_chip"] == 2
    assert row["remat"] in ("none", "full", "selective") and row["xla_flops"] > 0
    hlo = row["hlo"]
    assert set(hlo["collectives"]) >= {"all-gather", "all-reduce", "reduce-scatter"}
    # every token activation holds the chip's own rows, the embedding lookup's too (XLA:TPU looked up
    # all 8 rows, D split, from the fsdp-split table before ActivationSharding.lookup_table)
    assert hlo["activation_rows"]["rows"] == row["rows_per_chip"] and hlo["largest_arrays"][0]["bytes"] > 0
    assert table["provenance"]["libtpu"] and table["provenance"]["jax"]
    md = out.with_suffix(".md").read_text()
    assert "| toy | v5e:2x2 (4) | 1,4,1 | update |" in md and "Provenance:" in md


def test_xlas_memory_report_names_the_largest_slices_and_their_arrays():
    """The default memory space of XLA's memory-usage report (--xla_dump_to): its total and its
    largest buffer's slices, largest first; the other spaces (vmem) are not read."""
    report = (
        "Memory Space: default (color=0)\n"
        "Total bytes: 3221225472 (3.00GiB)\n"
        "  cumulative_size;       size;       offset; used_by_n_values; shapes_list\n"
        "  ------------------------------------------------------------\n"
        "   512.0MiB( 17%);   512.0MiB;            0;                2; bf16[2,5120,8960], f32[2,5120,1536]\n"
        "     2.50GiB( 83%);     2.00GiB;    536870912;                3; 3×f32[6,2,2,5120,5120]\n"
        "\n"
        "Memory Space: vmem (color=1)\n"
        "Total bytes: 4243456 (4.05MiB)\n"
        "  cumulative_size;       size;       offset; used_by_n_values; shapes_list\n"
        "  ------------------------------------------------------------\n"
        "     4.0MiB( 99%);     4.0MiB;            0;                9; 9×f32[2,128,128]\n"
    )
    got = tpu_hlo.memory_report(report)
    assert got["total_bytes"] == 3 * 1024**3
    assert got["largest"] == [
        {"bytes": 2 * 1024**3, "values": 3, "shapes": "3×f32[6,2,2,5120,5120]"},
        {"bytes": 512 * 1024**2, "values": 2, "shapes": "bf16[2,5120,8960], f32[2,5120,1536]"},
    ]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (pip install -r requirements-tpu.txt)")
def test_splash_backward_without_the_fused_kernel_keeps_no_dq_partial_per_kv_block():
    """splash's fused backward writes dq as one partial per KV block ([T / 512] x q: 10 copies of q
    at 5120 positions); the separate dQ kernel (attention.SPLASH_FUSED_BWD off, the default) writes
    it once. Compiled by XLA:TPU for a v5p chip at one Qwen2.5-1.5B layer's shape: at least 4 q's
    worth of temporaries less, and one more kernel (dK/dV, then dQ)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "tpu_splash_worker.py")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    fused, separate = got["fused"], got["separate_dq"]
    assert separate["temp_bytes"] + 4 * got["q_bytes"] <= fused["temp_bytes"], got
    assert separate["mosaic_calls"] == fused["mosaic_calls"] + 1, got


def test_the_committed_dry_run_is_within_15_percent_of_every_compiled_row_and_agrees_on_fits():
    """Issue 58's measure of the dry run: for every row of the committed compile table, the dry
    run of this code (recomputed here from the row's setup: config, overlay, topology, attention,
    overrides) is the one committed beside it, within 15% of XLA:TPU's total per chip, and says
    fits / does not fit as XLA's compile did (a refusal for memory: does not fit)."""
    from experiments.device import tpu_programs as tp

    table = json.loads((REPO / "experiments" / "results" / "tpu" / "compile_table.json").read_text())
    assert table["rows"]
    for row in table["rows"]:
        name = f"{row['config']} {row['topology']} {row.get('mesh_overlay')} {row['program']} {row['overrides']}"
        cols = tp.row_dry_run(row)
        dry = cols["dryrun"]["per_chip"]
        assert dry == row["dryrun"]["per_chip"], f"{name}: committed dry run is not this code's (--refresh-dryrun)"
        assert row["fits"] is not None, f"{name}: neither compiled nor refused for memory: {row.get('error')}"
        assert (dry <= row["hbm_gib"] * tpu_table.GIB) == row["fits"], f"{name}: dry run {dry / tpu_table.GIB:.2f} GiB"
        if row["ok"]:
            assert 0.85 <= row["chip_bytes"] / dry <= 1.15, f"{name}: chip / dry run {row['chip_bytes'] / dry:.2f}"
