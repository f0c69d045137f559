"""sparserl_jax/model/attention.py: the full-sequence attention implementations behind model.attention.

blockwise (FlashAttention in jnp, custom VJP) against an independent float64 NumPy attention and
its hand-written gradient, in float32 and bfloat16, with GQA, a length that is no multiple of the
block and right padding of ragged lengths; its compiled forward and backward read for [T, T]
buffers; "auto" per platform; splash lowered for a TPU (the Mosaic custom call) and refused by
name elsewhere, and run in Pallas interpret mode (marked slow: started first). The 8-device
layouts are in tests/attention_mesh_worker.py.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_mesh_worker import mosaic_calls, mosaic_operands
from float_tol import EPS32, U16
from test_dot_accumulation import _dot_types
from test_sharding import run_on_fake_devices

from sparserl_jax.config import ModelSource
from sparserl_jax.model import attention as attn
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ATTENTION, ATTENTION_BACKWARDS, ModelConfig, check_attention

B, N, K, H = 2, 4, 2, 16  # GQA: G = 2 query heads per KV head
LENGTHS = (150, 97)  # ragged rows, right-padded to T = 150; 150 = 4 blocks of 32 + 22
BLOCK = 32


def _inputs(dtype, T: int = LENGTHS[0], lengths=LENGTHS, seed: int = 0):
    """q, k, v with real rows from one draw and padded positions from another, 3x larger (the
    real rows must not depend on them), and the loss weights w (0 on padded rows)."""
    ks = jax.random.split(jax.random.key(seed), 7)
    real = np.arange(T)[None, :] < np.asarray(lengths)[:, None]  # [B, T]

    def draw(i, heads):
        x = jax.random.normal(ks[i], (len(lengths), T, heads, H))
        pad = 3.0 * jax.random.normal(ks[i + 3], x.shape)
        return jnp.where(real[:, :, None, None], x, pad).astype(dtype)

    w = jax.random.normal(ks[6], (len(lengths), T, N, H)) * real[:, :, None, None]
    return draw(0, N), draw(1, K), draw(2, K), w, real


def _reference(q, k, v, w, lengths, mask=None):
    """Float64 causal GQA attention of each row over its own real tokens only (and the keys a
    boolean `mask` [B, N, T, T] lets each query head see, when given), the gradient of
    sum(w * o) by hand (dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dP P)), dQ = dS K / sqrt(H),
    dK = dS^T Q / sqrt(H)), and each result's magnitude: the same sums over absolute values."""
    q, k, v, w = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v, w))
    out = {name: np.zeros_like(x) for name, x in (("o", q), ("dq", q), ("dk", k), ("dv", v))}
    mag = {name: np.zeros_like(x) for name, x in out.items()}
    scale = 1.0 / math.sqrt(H)
    for b, L in enumerate(lengths):
        qb = q[b, :L].reshape(L, K, N // K, H)  # query head n reads KV head n // G
        kb, vb, dob = k[b, :L], v[b, :L], w[b, :L].reshape(L, K, N // K, H)
        s = np.einsum("qkgh,ckh->kgqc", qb, kb) * scale
        causal = np.tril(np.ones((L, L), bool))
        if mask is not None:
            causal = causal & np.asarray(mask)[b, :, :L, :L].reshape(K, N // K, L, L)
        s = np.where(causal, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        dp = np.einsum("qkgh,ckh->kgqc", dob, vb)
        ds = p * (dp - (dp * p).sum(-1, keepdims=True))
        ob = np.einsum("kgqc,ckh->qkgh", p, vb)
        # dS's terms: dO . V (H products) and rowsum(dO o) = rowsum(dP P) (H products with o)
        abs_ds = p * (
            np.einsum("qkgh,ckh->kgqc", np.abs(dob), np.abs(vb)) + np.einsum("qkgh->kgq", np.abs(dob * ob))[..., None]
        )
        out["o"][b, :L] = ob.reshape(L, N, H)
        mag["o"][b, :L] = np.einsum("kgqc,ckh->qkgh", p, np.abs(vb)).reshape(L, N, H)
        out["dv"][b, :L] = np.einsum("kgqc,qkgh->ckh", p, dob)
        mag["dv"][b, :L] = np.einsum("kgqc,qkgh->ckh", p, np.abs(dob))
        out["dq"][b, :L] = (np.einsum("kgqc,ckh->qkgh", ds, kb) * scale).reshape(L, N, H)
        mag["dq"][b, :L] = (np.einsum("kgqc,ckh->qkgh", abs_ds, np.abs(kb)) * scale).reshape(L, N, H)
        out["dk"][b, :L] = np.einsum("kgqc,qkgh->ckh", ds, qb) * scale
        mag["dk"][b, :L] = np.einsum("kgqc,qkgh->ckh", abs_ds, np.abs(qb)) * scale
    return out, mag


def _tolerance(dtype, T: int, magnitude):
    """How far a float32 attention may be from the float64 one, per element, relative to the sum
    of its terms' magnitudes (`magnitude`): the scores are H-term sums and the softmax and the
    products with V, dO, K or Q T-term sums (float_tol: n EPS32 each; an exp or a division one
    rounding); a score's error e moves a probability by e relative, the |scores| here being below
    3 sqrt(H) (unit normals / sqrt(H)). bfloat16 inputs add the roundings of the probabilities,
    of dS and of the result to bfloat16 (U16 each) - the dominant term."""
    n = 3 * (H * 3 * math.sqrt(H) + 2 * T + 4)
    per_term = n * EPS32 + (3 * U16 if jnp.dtype(dtype) == jnp.bfloat16 else 0.0)
    return per_term * magnitude + 1e-30


def _loss(fn, w):
    return lambda q, k, v: jnp.sum(jnp.where(w != 0, fn(q, k, v).astype(jnp.float32) * w, 0.0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blockwise_matches_a_float64_attention_forward_and_gradient(dtype):
    """Forward and d(sum w * o)/d(q, k, v) of blockwise (5 blocks of 32 over 150 tokens, GQA 4 over
    2) equal the float64 reference on every real row, and so does the materialised xla path at the
    same tolerance, with either backward (model.attention_backward); the padded rows' gradients are exactly 0 (their weight is 0 and no real query
    sees a padded key)."""
    q, k, v, w, real = _inputs(dtype)
    ref, mag = _reference(q, k, v, w, LENGTHS)
    fns = {
        "blockwise": lambda q, k, v: attn.blockwise_attention(q, k, v, BLOCK, materialised_up_to=0),
        "xla": attn.xla_attention,
        "xla, backward compute": lambda q, k, v: attn.xla_attention(q, k, v, backward="compute"),
    }
    for name, fn in fns.items():
        o = jax.jit(fn)(q, k, v)
        assert o.dtype == jnp.dtype(dtype)
        grads = jax.jit(jax.grad(_loss(fn, w), argnums=(0, 1, 2)))(q, k, v)
        for what, got in zip(("o", "dq", "dk", "dv"), (o, *grads)):
            got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
            err = np.abs(got - ref[what])
            tol = _tolerance(dtype, LENGTHS[0], mag[what])
            assert (err[real] <= tol[real]).all(), (name, what, float((err - tol)[real].max()))
            if what != "o":  # padded positions: no weight, and no real query sees their keys
                assert not np.any(got[~real]), (name, what, "a padded position has a gradient")


def test_the_compute_backward_replays_a_mask_and_keeps_every_product_in_bfloat16():
    """model.attention_backward=compute: with a per-head mask (the sampler's replay) its forward
    and gradients equal the masked float64 reference on every real row within the float32 bound,
    as jax's materialised path's do; in
    bfloat16 every product of the gradient program XLA receives takes bfloat16 operands with a
    float32 result (the autodiff path's backward has float32 operands: its float32 cotangents),
    blockwise's short rows alike."""
    T, lengths = 24, (24, 17)
    q, k, v, w, real = _inputs("float32", T=T, lengths=lengths)
    mask = jax.random.bernoulli(jax.random.key(3), 0.7, (2, N, T, T)) | jnp.eye(T, dtype=bool)
    ref, mag = _reference(q, k, v, w, lengths, mask)
    for backward in ATTENTION_BACKWARDS:
        fn = lambda q, k, v, b=backward: attn.xla_attention(q, k, v, mask, backward=b)  # noqa: E731
        got = [jax.jit(fn)(q, k, v), *jax.grad(_loss(fn, w), argnums=(0, 1, 2))(q, k, v)]
        for what, g in zip(("o", "dq", "dk", "dv"), got):
            err = np.abs(np.asarray(g, np.float64) - ref[what])
            tol = _tolerance("float32", T, mag[what])
            assert (err[real] <= tol[real]).all(), (backward, what, float((err - tol)[real].max()))
    unmasked, _ = _reference(q, k, v, w, lengths)
    assert np.abs(unmasked["o"] - ref["o"])[real].max() > 1e-3  # the mask acts

    qb, kb, vb, wb = (x.astype(jnp.bfloat16) for x in (q, k, v, w))
    for backward in ("compute", "autodiff"):
        for fn in (
            lambda q, k, v, backward=backward: attn.xla_attention(q, k, v, backward=backward),
            lambda q, k, v, backward=backward: attn.causal_attention(
                q, k, v, implementation="blockwise", backward=backward
            ),
        ):
            dots = _dot_types(jax.jit(jax.grad(_loss(fn, wb), argnums=(0, 1, 2))).lower(qb, kb, vb).as_text())
            if backward == "compute":  # QK^T and PV forward; dV, dP, dQ, dK
                assert dots == ["bf16 bf16 f32"] * 6, dots
            else:
                assert any(d.startswith("f32") for d in dots), dots


def test_blockwise_of_a_short_row_is_the_materialised_path_bit_for_bit():
    """Rows of at most MATERIALISED_UP_TO tokens (512: every committed CPU result's) take the xla
    path itself under blockwise, whatever the block."""
    assert attn.MATERIALISED_UP_TO == 512 and attn.BLOCK == 128
    q, k, v, w, _ = _inputs("float32", T=40, lengths=(40, 33))
    want = attn.xla_attention(q, k, v)
    np.testing.assert_array_equal(attn.blockwise_attention(q, k, v, 16, materialised_up_to=40), want)
    np.testing.assert_array_equal(attn.causal_attention(q, k, v, implementation="blockwise"), want)


def _array_shapes(hlo_text: str) -> list[tuple[int, ...]]:
    """Every array shape of a compiled HLO module's text (f32[2,4,128,16]{...} -> (2, 4, 128, 16))."""
    return [
        tuple(int(d) for d in dims.split(",") if d)
        for dims in re.findall(r"\b(?:f32|bf16|f16|s32|u32|pred|s8|u8)\[([\d,]*)\]", hlo_text)
    ]


def test_blockwise_forward_and_backward_hold_no_TxT_buffer():
    """At T = 2048 with one row, 2 heads of 8 (T * T = 4.2M elements, q 32K): no array of the
    compiled forward-and-backward program is even a sixteenth of [T, T] (one block's scores are
    2 * 128 * 128 = 32K), and XLA's temporaries stay below one float32 [T, T]; the materialised
    path, compiled the same way, holds [.., T, T] arrays (so the reader would see one)."""
    T, blk = 2048, 128
    q = jax.ShapeDtypeStruct((1, T, 2, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, T, 1, 8), jnp.float32)

    def compiled(fn):
        loss = lambda q, k, v: jnp.sum(fn(q, k, v) ** 2)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()

    blockwise = compiled(lambda q, k, v: attn.blockwise_attention(q, k, v, blk, materialised_up_to=0))
    largest = max(math.prod(s) for s in _array_shapes(blockwise.as_text()))
    assert largest < T * T // 16, largest
    memory = blockwise.memory_analysis()
    if memory is not None:
        assert memory.temp_size_in_bytes < T * T * 4, memory.temp_size_in_bytes
    materialised = _array_shapes(compiled(attn.xla_attention).as_text())
    assert any(s[-2:] == (T, T) for s in materialised)


def test_auto_resolves_per_platform_and_runs_blockwise_here():
    assert attn.auto_implementation("cpu", jnp.float32) == "blockwise"
    assert attn.auto_implementation("cpu", jnp.bfloat16) == "blockwise"
    assert attn.auto_implementation("tpu", jnp.bfloat16) == "splash"
    assert attn.auto_implementation("tpu", jnp.float32) == "splash"
    assert attn.auto_implementation("gpu", jnp.bfloat16) == "cudnn"
    assert attn.auto_implementation("cuda", jnp.bfloat16) == "cudnn"
    assert attn.auto_implementation("gpu", jnp.float32) == "xla"
    assert jax.default_backend() == "cpu"
    q, k, v, _, _ = _inputs("float32", T=600, lengths=(600, 400))  # past MATERIALISED_UP_TO
    auto = jax.jit(lambda q, k, v: attn.causal_attention(q, k, v))(q, k, v)
    blockwise = jax.jit(lambda q, k, v: attn.blockwise_attention(q, k, v))(q, k, v)
    np.testing.assert_array_equal(auto, blockwise)  # one program: exact
    # an explicit platform resolves there instead: auto for a TPU is splash (lowered, not run)
    lowered = jax.jit(lambda q, k, v: attn.causal_attention(q, k, v, platform="tpu")).trace(q, k, v)
    assert "tpu_custom_call" in lowered.lower(lowering_platforms=("tpu",)).as_text()


def test_settings_and_their_errors_name_the_setting():
    assert ATTENTION == ("auto", "xla", "cudnn", "blockwise", "splash")
    assert ModelConfig().attention == "auto"
    for a in ATTENTION:
        if a != "cudnn":
            check_attention(a, "float32")  # splash's platform is checked where it is lowered
    with pytest.raises(ValueError, match=r"model.attention=cudnn needs model.dtype=bfloat16"):
        check_attention("cudnn", "float32")
    with pytest.raises(ValueError, match=r"model.attention='flash': accepted values are \('auto'"):
        ModelConfig(attention="flash")
    q = jnp.zeros((1, 8, 2, 8))
    with pytest.raises(ValueError, match=r"model.attention='flash': accepted values"):
        attn.causal_attention(q, q[:, :, :1], q[:, :, :1], implementation="flash")
    assert ATTENTION_BACKWARDS == ("autodiff", "compute") and ModelConfig().attention_backward == "autodiff"
    with pytest.raises(ValueError, match=r"model.attention_backward='bf16': accepted values are \('autodiff'"):
        ModelConfig(attention_backward="bf16")
    with pytest.raises(ValueError, match=r"model.attention_backward='bf16': accepted values"):
        ModelSource(attention_backward="bf16")
    assert ModelSource(attention_backward="compute").arch_settings["attention_backward"] == "compute"
    with pytest.raises(ValueError, match=r"model.attention_backward='bf16': accepted values"):
        attn.causal_attention(q, q[:, :, :1], q[:, :, :1], implementation="xla", backward="bf16")
    with pytest.raises(ValueError, match=r"model.attention=cudnn needs a GPU \(jax's backend here is cpu\)"):
        attn.causal_attention(q, q[:, :, :1], q[:, :, :1], implementation="cudnn")
    with pytest.raises(ValueError, match=r"model.attention=splash needs a TPU: this program is lowered for cpu"):
        jax.jit(lambda q: attn.causal_attention(q, q[:, :, :1], q[:, :, :1], implementation="splash"))(q)
    with pytest.raises(ValueError, match=r"model.attention=splash needs a TPU \(platform gpu\)"):
        attn.causal_attention(q, q[:, :, :1], q[:, :, :1], implementation="splash", platform="gpu")


def test_forward_with_blockwise_matches_xla_past_one_block():
    """transformer.forward's attention is model.attention's: a 2-layer model over 600 tokens (past
    MATERIALISED_UP_TO: 5 blocks of 128) gives the xla path's log-probs within float32 noise of
    two programs."""
    from float_tol import logprob_tol

    cfg = ModelConfig.tiny("qwen2", attention="xla")
    params = tf.init_params(cfg, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (1, 600), 0, cfg.vocab_size)
    logp = {}
    for a in ("xla", "blockwise"):
        c = ModelConfig.tiny("qwen2", attention=a)
        logp[a] = jax.jit(lambda p, t, c=c: tf.token_logprobs(p, c, t)[0])(params, tokens)
    np.testing.assert_allclose(logp["blockwise"], logp["xla"], atol=logprob_tol(cfg, params, keys=600))


def test_splash_lowers_for_a_tpu_in_the_models_gradient():
    """model.attention=splash in a Qwen2.5-1.5B-shaped model (12 query heads over 2 KV heads of
    128, bfloat16, 2 layers, a 5120-token row as the update's): the gradient of its log-probs,
    lowered for a TPU on this CPU, calls the Mosaic kernel forward and backward in every layer."""
    cfg = ModelConfig.tiny(
        "qwen2", d_model=256, n_heads=12, n_kv_heads=2, head_dim=128, dtype="bfloat16", attention="splash"
    )
    params = jax.eval_shape(lambda: tf.init_params(cfg, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((1, 5120), jnp.int32)
    grad = jax.jit(jax.grad(lambda p, t: tf.token_logprobs(p, cfg, t, remat=True)[0].sum()))
    text = grad.trace(params, tokens).lower(lowering_platforms=("tpu",)).as_text()
    # per layer: the forward, its remat, and the backward's dK/dV and dQ kernels (SPLASH_FUSED_BWD off)
    assert mosaic_calls(text) == 4 * cfg.n_layers
    for types in mosaic_operands(text):  # the whole row, unpadded (5120 = 10 blocks of 512), GQA 12 over 2
        assert "12x5120x128xbf16>" in types and "2x5120x128xbf16>" in types, types


def test_splash_on_an_8_device_mesh_runs_per_device_and_blockwise_gathers_nothing():
    """tests/attention_mesh_worker.py (8 fake CPU devices, data 2 x fsdp 2 x tensor 2): splash's
    Mosaic call, lowered for a TPU, takes each device's rows and heads (and without the mesh the
    call refuses to be partitioned); blockwise's compiled program on the mesh keeps per-device
    shapes and has no all-gather, and equals one device."""
    run_on_fake_devices("attention_mesh_worker.py", "ATTENTION_MESH_WORKER_OK")


@pytest.mark.slow
@pytest.mark.parametrize("dtype,block", [("float32", None), ("bfloat16", None), ("float32", 128)])
def test_splash_in_interpret_mode_matches_the_float64_attention(dtype, block, monkeypatch):
    """The splash wrapper (padding 150 -> 256, the 1 / sqrt(H) scale, GQA, the layout) with the
    kernel in Pallas interpret mode on this CPU, forward and gradient, on the real rows; with
    128-position blocks the 256 positions are two blocks, so the backward's separate dq kernel
    (attention.SPLASH_FUSED_BWD off) sums over KV blocks."""
    if block is not None:
        monkeypatch.setattr(attn, "SPLASH_BLOCKS", (block,))
        attn._splash_kernel.cache_clear()
    q, k, v, w, real = _inputs(dtype)
    ref, mag = _reference(q, k, v, w, LENGTHS)
    fn = lambda q, k, v: attn.splash_attention(q, k, v, interpret=True)
    o = jax.jit(fn)(q, k, v)
    grads = jax.jit(jax.grad(_loss(fn, w), argnums=(0, 1, 2)))(q, k, v)
    for what, got in zip(("o", "dq", "dk", "dv"), (o, *grads)):
        got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
        # the scale applied to q in q's dtype: one more rounding of each score (U16 for bfloat16)
        tol = 2 * _tolerance(dtype, LENGTHS[0], mag[what])
        assert (np.abs(got - ref[what])[real] <= tol[real]).all(), what


def test_the_models_gradient_reads_model_attention_backward():
    """The learner's log-prob gradient (bfloat16 compute over float32 masters, the CPU's default
    attention) receives model.attention_backward: under "compute" every product of the program XLA
    receives is bfloat16 x bfloat16 -> float32 (XLA:CPU's bfloat16 kernels); under "autodiff" the
    attention's are not (bfloat16 results, or float32 operands: XLA:CPU widens both)."""
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 256)
    others = {}
    for backward in ATTENTION_BACKWARDS:
        cfg = ModelConfig.tiny(dtype="bfloat16", head_backward="compute", attention_backward=backward)
        params = tf.init_params(dataclasses.replace(cfg, dtype="float32"), jax.random.key(0))
        loss = lambda p, cfg=cfg: jnp.sum(tf.token_logprobs(p, cfg, tokens)[0])
        dots = _dot_types(jax.jit(jax.grad(loss)).lower(params).as_text())
        others[backward] = [d for d in dots if d != "bf16 bf16 f32"]
    assert others["compute"] == [] and others["autodiff"], others
