"""experiments/bench/bench_precision.py: its report from a made-up measurement (the default tier), and
at smoke size on a tiny checkpoint, both arms trained with no compile after the warm-up
(extended)."""

import json

import pytest

from experiments.bench import bench_precision as bp


def _arm(dtype: str, scale: float) -> dict:
    rows = []
    for it in range(3):
        phases = {f"{p}_s": scale * (i + 1) for i, p in enumerate(bp.PHASES)}
        rows.append(
            {
                "iteration": it,
                "warmup": it == 0,
                "iteration_s": 100.0 if it == 0 else scale * 15,
                "cpu_s": scale * 14,
                **phases,
                "response_tokens": 2048,
                "kl_k3": 1e-3 * scale,
                "abs_dlogp_max": 0.5,
                "reward": 0.25,
                "compiles": 40 if it == 0 else 0,
            }
        )
    return {"dtype": dtype, "iterations": rows}


def test_report_from_a_measurement():
    arms = {"float32": _arm("float32", 2.0), "bfloat16": _arm("bfloat16", 1.0)}
    summary = {d: bp.summarise(a) for d, a in arms.items()}
    assert summary["float32"]["iteration_s"] == 30.0  # the warm-up iteration is left out
    assert summary["float32"]["compiles_in_timed"] == 0 and summary["bfloat16"]["rollout_s"] == 1.0
    data = {
        "command": "taskset -c 1 python experiments/bench/bench_precision.py",
        "provenance": {
            "commit": "abc",
            "uncommitted_changes": False,
            "portable_cpu": "host",
            "cpu": "AMD EPYC (family 25 model 1, no AVX-512)",
            "jax": "0.10.2",
            "cores": 1,
            "wall_s": 600.0,
        },
        "cpu_flags": {"avx512_bf16": False, "amx_bf16": False, "avx2": True},
        "workload": "4 prompts x 4 samples",
        "warmup": 1,
        "iterations": 2,
        "dot_rows": 64,
        "arms": arms,
        "summary": summary,
        "dots": {"MLP [576 x 1536]": {"float32": 90.0, "bfloat16": 45.0}},
    }
    md = bp.to_markdown(data)
    assert "| iteration | 30.00 | 15.00 | 0.50x |" in md
    assert "| MLP [576 x 1536] | 90.0 | 45.0 | 0.50x |" in md
    assert "avx512_bf16 no" in md and "CPU AMD EPYC (family 25 model 1, no AVX-512)" in md
    assert "portable CPU settings off (a benchmark of this CPU: its own numerics)" in md


@pytest.mark.extended
def test_smoke(tmp_path):
    pytest.importorskip("transformers")
    from hf_fixtures import make_tiny_hf_checkpoint

    from sparserl_jax.tokenizer import CharTokenizer

    ckpt = make_tiny_hf_checkpoint("llama", tmp_path / "ckpt")
    CharTokenizer().save(ckpt)
    out = tmp_path / "bench.json"
    data = bp.main(["--smoke", "--checkpoint", str(ckpt), "--out", str(out)])
    for dtype in bp.ARMS:
        s = data["summary"][dtype]
        assert s["compiles_in_timed"] == 0 and s["iteration_s"] > 0 and s["response_tokens"] > 0
    assert json.loads(out.read_text())["provenance"]["cores"] >= 1
    assert "| update |" in (tmp_path / "bench.md").read_text()
