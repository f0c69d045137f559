"""experiments/bench/bench_head_window.py at smoke size: both arms compiled and run side by side,
the windowed program's head holding only the window's rows, and the arms' gradients and
response log-probs equal to the head's summation order."""

import json

from experiments.bench import bench_head_window as bh


def test_smoke_runs_both_arms(tmp_path):
    out = tmp_path / "hw.json"
    data = bh.main(["--smoke", "--out", str(out)])
    full, window = data["arms"]["full"], data["arms"]["response"]
    # 2 rows: 32 positions padded to one chunk of chunk_tokens (1024); the window, 2 x 8 in one fitted chunk
    assert full["head_rows"] == [1024] and window["head_rows"] == [16]
    # bfloat16 compute with float32 accumulation: the same values to one bfloat16 rounding of the
    # head's output (2^-8 relative), far below a lost row's or a misplaced window's difference
    assert data["grad_rel_diff"] <= 2**-7 and data["logp_abs_diff"] <= 0.05
    assert len(full["steps_s"]) == len(window["steps_s"]) == 1
    saved = json.loads(out.read_text())
    assert saved["arms"] == data["arms"] and saved["provenance"]["portable_cpu"] == "host"
    md = (tmp_path / "hw.md").read_text()
    assert "| the head's rows per chunk (compiled) | 1024 | 16 | |" in md
