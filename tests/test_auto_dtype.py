"""model.dtype=auto: bfloat16 where the host has bfloat16 matrix instructions, float32 elsewhere
(model/precision.py auto_dtype), resolved once by a run and written into its config."""

from __future__ import annotations

import os

import pytest

from sparserl_jax import components
from sparserl_jax.config import ModelSource, load_config
from sparserl_jax.model import precision
from sparserl_jax.train import Trainer

SMOKE = os.path.join(os.path.dirname(__file__), "..", "experiments", "configs", "smoke.yaml")


def test_auto_is_bfloat16_on_accelerators_and_on_cpus_with_bfloat16_dots(monkeypatch):
    assert precision.auto_dtype("gpu")[0] == precision.auto_dtype("tpu")[0] == "bfloat16"
    monkeypatch.setattr(precision, "cpu_bf16_dots", lambda: True)
    assert precision.auto_dtype("cpu")[0] == "bfloat16"
    monkeypatch.setattr(precision, "cpu_bf16_dots", lambda: False)
    dtype, why = precision.auto_dtype("cpu")
    assert dtype == "float32" and "without bfloat16 dot instructions" in why


@pytest.mark.parametrize(
    "flags,xla_flags,expected",
    [
        ("fpu sse avx2 avx512f avx512_bf16", "", True),
        ("fpu sse avx2 amx_bf16 amx_tile", "", True),
        ("fpu sse avx2 avx512f", "", False),
        ("fpu avx512_bf16 amx_bf16", "--xla_cpu_max_isa=AVX2", False),  # the portable CPU numerics
        ("fpu avx512_bf16", "--xla_cpu_max_isa=AVX512", True),
    ],
)
def test_the_cpu_flags_and_an_isa_cap_decide(tmp_path, monkeypatch, flags, xla_flags, expected):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    monkeypatch.setenv("XLA_FLAGS", xla_flags)
    assert precision.cpu_bf16_dots(str(info)) is expected
    assert precision.cpu_bf16_dots(str(tmp_path / "absent")) is False


def test_a_run_writes_the_dtype_it_chose(tmp_path):
    with pytest.raises(ValueError, match="model.dtype"):
        ModelSource(dtype="float16")
    cfg = load_config([SMOKE], ["model.dtype=auto", f"train.out_dir={tmp_path}"])
    assert cfg.model.dtype == "auto" and cfg.model.arch_settings["dtype"] == precision.auto_dtype()[0]
    said = []
    resolved = components.resolve_dtype(cfg, said.append)
    assert resolved.model.dtype == precision.auto_dtype()[0] and said == [
        f"model.dtype=auto: {precision.auto_dtype()[0]} ({precision.auto_dtype()[1]})"
    ]
    assert components.resolve_dtype(resolved) is resolved
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    assert trainer.cfg.model.dtype == trainer.model_cfg.dtype == precision.auto_dtype()[0]
