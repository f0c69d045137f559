"""A tied LM head is read in the embedding's own [V, D] layout (transformer.head, chunked_logprobs'
w_layout="vd"): the same log-probs and gradients as the transposed [D, V] copy the learner used to
contract, and no [V, D] -> [D, V] transpose left in the learner's program."""

from __future__ import annotations

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from sparserl_jax.model import transformer
from sparserl_jax.model.config import ModelConfig

B, T, D, V = 2, 32, 32, 1000


def _inputs(dtype, seed):
    k = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(k[0], (B, T, D)).astype(dtype)
    embed = (0.3 * jax.random.normal(k[1], (V, D))).astype(dtype)
    return h, embed, jax.random.randint(k[2], (B, T), 0, V)


def _loss(h, w, t, layout, mode):
    logp, entropy = transformer.chunked_logprobs(h, w, t, w_layout=layout, chunk_tokens=16, head_backward=mode)
    return (logp * jnp.linspace(-1.0, 1.0, T)).sum() + 0.1 * entropy.sum()


def _value_and_grads(h, w, t, layout, mode):
    fn = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1)), static_argnums=(3, 4))
    return fn(h, w, t, layout, mode)


@pytest.mark.parametrize("dtype,mode", [("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "compute")])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_embedding_layout_gives_the_transposed_copys_log_probs_and_gradients(dtype, mode, seed):
    h, embed, t = _inputs(jnp.dtype(dtype), seed)
    lp_vd = transformer.chunked_logprobs(h, embed, t, w_layout="vd", chunk_tokens=16)[0]
    lp_dv = transformer.chunked_logprobs(h, embed.T, t, chunk_tokens=16)[0]
    (loss_vd, (dh_vd, de_vd)) = _value_and_grads(h, embed, t, "vd", mode)
    (loss_dv, (dh_dv, dw_dv)) = _value_and_grads(h, embed.T, t, "dv", mode)
    assert de_vd.shape == (V, D) and de_vd.dtype == embed.dtype
    # the same products in another operand order: float32 sums of at most V = 1000 terms in another
    # order differ by a few hundred float32 units of the largest term; bfloat16 results, rounded
    # from those float32 sums, by at most one bfloat16 unit
    eps = float(jnp.finfo(jnp.dtype(dtype)).eps)
    rtol = 2 * eps if dtype == "bfloat16" else 1e-4
    np.testing.assert_allclose(np.asarray(lp_vd, np.float64), np.asarray(lp_dv, np.float64), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(loss_vd), float(loss_dv), rtol=1e-5)
    for got, want in ((dh_vd, dh_dv), (de_vd, dw_dv.T)):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


def test_a_bad_layout_names_itself():
    h, embed, t = _inputs(jnp.float32, 0)
    with pytest.raises(ValueError, match="w_layout='dV'"):
        transformer.chunked_logprobs(h, embed, t, w_layout="dV")


@pytest.mark.parametrize("tied", [True, False])
def test_the_learner_contracts_the_head_in_its_own_layout(tied):
    """A tied head is contracted as the embedding, an untied one as lm_head; a tied model's
    gradient program transposes no [V, D] weight to [D, V] (or back), its gradient in the
    embedding's layout. (An untied head's weight gradient keeps jax's own transpose of the
    [V, D] product to lm_head's [D, V].)"""
    m = ModelConfig(vocab_size=V, d_model=D, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
    m = dataclasses.replace(m, tie_embeddings=tied)
    params = transformer.init_params(m, jax.random.key(0))
    w, layout = transformer.head(params)
    assert layout == ("vd" if tied else "dv") and w is (params["embed"] if tied else params["lm_head"])
    tokens = jax.random.randint(jax.random.key(1), (B, 16), 0, V)
    loss = lambda p: transformer.token_logprobs(p, m, tokens)[0].sum()  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params)

    def transposes(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "transpose":
                yield tuple(eqn.invars[0].aval.shape)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from transposes(sub)

    head_shapes = {(V, D), (D, V)}
    if tied:
        assert [s for s in transposes(jaxpr.jaxpr) if s in head_shapes] == []
    grads = jax.grad(loss)(params)
    name = "embed" if tied else "lm_head"
    assert grads[name].shape == params[name].shape and float(jnp.abs(grads[name]).sum()) > 0
