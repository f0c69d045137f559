"""rollout.weight_layout=output_major: the sampler's projection kernels stored with their
contracting axes last (quant.core.OutputMajor, rollout/weight_layout.py) give the same products,
log-probs and tokens as the model's own layout."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float_tol import logprob_tol

from sparserl_jax import kvcache as kv
from sparserl_jax import quant
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.quant.config import QuantConfig
from sparserl_jax.quant.core import OutputMajor, QWeight, dot, merge_leading_axes
from sparserl_jax.rollout import sampler as smp
from sparserl_jax.rollout.config import RolloutConfig
from sparserl_jax.rollout.sampling import SamplingConfig
from sparserl_jax.rollout.weight_layout import sampler_weights

# the model's projections (transformer._qkv / _finish_block, layers.swiglu_mlp, the untied head):
# spec, kernel shape, how many leading kernel axes the spec contracts
SPECS = [
    ("btd,dnh->btnh", (24, 3, 8), 1),
    ("btd,df->btf", (24, 40), 1),
    ("btf,fd->btd", (40, 24), 1),
    ("...d,dv->...v", (24, 100), 1),
]


@pytest.mark.parametrize("dtype,accumulate", [("float32", "output"), ("bfloat16", "float32"), ("bfloat16", "output")])
@pytest.mark.parametrize("spec,shape,n_in", SPECS)
def test_an_output_major_kernel_gives_the_kernels_product(spec, shape, n_in, dtype, accumulate):
    k1, k2 = jax.random.split(jax.random.key(0))
    w = jax.random.normal(k1, shape).astype(dtype)
    x = jax.random.normal(k2, (2, 5, shape[0])).astype(dtype)
    om = OutputMajor.of(w, n_in)
    assert om.shape == w.shape and om.values.shape == shape[n_in:] + shape[:n_in]
    np.testing.assert_array_equal(np.asarray(om.kernel()), np.asarray(w))
    # the head's logits come out float32 (logits_from_hidden), the projections in x's dtype
    kw = {"preferred_element_type": jnp.float32} if spec.startswith("...") else {"accumulate": accumulate}
    want_out = dot(spec, x, w, **kw)
    want = np.asarray(want_out, np.float64)
    got = np.asarray(dot(spec, x, om, **kw), np.float64)
    # the same float32-accumulated sums of n = shape[0] products in another order: each within
    # (n - 1) float32 unit roundoffs of the sum of |terms| of the exact one, so the two within
    # (n - 1) float32 epsilons of it; rounded to bfloat16 after, one bfloat16 epsilon more
    n = shape[0]
    terms = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64).reshape(n, -1))
    bound = (n - 1) * float(jnp.finfo(jnp.float32).eps) * terms.reshape(want.shape)
    if want_out.dtype != jnp.float32:
        bound = bound + float(jnp.finfo(want_out.dtype).eps) * np.abs(want)
    np.testing.assert_array_less(np.abs(got - want), bound + 1e-30)


def test_the_o_kernel_merges_its_two_contracting_axes():
    k1, k2 = jax.random.split(jax.random.key(1))
    o = jax.random.normal(k1, (3, 8, 24))  # [N, H, D]
    x = jax.random.normal(k2, (2, 5, 24))
    merged = merge_leading_axes(OutputMajor.of(o, 2), 2)
    assert isinstance(merged, OutputMajor) and merged.values.shape == (24, 24) and merged.n_in == 1
    want = dot("btf,fd->btd", x, merge_leading_axes(o, 2))
    np.testing.assert_allclose(np.asarray(dot("btf,fd->btd", x, merged)), np.asarray(want), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="OutputMajor"):
        merge_leading_axes(OutputMajor.of(o, 2), 1)


def test_a_kernel_contracted_on_other_axes_is_refused():
    w = OutputMajor.of(jnp.ones((24, 40)), 1)
    with pytest.raises(ValueError, match="contract exactly its first 1 axes"):
        dot("btf,df->btd", jnp.ones((2, 5, 40)), w)


def _untied_model():
    cfg = dataclasses.replace(ModelConfig.tiny("qwen2", vocab_size=64), tie_embeddings=False)
    params = tf.init_params(cfg, jax.random.key(0))
    return cfg, jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, params)


def test_the_sampler_weights_are_the_kernels_output_major_and_quantized_ones_stay():
    cfg, params = _untied_model()
    assert sampler_weights(params, "model") is params
    om = sampler_weights(params, "output_major")
    layer, layer_om = params["layers"][0], om["layers"][0]
    for name in ("q", "k", "v", "o", "gate", "up", "down"):
        assert isinstance(layer_om[name], OutputMajor), name
        np.testing.assert_array_equal(np.asarray(layer_om[name].kernel()), np.asarray(layer[name]))
    assert layer_om["o"].n_in == 2 and layer_om["q"].n_in == 1
    assert isinstance(om["lm_head"], OutputMajor) and not isinstance(om["embed"], OutputMajor)
    np.testing.assert_array_equal(np.asarray(layer_om["attn_norm"]), np.asarray(layer["attn_norm"]))
    quantized = quant.quantize_params(params, QuantConfig(format="int8"))
    q_om = sampler_weights(quantized, "output_major")
    assert isinstance(q_om["layers"][0]["q"], QWeight) and isinstance(q_om["lm_head"], OutputMajor)
    with pytest.raises(ValueError, match="rollout.weight_layout='rows'"):
        sampler_weights(params, "rows")
    with pytest.raises(ValueError, match="rollout.weight_layout"):
        RolloutConfig(weight_layout="rows")


@pytest.mark.parametrize("policy", ["none", "rkv"])
def test_the_sampler_decodes_the_same_rollout_from_either_layout(policy):
    """Prefill, every decode step and the untied head read the output-major kernels: the same
    tokens and, within the float32 noise of two programs, the same log-probs."""
    cfg, params = _untied_model()
    sampler_cfg = smp.SamplerConfig(
        max_new_tokens=12,
        sampling=SamplingConfig(temperature=1.0),
        kv=kv.KVConfig(policy=policy, budget=8, buffer=4, window=2),
    )
    tokens = jax.random.randint(jax.random.key(7), (3, 10), 1, cfg.vocab_size)
    lengths = jnp.array([6, 10, 8])
    tokens = jnp.where(jnp.arange(10)[None] < lengths[:, None], tokens, 0)
    outs = {
        layout: smp.generate_jit(sampler_weights(params, layout), cfg, tokens, lengths, jax.random.key(1), sampler_cfg)
        for layout in ("model", "output_major")
    }
    a, b = outs["model"], outs["output_major"]
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    tol = logprob_tol(cfg, params, keys=22)
    np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=tol)


def test_the_batch_source_hands_the_sampler_the_configured_layout(monkeypatch):
    """BatchSource.generate (what the trainer's rollouts go through) passes rollout.weight_layout
    on: output-major kernels reach the sampler, and the rollout is the model layout's."""
    from sparserl_jax.model import sharding as shd
    from sparserl_jax.rollout import layout
    from sparserl_jax.rollout.source import BatchSource

    class Prompts:  # the source's prompt iterator (unused by generate)
        def next_batch(self):
            return []

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    cfg, params = _untied_model()
    mesh = shd.make_mesh(shd.MeshConfig(), jax.devices()[:1])
    sampler_cfg = smp.SamplerConfig(max_new_tokens=6, kv=kv.KVConfig(policy="rkv", budget=8, buffer=4, window=2))
    tokens = np.asarray(jax.random.randint(jax.random.key(3), (4, 8), 1, cfg.vocab_size), np.int32)
    lengths = np.full((4,), 8, np.int32)
    seen, real = [], layout.RolloutMesh.generate

    def spy(self, p, *args, **kw):
        seen.append(type(p["layers"][0]["gate"]))
        return real(self, p, *args, **kw)

    monkeypatch.setattr(layout.RolloutMesh, "generate", spy)
    outs = {}
    for wl in ("model", "output_major"):
        rollout_cfg = RolloutConfig(prompts=2, samples=2, max_new_tokens=6, weight_layout=wl)
        source = BatchSource(
            rollout_cfg, sampler_cfg, QuantConfig(), Prompts(), cfg, mesh, max_prompt_len=8, pad_token_id=0
        )
        outs[wl] = source.generate(params, tokens, lengths, jax.random.key(1))
    assert seen == [type(params["layers"][0]["gate"]), OutputMajor]
    np.testing.assert_array_equal(np.asarray(outs["model"].tokens), np.asarray(outs["output_major"].tokens))
