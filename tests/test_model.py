"""The pure-functional transformer: chunked log-probs, cached decoding, causality, memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float_tol import EPS32, logprob_tol

from sparserl_jax.kvcache import cache as kvc
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.model.layers import (
    rms_norm,
    rope_frequencies,
    rope_inv_freq,
    rope_tables,
    sequence_rope_tables,
    silu,
)

FAMILIES = ["qwen2", "llama", "qwen3"]


def _model(family, seed=0, **kw):
    cfg = ModelConfig.tiny(family, **kw)
    return cfg, tf.init_params(cfg, jax.random.key(seed))


@functools.partial(jax.jit, static_argnums=(1, 3))
def _full_logprobs(params, cfg, tokens, temperature=1.0):
    logp = jax.nn.log_softmax(tf.logits(params, cfg, tokens) / temperature, axis=-1)
    return jnp.take_along_axis(logp, jnp.roll(tokens, -1, 1)[..., None], axis=-1)[..., 0]


_token_logprobs = jax.jit(tf.token_logprobs, static_argnames=("cfg", "temperature", "chunk_tokens"))


@pytest.mark.parametrize("family,chunk", [("qwen2", 1), ("llama", 7), ("qwen3", 64)])
def test_chunked_logprobs_match_full_softmax(family, chunk):
    cfg, params = _model(family, seed=1)
    tokens = jax.random.randint(jax.random.key(2), (3, 11), 0, cfg.vocab_size)
    lp, ent = _token_logprobs(params, cfg, tokens, temperature=0.7, chunk_tokens=chunk)
    ref = _full_logprobs(params, cfg, tokens, 0.7)
    np.testing.assert_allclose(lp, ref, atol=1e-5)
    logp = jax.nn.log_softmax(jax.jit(tf.logits, static_argnums=1)(params, cfg, tokens) / 0.7, axis=-1)
    ent_ref = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    np.testing.assert_allclose(ent, ent_ref, atol=1e-4)


def test_chunked_logprobs_gradient_matches_full():
    cfg, params = _model("qwen2", seed=3)
    tokens = jax.random.randint(jax.random.key(4), (2, 9), 0, cfg.vocab_size)
    g_chunk = jax.jit(jax.grad(lambda p: tf.token_logprobs(p, cfg, tokens, chunk_tokens=4)[0].sum()))(params)
    g_full = jax.jit(jax.grad(lambda p: _full_logprobs(p, cfg, tokens).sum()))(params)
    for a, b in zip(jax.tree.leaves(g_chunk), jax.tree.leaves(g_full)):
        np.testing.assert_allclose(a, b, atol=2e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_decode_equals_teacher_forcing(family):
    cfg, params = _model(family, seed=5)
    B, T, n_steps = 3, 16, 6
    tokens = jax.random.randint(jax.random.key(6), (B, T), 0, cfg.vocab_size)
    lengths = jnp.array([4, 7, 9])
    ref = _full_logprobs(params, cfg, tokens)  # ref[b, t] scores tokens[b, t + 1]
    prefill = jax.jit(tf.prefill, static_argnums=1)
    cache = kvc.init_cache(B, cfg.n_layers, cfg.n_kv_heads, T, cfg.head_dim)
    logits, cache = prefill(params, cfg, tokens[:, :10], lengths, cache)
    step = jax.jit(lambda c, t: tf.decode_step(params, cfg, c, t))
    rows = jnp.arange(B)
    for j in range(n_steps):
        pos = lengths - 1 + j  # the logits in hand predict tokens[pos + 1]
        got = jax.nn.log_softmax(logits, -1)[rows, tokens[rows, pos + 1]]
        np.testing.assert_allclose(got, ref[rows, pos], atol=2e-5)
        logits, cache = step(cache, tokens[rows, pos + 1])
    np.testing.assert_array_equal(cache.fill, lengths + n_steps)


def test_jit_and_eager_agree():
    cfg, params = _model("qwen3", seed=7)
    tokens = jax.random.randint(jax.random.key(8), (2, 8), 0, cfg.vocab_size)
    eager = tf.token_logprobs(params, cfg, tokens)[0]
    jitted = jax.jit(lambda p, t: tf.token_logprobs(p, cfg, t)[0])(params, tokens)
    # two programs (op by op, fused) of one model: float noise (float_tol.logprob_tol, 4.8e-4;
    # measured <= 4.8e-7); a jit-only difference in the model moves log-probs by ~0.1
    np.testing.assert_allclose(eager, jitted, atol=logprob_tol(cfg, params, keys=8))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rope_tables_are_constants_of_the_learner_program(family):
    """The learner's gradient program computes no cos or sin (the positions' tables are constants
    of the program: sequence_rope_tables), and the tables are the angles' cos and sin (float64
    reference, float32 rounding), Llama-3's scaled frequencies included."""
    import re

    cfg, params = _model(family, seed=3)
    tokens = jax.random.randint(jax.random.key(4), (2, 12), 0, cfg.vocab_size)
    grad = jax.jit(jax.grad(lambda p, t: tf.forward(p, cfg, t).astype(jnp.float32).sum()))
    hlo = grad.lower(params, tokens).compile().as_text()
    assert not re.findall(r" (cosine|sine)\(", hlo)
    cos, sin = (np.asarray(t) for t in sequence_rope_tables(12, cfg))
    angles = np.arange(12)[None, :, None] * np.asarray(rope_inv_freq(cfg), np.float64)
    assert cos.shape == sin.shape == (1, 12, cfg.head_dim // 2)
    np.testing.assert_allclose(cos, np.cos(angles), atol=4 * np.finfo(np.float32).eps * max(1.0, angles.max()))
    np.testing.assert_allclose(sin, np.sin(angles), atol=4 * np.finfo(np.float32).eps * max(1.0, angles.max()))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_rope_frequencies_are_hf_bit_for_bit(family):
    """rope_frequencies (the learner's tables and the decode step's) compute HF's 1 / theta **
    (2i / H) operation for operation: torch's float32 bits, where a jitted program's rewrite of it
    is one rounding off on some frequencies."""
    torch = pytest.importorskip("torch")
    cfg = ModelConfig.tiny(family)
    H = cfg.head_dim
    hf = 1.0 / (cfg.rope_theta ** (torch.arange(0, H, 2, dtype=torch.int64).float() / H))
    np.testing.assert_array_equal(rope_frequencies(cfg), hf.numpy())


def test_bfloat16_silu_times_up_is_torch_s():
    """SwiGLU's silu(gate) * up on bfloat16 as HF's MLP computes it: the forward torch's bits (F.silu
    in float opmath rounded once, then the bfloat16 product), the gradients within one bfloat16 ulp
    of torch's (XLA may keep dy * up unrounded: xla_allow_excess_precision), on random inputs;
    jax.nn.silu on bfloat16 misses a third of the forward's bits and hundreds of ulps of the
    gradient (the checks that this test can fail)."""
    torch = pytest.importorskip("torch")
    gate, up, dy = (
        jax.random.normal(jax.random.key(i), (64, 96), jnp.float32).astype(jnp.bfloat16) * 3 for i in range(3)
    )
    tg, tu, tdy = (torch.tensor(np.asarray(a.astype(jnp.float32))).bfloat16() for a in (gate, up, dy))
    tg.requires_grad_(), tu.requires_grad_()
    want = torch.nn.functional.silu(tg) * tu
    want.backward(tdy)
    bf16_ulp = lambda t: np.spacing(np.abs(t)) * 2.0**16  # float32's spacing x 2^16 = bfloat16's

    def run(act):
        return jax.jit(lambda g, u, d: jax.vjp(lambda g, u: act(g) * u, g, u))(gate, up, dy)

    for act, fits in ((silu, True), (jax.nn.silu, False)):
        out, vjp = run(act)
        dg, du = (np.asarray(x.astype(jnp.float32)) for x in vjp(dy))
        same_bits = np.array_equal(np.asarray(out.astype(jnp.float32)), want.detach().float().numpy())
        ulps = max(
            np.max(np.abs(d - t.grad.float().numpy()) / bf16_ulp(t.grad.float().numpy()))
            for d, t in ((dg, tg), (du, tu))
        )
        assert (same_bits and ulps <= 1.0) == fits, (act, same_bits, ulps)


def test_float32_silu_is_jax_nn_silu():
    """A float32 model's SwiGLU is jax.nn.silu and its autodiff, bit for bit (float32 programs, the
    default experiment's fingerprint among them, unchanged by the bfloat16 form)."""
    x, dy = (jax.random.normal(jax.random.key(i), (32, 48)) * 3 for i in range(2))
    (out, vjp), (want, want_vjp) = jax.vjp(silu, x), jax.vjp(jax.nn.silu, x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(vjp(dy)[0]), np.asarray(want_vjp(dy)[0]))


def _plain_rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def test_bfloat16_rms_norm_sums_its_weight_gradient_in_float32():
    """rms_norm on bfloat16: the forward and the input gradient autodiff's bits (HF's weight *
    normed.to(bf16) and its backward), the weight's gradient the float32 sum over the tokens of the
    bfloat16 products, rounded once: within a float32 order of summation (n EPS32 of sum |g x|) and
    one bfloat16 rounding of float64's; a bfloat16 sum misses that (the check that this test can
    fail). Float32 is autodiff's, bit for bit."""
    x, g = (jax.random.normal(jax.random.key(i), (4, 96, 64)).astype(jnp.bfloat16) for i in range(2))
    w = (1 + 0.2 * jax.random.normal(jax.random.key(2), (64,))).astype(jnp.bfloat16)

    def run(norm, *args):
        out, vjp = jax.vjp(functools.partial(norm, eps=1e-5), *args[:2])
        return (out, *vjp(args[2]))

    got, want = (
        jax.jit(functools.partial(run, rms_norm))(x, w, g),
        jax.jit(functools.partial(run, _plain_rms_norm))(x, w, g),
    )
    for a, b in zip(got[:2], want[:2], strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    normed = _plain_rms_norm(x, jnp.ones_like(w), 1e-5)
    terms = np.asarray(g.astype(jnp.float32), np.float64) * np.asarray(normed.astype(jnp.float32), np.float64)
    n = x.shape[0] * x.shape[1]  # the tokens summed
    exact, size = terms.sum((0, 1)), np.abs(terms).sum((0, 1))
    tol = n * EPS32 * size + np.spacing(np.abs(exact).astype(np.float32)) * 2.0**16  # + one bf16 ulp

    def misses(dw):
        return float(np.max(np.abs(np.asarray(dw.astype(jnp.float32), np.float64) - exact) / tol))

    assert misses(got[2]) <= 1.0, misses(got[2])
    # the bound tells a bfloat16 sum apart (each product and each partial sum rounded, in order:
    # what a bfloat16 reduction may do; XLA's own order is its choice, so it is built here)
    products = (g * normed).reshape(n, -1)
    acc = products[0]
    for row in products[1:]:
        acc = (acc.astype(jnp.float32) + row.astype(jnp.float32)).astype(jnp.bfloat16)
    assert misses(acc) > 1.0, misses(acc)
    x32, g32, w32 = (a.astype(jnp.float32) for a in (x, g, w))
    for a, b in zip(run(rms_norm, x32, w32, g32), run(_plain_rms_norm, x32, w32, g32), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_causal_gradients():
    """The log-prob at position t must not depend on inputs after t."""
    cfg, params = _model("llama", seed=9)
    tokens = jax.random.randint(jax.random.key(10), (1, 10), 0, cfg.vocab_size)
    x = params["embed"][tokens]

    def logprob_at(x_emb, t):
        p = dict(params)
        h = x_emb
        rope = rope_tables(jnp.arange(10)[None], rope_inv_freq(cfg))
        for layer in p["layers"]:
            q, k, v = tf._qkv(layer, h, rope, cfg)
            h = tf._finish_block(layer, h, tf.causal_attention(q, k, v), cfg)
        return tf.logits_from_hidden(p, h)[0, t].sum()

    grad_at = jax.jit(jax.grad(logprob_at), static_argnums=1)
    for t in (0, 4, 8):
        g = grad_at(x, t)
        assert float(jnp.abs(g[0, t + 1 :]).max()) == 0.0
        assert float(jnp.abs(g[0, : t + 1]).max()) > 0.0


def test_bf16_params_give_float32_logits_close_to_float32():
    cfg32, params = _model("qwen2", seed=11)
    cfg16 = ModelConfig.tiny("qwen2", dtype="bfloat16")
    params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    tokens = jax.random.randint(jax.random.key(12), (2, 8), 0, cfg32.vocab_size)
    logits = jax.jit(tf.logits, static_argnums=1)
    l32 = logits(params, cfg32, tokens)
    l16 = logits(params16, cfg16, tokens)
    assert l16.dtype == jnp.float32
    assert float(jnp.abs(l16 - l32).max()) < 0.05 * float(jnp.abs(l32).max()) + 0.05


def test_chunked_logprob_memory_does_not_scale_with_vocab_times_length():
    """Compiled temp memory of the log-prob head (forward + backward) for a 152k vocabulary:
    constant in T with chunking, while the plain head holds [T, V] float32 logits."""
    V, D = 152064, 64

    def temp_bytes(T, chunked):
        def loss(h, w, targets):
            if chunked:
                return tf.chunked_logprobs(h, w, targets, chunk_tokens=256)[0].sum()
            logits = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)
            logp = jax.nn.log_softmax(logits, -1)
            return jnp.take_along_axis(logp, targets[..., None], -1).sum()

        shapes = (
            jax.ShapeDtypeStruct((1, T, D), jnp.float32),
            jax.ShapeDtypeStruct((D, V), jnp.float32),
            jax.ShapeDtypeStruct((1, T), jnp.int32),
        )
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*shapes).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    logits_bytes = 4096 * V * 4
    chunked_2k, chunked_4k = temp_bytes(2048, True), temp_bytes(4096, True)
    assert chunked_4k < 0.2 * logits_bytes, (chunked_4k, logits_bytes)
    assert abs(chunked_4k - chunked_2k) < 0.01 * logits_bytes, (chunked_2k, chunked_4k)
    assert temp_bytes(4096, False) >= logits_bytes  # the contrast: the naive head holds [T, V]
