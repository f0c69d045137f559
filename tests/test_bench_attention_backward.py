"""experiments/bench/bench_attention_backward.py at smoke size: both arms compiled and run side by
side; under model.attention_backward=compute the attention's products leave the float32 kind for
bfloat16 x bfloat16 -> float32 on a CPU with bfloat16 dot instructions (every product of the
program, the head's weight gradient's too; without the instructions XLA widens every product), and the
arms' log-probs agree (the same forward) and gradients to bfloat16 roundings."""

import json

from experiments.bench import bench_attention_backward as bab
from sparserl_jax.model.precision import cpu_bf16_dots


def test_smoke_runs_both_arms(tmp_path):
    out = tmp_path / "ab.json"
    data = bab.main(["--smoke", "--out", str(out)])
    auto, comp = data["arms"]["autodiff"], data["arms"]["compute"]
    f32, bf16 = "f32 x f32 -> f32", "bf16 x bf16 -> f32"
    assert comp["products"].get(f32, 0) <= auto["products"].get(f32, 0)
    if cpu_bf16_dots():  # elsewhere XLA:CPU widens every bfloat16 product to float32, both arms alike
        # the tiny model's 2 layers: autodiff's attention backward widens its products to float32;
        # compute keeps none (the LM head's weight gradient: quant.core._weight_gradient)
        assert comp["products"].get(f32, 0) == 0 and auto["products"].get(f32, 0) > 1
        assert comp["products"][bf16] > auto["products"][bf16]
        md = (tmp_path / "ab.md").read_text()
        assert f"| products {f32} (compiled) | {auto['products'][f32]} | 0 | |" in md
    # the forward is the same computation (one rounding of a float32 accumulation either way);
    # the backward rounds P and dS to bfloat16 (2^-8 relative each)
    assert data["logp_abs_diff"] <= 1e-2 and 0 < data["grad_rel_diff"] <= 2**-5
    saved = json.loads(out.read_text())
    assert saved["arms"] == data["arms"] and saved["provenance"]["portable_cpu"] == "host"
    assert "| model.attention_backward | autodiff | compute | compute / autodiff |" in (tmp_path / "ab.md").read_text()
