"""experiments/bench/bench_host_memory.py at smoke size: one process of each arm, each having
applied its train.host_memory before JAX's backend started, the same log-probs bit for bit."""

import json

from experiments.bench import bench_host_memory as bhm


def test_smoke_runs_one_process_of_each_arm(tmp_path):
    out = tmp_path / "hm.json"
    data = bhm.main(["--smoke", "--out", str(out)])
    system, reuse = data["arms"]["system"], data["arms"]["reuse"]
    assert system["note"] == "system: glibc's defaults"
    assert reuse["note"].startswith("reuse (reuse)"), reuse["note"]
    assert data["same_logp_bits"]  # the setting changes no number
    assert len(system["processes"]) == len(reuse["processes"]) == 1 and system["step_faults"] >= 0
    saved = json.loads(out.read_text())
    assert saved["arms"] == data["arms"]
    md = (tmp_path / "hm.md").read_text()
    assert "| train.host_memory | system | reuse | reuse / system |" in md
    assert f"| minor page faults a step (median) | {system['step_faults']:,} | {reuse['step_faults']:,} | |" in md
