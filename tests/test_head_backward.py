"""model.head_backward="compute": the learner's LM-head gradients from the loss's float32
cotangent rounded to bfloat16 (quant.core.narrow_cotangent, Megatron's bfloat16 output layer),
against the float32 cotangent's (the default) and a float64 reference."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparserl_jax.config import ModelSource
from sparserl_jax.model import transformer

B, T, D, V = 2, 32, 32, 1000


def _inputs(dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(k[0], (B, T, D)).astype(dtype)
    w = (0.3 * jax.random.normal(k[1], (D, V))).astype(dtype)
    return h, w, jax.random.randint(k[2], (B, T), 0, V)


def _loss(h, w, t, mode):
    logp, entropy = transformer.chunked_logprobs(h, w, t, chunk_tokens=16, head_backward=mode)
    return (logp * jnp.linspace(-1.0, 1.0, T)).sum() + 0.1 * entropy.sum()


def _grads(h, w, t, mode):
    return jax.jit(jax.grad(_loss, argnums=(0, 1)), static_argnums=3)(h, w, t, mode)


def _reference64(h, w, t):
    """The same loss's gradients in float64 NumPy from the bfloat16 inputs."""
    h64, w64 = np.asarray(h, np.float64).reshape(B * T, D), np.asarray(w, np.float64)
    z = h64 @ w64
    z -= z.max(-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)
    c = np.tile(np.linspace(-1.0, 1.0, T), B)
    onehot = np.eye(V)[np.asarray(t).ravel()]
    logz = np.log(np.exp(z).sum(-1, keepdims=True))
    # d/dz [c (z_t - lse)] = c (onehot - p); d/dz [0.1 H], H = lse - sum p z: -0.1 p (z - lse - H)
    H = -(p * (z - logz)).sum(-1, keepdims=True)
    dz = c[:, None] * (onehot - p) - 0.1 * p * ((z - logz) + H)
    return (dz @ w64.T).reshape(B, T, D), h64.T @ dz


@pytest.mark.parametrize("seed", [0, 1])
def test_the_rounded_cotangent_keeps_the_values_and_the_gradients_within_bfloat16(seed):
    h, w, t = _inputs(jnp.bfloat16, seed)
    fwd = {
        m: np.asarray(transformer.chunked_logprobs(h, w, t, chunk_tokens=16, head_backward=m)[0])
        for m in ("float32", "compute")
    }
    np.testing.assert_array_equal(fwd["float32"], fwd["compute"])  # the forward is the same product
    ref = _reference64(h, w, t)
    for mode in ("float32", "compute"):
        for g, r in zip(_grads(h, w, t, mode), ref, strict=True):
            g, r = np.asarray(g, np.float64).ravel(), r.ravel()
            cos = g @ r / (np.linalg.norm(g) * np.linalg.norm(r))
            # the gradients come back in bfloat16 (8 bits of mantissa) either way; the rounded
            # cotangent adds one more such rounding per logit
            assert cos > 0.999 and abs(np.linalg.norm(g) / np.linalg.norm(r) - 1) < 0.01, (mode, cos)


def test_bfloat16_head_backward_products_and_float32_unchanged():
    h, w, t = _inputs(jnp.bfloat16)
    pattern = r"stablehlo.dot_general.*?: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)"
    for mode, widened in (("float32", 2), ("compute", 0)):
        text = jax.jit(jax.grad(_loss, argnums=(0, 1)), static_argnums=3).lower(h, w, t, mode).as_text()
        dots = re.findall(pattern, text)
        assert len(dots) == 3, dots
        assert sum(a.endswith("xf32>") and b.endswith("xf32>") for a, b, _ in dots) == widened, (mode, dots)
        assert all(out.endswith("xf32>") for *_, out in dots)
    h, w, t = _inputs(jnp.float32)
    a, b = _grads(h, w, t, "float32"), _grads(h, w, t, "compute")
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("layout", ["dv", "vd"])
def test_the_compiled_head_backward_runs_every_product_in_bfloat16(layout):
    """What XLA:CPU compiles (not only what it receives): under "compute" no product of the head's
    gradient program is widened to float32, the weight gradient's included (one contracting axis
    leading both of its operands made XLA:CPU widen it: quant.core._weight_gradient splits it)."""
    from experiments.lib import xla_profile

    h, w, t = _inputs(jnp.bfloat16)
    if layout == "vd":
        w = w.T
    loss = lambda h, w: transformer.chunked_logprobs(
        h, w, t, w_layout=layout, chunk_tokens=16, head_backward="compute"
    )[0].sum()
    module = xla_profile.Module(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, w).compile().as_text())
    dots = [d for i in module.instrs.values() for d in i.dots]
    assert len(dots) >= 3 and not [d for d in dots if d.upcast or not d.lhs.startswith("bf16")], dots


def test_the_weight_gradients_split_adds_no_collective_to_a_row_sharded_program():
    """Over 8 (fake) devices holding the rows, the head's split weight gradient compiles to the plain
    product's collectives (one all-reduce): the split keeps each device's rows its own."""
    code = """
import re, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from sparserl_jax.quant import core
rows = NamedSharding(Mesh(jax.devices(), ("data",)), P("data"))
x = jax.ShapeDtypeStruct((64, 16), jnp.bfloat16, sharding=rows)
g = jax.ShapeDtypeStruct((64, 40), jnp.bfloat16, sharding=rows)
plain = lambda x, g: jnp.einsum("cd,cv->vd", x, g, preferred_element_type=jnp.float32)
split = lambda x, g: core._weight_gradient("cd", "vd", "cv", x, g)
for f in (plain, split):
    t = jax.jit(f).lower(x, g).compile().as_text()
    print(len(re.findall(r"= \\S+ (all-reduce|all-gather|all-to-all|collective-permute)\\(", t)))
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "1"], out.stdout


def test_a_bad_setting_names_itself():
    with pytest.raises(ValueError, match="model.head_backward"):
        ModelSource(head_backward="bfloat16")
    assert ModelSource(dtype="bfloat16", head_backward="compute").arch_settings["head_backward"] == "compute"


def test_the_models_log_probs_take_the_setting():
    """token_logprobs passes model.head_backward on: under "compute" no product over the
    vocabulary has two float32 operands in the gradient."""
    import dataclasses

    from sparserl_jax.model.config import ModelConfig

    m = ModelConfig(vocab_size=V, d_model=D, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
    m = dataclasses.replace(m, dtype="bfloat16")
    params = transformer.init_params(m, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (B, 16), 0, V)
    pattern = r"stablehlo.dot_general.*?: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)"
    widened = {}
    for mode in ("float32", "compute"):
        cfg = dataclasses.replace(m, head_backward=mode)
        loss = lambda p, cfg=cfg: transformer.token_logprobs(p, cfg, tokens)[0].sum()  # noqa: E731
        text = jax.jit(jax.grad(loss)).lower(params).as_text()
        over_vocab = [d for d in re.findall(pattern, text) if any(f"<{V}x" in x or f"x{V}x" in x for x in d)]
        widened[mode] = [d for d in over_vocab if d[0].endswith("xf32>") and d[1].endswith("xf32>")]
    assert len(widened["float32"]) == 2 and widened["compute"] == [], widened
