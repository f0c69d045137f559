"""Adding a model family, walked through once as docs/layout.md ("How to extend") says, with a toy
"qknorm_bias" family: q/k/v biases (Qwen2's switch) and per-head q/k RMSNorm (Qwen3's) together,
under an HF architecture name of its own:

1. its file, sparserl_jax/model/families/qknorm_bias.py in the package (here in this test):
   `FAMILY = FAMILIES.register(Family(name=..., architecture=..., qkv_bias=..., qk_norm=...))`;
2. its module on the import line of sparserl_jax/model/families/__init__.py.

model.family=qknorm_bias then builds a tiny model with both switches (ModelConfig.tiny and a run's
config), its forward runs, and its Hugging Face config.json and safetensors round-trip: the HF
architecture name, the tensors each switch adds and the config read back equal what was written.
monkeypatch restores the registry after the test."""

import jax
import numpy as np
import pytest

from sparserl_jax.config import load_config
from sparserl_jax.model import hf, transformer
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.model.families import FAMILIES, Family
from sparserl_jax.model.hf_config import config_from_hf, config_to_hf

# ----------------------------------------------------------------------------- 1. the file

TOY = Family(
    name="qknorm_bias",
    architecture="QknormBiasForCausalLM",
    qkv_bias=True,
    qk_norm=True,
    config_extra=(("use_sliding_window", False),),
)


@pytest.fixture
def registered(monkeypatch):
    with pytest.raises(ValueError, match=r"model.family='qknorm_bias'"):
        ModelConfig.tiny("qknorm_bias")
    monkeypatch.setitem(FAMILIES, TOY.name, TOY)  # 2. what the import line's registration does
    yield
    monkeypatch.undo()


def test_registering_a_family_twice_is_refused():
    with pytest.raises(ValueError, match="model family 'qwen2' is registered twice"):
        FAMILIES.register(Family(name="qwen2", architecture="Qwen2ForCausalLM"))


def test_a_toy_family_builds_runs_and_round_trips(registered, tmp_path):
    cfg = ModelConfig.tiny("qknorm_bias")
    assert cfg.qkv_bias and cfg.qk_norm and cfg.rope_scaling is None
    params = transformer.init_params(cfg, jax.random.key(0))
    tokens = np.arange(12, dtype=np.int32).reshape(2, 6) % cfg.vocab_size
    logits = np.asarray(transformer.logits(params, cfg, tokens))
    assert logits.shape == (2, 6, cfg.vocab_size) and np.isfinite(logits).all()

    hf_cfg = config_to_hf(cfg)
    assert hf_cfg["architectures"] == ["QknormBiasForCausalLM"] and hf_cfg["use_sliding_window"] is False
    assert config_from_hf(hf_cfg) == cfg
    names = {t.name for t in hf.hf_tensors(cfg)}
    assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.q_norm.weight"} <= names
    hf.save_params(tmp_path, cfg, params)
    cfg_back, params_back = hf.load_params(tmp_path)
    assert cfg_back == cfg
    jax.tree.map(np.testing.assert_array_equal, params_back, params)


def test_a_run_names_the_toy_family(registered):
    cfg = load_config([], ["model.arch.family=qknorm_bias", "model.arch.qkv_bias=true", "model.arch.qk_norm=true"])
    assert cfg.model.arch.family == "qknorm_bias"
    with pytest.raises(ValueError, match=r"model.family='nope'"):
        ModelConfig.tiny("nope")
