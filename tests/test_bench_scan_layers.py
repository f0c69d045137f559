"""experiments/bench/bench_scan_layers.py: its report from a made-up measurement (the default tier),
and at smoke size both arms compiled and run, the scanned program holding fewer dots in a loop and
the same gradient (extended: the learner's program and the scan are the default tier's, in
tests/test_scan_layers.py)."""

import json

import pytest
from float_tol import EPS32, forward_terms

from experiments.bench import bench_scan_layers as bs


def _arm(scan: bool, scale: float) -> dict:
    return {
        "scan_layers": scan,
        "lower_s": 4.0 * scale,
        "lower_cpu_s": 2.0 * scale,
        "compile_s": 10.0 * scale,
        "compile_cpu_s": 8.0 * scale,
        "step_s": 1.0,
        "step_cpu_s": 0.5,
        "steps_s": [1.0, 1.0, 1.0],
        "hlo_dots": 760 if not scan else 31,
        "hlo_whiles": 2 if scan else 0,
        "hlo_lines": 1000,
        "temp_bytes": 2**30,
        "argument_bytes": 2**20,
        "output_bytes": 2**20,
    }


def test_report_from_a_measurement():
    data = {
        "command": "python experiments/bench/bench_scan_layers.py",
        "provenance": {
            "commit": "abc",
            "uncommitted_changes": False,
            "portable_cpu": "host",
            "cpu": "AMD EPYC (family 25 model 1, no AVX-512)",
            "jax": "0.10.2",
            "cores": 2,
            "wall_s": 600.0,
        },
        "shape": "28 layers",
        "steps": 3,
        "arms": {"unrolled": _arm(False, 2.0), "scanned": _arm(True, 1.0)},
        "grad_rel_diff": 0.0,
    }
    md = bs.to_markdown(data)
    assert "| XLA compile, CPU s | 16.0 | 8.0 | 0.50x |" in md
    assert "| dots in the HLO | 760 | 31 | 0.04x |" in md
    assert "| while loops in the HLO | 0 | 2 | - |" in md
    assert "| temporaries, MiB | 1024.0 | 1024.0 | 1.00x |" in md
    assert "portable CPU settings off (a benchmark of this CPU: its own numerics)" in md


@pytest.mark.extended
def test_smoke(tmp_path):
    out = tmp_path / "bench.json"
    data = bs.main(["--smoke", "--out", str(out)])
    u, s = data["arms"]["unrolled"], data["arms"]["scanned"]
    assert s["hlo_dots"] < u["hlo_dots"] and s["hlo_whiles"] >= 1
    assert u["compile_s"] > 0 and s["step_s"] > 0
    # the same gradient: an entry sums rows x tokens token terms, each a path of forward_terms
    # float32 sums, in another order at most (n EPS32 of the largest entry)
    args = bs.parse_args(["--smoke"])
    n = args.rows * args.tokens + forward_terms(bs.model_config(args, False), args.tokens)
    assert data["grad_rel_diff"] <= n * EPS32
    assert json.loads(out.read_text())["provenance"]["cores"] >= 1
    assert "| XLA compile, wall s |" in (tmp_path / "bench.md").read_text()
