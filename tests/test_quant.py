"""sparserl_jax.quant: quantized weights, the native vs fake dot, quantized sampling, invariant
scaling, the sharded quantize_params, and the errors that name the setting."""

import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_cache import compile_cache_in_process
from float_tol import EPS32, forward_terms, logit_magnitude, sum_tol
from test_sharding import fake_device_env
from test_train import _cfg, _strip_timing

from sparserl_jax import kvcache as kv
from sparserl_jax import quant
from sparserl_jax.metrics_log import read_metrics
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.quant.core import QMAX
from sparserl_jax.rollout import sampler as smp
from sparserl_jax.rollout.sampling import SamplingConfig
from sparserl_jax.train import Trainer

CFG = ModelConfig.tiny("qwen2", vocab_size=64, tie_embeddings=False)
PARAMS = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, tf.init_params(CFG, jax.random.key(0)))
TOKENS = jax.random.randint(jax.random.key(1), (3, 10), 1, CFG.vocab_size)
INT8 = quant.QuantConfig(format="int8")


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(tmp_path_factory):
    """The resumed QuRL trainer repeats the first one's programs: with the session's
    compilation cache they compile once (tests/compile_cache.py)."""
    with compile_cache_in_process(tmp_path_factory):
        yield


def test_weight_scales_per_output_channel_and_int8_round_trip():
    q = quant.quantize_params(PARAMS, INT8)
    layer, full = q["layers"][0], PARAMS["layers"][0]
    D, N, K, H, F = CFG.d_model, CFG.n_heads, CFG.n_kv_heads, CFG.head_dim, CFG.d_ff
    expected = {
        "q": (1, N, H),
        "k": (1, K, H),
        "v": (1, K, H),
        "o": (1, 1, D),
        "gate": (1, F),
        "up": (1, F),
        "down": (1, D),
    }
    for name, shape in expected.items():
        w = layer[name]
        assert isinstance(w, quant.QWeight) and w.values.dtype == jnp.int8, name
        assert w.scale.shape == shape and w.scale.dtype == jnp.float32, name
        err = np.abs(np.asarray(w.dequantize()) - np.asarray(full[name]))
        # round to the nearest code: scale / 2, plus the float32 roundings of w / scale and of
        # code * scale, each <= u |w| with |w| <= 127 scale: scale / 2 * (1 + 254 EPS32)
        assert np.all(err <= np.asarray(w.scale) / 2 * (1 + 254 * EPS32)), name
    # full precision by default: embedding, lm_head, norms and biases
    assert q["lm_head"] is PARAMS["lm_head"] and q["embed"] is PARAMS["embed"]  # shared, not copied
    assert layer["attn_norm"] is full["attn_norm"]
    assert not isinstance(layer["attn_norm"], quant.QWeight) and not isinstance(layer["q_bias"], quant.QWeight)
    assert isinstance(
        quant.quantize_params(PARAMS, quant.QuantConfig(format="int8", skip=("embed",)))["lm_head"], quant.QWeight
    )


def test_fp8_overflow_zeros_and_zero_channels_give_no_nan():
    x = jnp.array([[1e6, -1e6, 448.0, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, -2.0, 1e-3, 0.5]])
    for fmt in ("fp8", "int8"):
        values, scale = quant.quantize(x, fmt, (1,))
        back = np.asarray(values.astype(jnp.float32) * scale)
        assert np.all(np.isfinite(back)) and np.all(np.isfinite(np.asarray(scale))), fmt
        assert scale[1, 0] == 1.0 and np.all(back[1] == 0.0), fmt  # zero channel: safe scale
        # two roundings (scale = absmax / qmax, code * scale; the code is exact): <= 2u
        np.testing.assert_allclose(back[0, :2], [1e6, -1e6], rtol=1e-6)
    # values beyond +-448 with a unit scale saturate instead of overflowing to NaN
    values, _ = quant.quantize(jnp.array([[448.0]]), "fp8", (1,))
    w = quant.QWeight(
        jnp.array([[1e4, -1e4]]).clip(-QMAX["fp8"], QMAX["fp8"]).astype(values.dtype), jnp.ones((1, 2)), fmt="fp8"
    )
    assert np.all(np.isfinite(np.asarray(w.dequantize())))


@pytest.mark.parametrize("fmt,mode", [("int8", "w8a8"), ("fp8", "w8a8"), ("int8", "w8a16")])
def test_native_dot_matches_fake_and_is_a_low_precision_dot(fmt, mode):
    native = quant.quantize_params(PARAMS, quant.QuantConfig(format=fmt, mode=mode))
    fake = quant.quantize_params(PARAMS, quant.QuantConfig(format=fmt, mode=mode, impl="fake"))
    ln, lf = tf.logits(native, CFG, TOKENS), tf.logits(fake, CFG, TOKENS)
    scale = float(jnp.max(jnp.abs(lf)))
    assert float(jnp.max(jnp.abs(ln - lf))) <= 1e-5 * scale
    full = tf.logits(PARAMS, CFG, TOKENS)
    assert 0 < float(jnp.mean(jnp.abs(ln - full))) < 0.1 * float(jnp.mean(jnp.abs(full)))  # close
    hlo = jax.jit(lambda p: tf.logits(p, CFG, TOKENS)).lower(native).as_text()
    operand = {"int8": "xi8>", "fp8": "xf8E4M3FN>"}[fmt]
    dots = [line for line in hlo.splitlines() if "dot_general" in line and operand in line]
    assert len(dots) == (7 * CFG.n_layers if mode == "w8a8" else 0)
    if fmt == "int8" and mode == "w8a8":
        assert all("xi32>" in line.split("->")[-1] for line in dots)  # int32 accumulation


def test_dot_matches_qwix_and_numpy_oracles():
    """The rescaled dot against qwix.einsum on the same QArrays (qwix's int8 grid is absmax / 127.5,
    ours absmax / 127, so the quantized values come from a NumPy reference instead)."""
    x = jax.random.normal(jax.random.key(2), (2, 3, 16))
    w = jax.random.normal(jax.random.key(3), (16, 4, 8))
    values, scale = quant.quantize(w, "int8", (0,))
    w_np = np.asarray(w)
    s_np = np.abs(w_np).max(0, keepdims=True) / 127.0
    np.testing.assert_array_equal(values, np.clip(np.round(w_np / s_np), -127, 127))
    np.testing.assert_allclose(scale, s_np, rtol=1e-6)  # absmax / 127: one or two roundings
    xv, xs = quant.quantize(x, "int8", (2,))
    ours = quant.dot("btd,dnh->btnh", x, quant.QWeight(values, scale))
    x_np = np.asarray(xv, np.float64) * np.asarray(xs)
    deq = np.asarray(values, np.float64) * np.asarray(scale)
    np.testing.assert_allclose(ours, np.einsum("btd,dnh->btnh", x_np, deq), rtol=1e-5, atol=1e-5)
    qwix = pytest.importorskip("qwix")
    theirs = qwix.einsum(
        "btd,dnh->btnh", qwix.QArray(xv, xs, qtype=jnp.int8), qwix.QArray(values, scale, qtype=jnp.int8)
    )
    # the int32 accumulation is exact in both; the rescales by the two scales differ by at most
    # their 3 roundings each (6u = 3.6e-7 relative)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


def test_quantized_sampler_greedy_and_logprobs_match_teacher_forcing():
    """One greedy rollout with native int8 params: its tokens are the argmax of the fake
    (quantize -> dequantize) model's teacher-forced logits at every step, so the fake sampler
    would decode the same tokens, and its log-probs equal token_logprobs(qparams)."""
    qparams = quant.quantize_params(PARAMS, INT8)
    fake = quant.quantize_params(PARAMS, quant.QuantConfig(format="int8", impl="fake"))
    lengths = jnp.array([6, 10, 8])
    prompts = jnp.where(jnp.arange(10)[None] < lengths[:, None], TOKENS, 0)
    M = 6
    greedy = smp.SamplerConfig(max_new_tokens=M, sampling=SamplingConfig(temperature=0.0), kv=kv.KVConfig(buffer=3))
    out = smp.generate_jit(qparams, CFG, prompts, lengths, jax.random.key(0), greedy)
    seq = np.zeros((3, 10 + M), np.int32)
    for b in range(3):
        P = int(lengths[b])
        seq[b, :P], seq[b, P : P + M] = prompts[b, :P], out.tokens[b]
    fake_logits = np.asarray(tf.logits(fake, CFG, jnp.asarray(seq)))
    lp, _ = tf.token_logprobs(qparams, CFG, jnp.asarray(seq))
    # the native and the fake dot are the same integer arithmetic up to float32 rounding: the
    # argmax up to a tie within that noise (float_tol over <= 16 keys)
    logit_tol = sum_tol(forward_terms(CFG, 16), logit_magnitude(PARAMS))
    for b in range(3):
        P = int(lengths[b])
        rows = fake_logits[b, P - 1 : P - 1 + M]
        chosen = np.take_along_axis(rows, np.asarray(out.tokens[b])[:, None], -1)[:, 0]
        np.testing.assert_array_less(rows.max(-1) - chosen, 2 * logit_tol)
        np.testing.assert_allclose(out.logprobs[b], lp[b, P - 1 : P - 1 + M], atol=2e-5)


def test_invariant_scaling_keeps_the_logits_and_exports_the_scaled_weights(tmp_path):
    from sparserl_jax.model import hf

    scaled = quant.invariant_scale(PARAMS, 1.5)
    np.testing.assert_allclose(
        scaled["layers"][0]["attn_norm"], 1.5 * PARAMS["layers"][0]["attn_norm"]
    )  # 1.5 * 1: exact
    ref = tf.logits(PARAMS, CFG, TOKENS)
    assert float(jnp.max(jnp.abs(tf.logits(scaled, CFG, TOKENS) - ref))) <= 1e-5 * float(jnp.max(jnp.abs(ref)))
    hf.save_params(tmp_path, CFG, scaled)  # the HF export holds the scaled, equivalent weights
    _, loaded = hf.load_params(tmp_path)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(scaled)):
        np.testing.assert_array_equal(a, b)


def test_sharded_quantize_params_equals_one_device():
    code = """
import jax, numpy as np
from sparserl_jax import quant
from sparserl_jax.model import sharding as shd, transformer as tf
from sparserl_jax.model.config import ModelConfig
cfg = ModelConfig.tiny("qwen2", vocab_size=64, d_model=32, d_ff=64, tie_embeddings=False)
params = tf.init_params(cfg, jax.random.key(0))
mesh = shd.make_mesh(shd.MeshConfig(data=2, fsdp=2, tensor=2))
qcfg = quant.QuantConfig(format="int8", skip=("embed",))
one = quant.quantize_params(params, qcfg)
many = quant.quantize_params(shd.shard_params(params, mesh), qcfg)
for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many)):  # elementwise ops and a max: exact
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
q, fp = many["layers"][0]["q"], shd.shard_params(params, mesh)["layers"][0]["q"]
assert q.values.sharding.spec == fp.sharding.spec and q.values.dtype == np.int8, q.values.sharding
assert tuple(q.scale.sharding.spec)[:1] in ((None,), ()), q.scale.sharding
assert len(q.values.sharding.device_set) == 8
print("QUANT_SHARDED_OK")
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], env=fake_device_env(8), capture_output=True, text=True, timeout=300
    )
    assert "QUANT_SHARDED_OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_bad_input_names_the_setting(monkeypatch):
    with pytest.raises(ValueError, match=r"quant\.format='int4'.*accepted"):
        quant.QuantConfig(format="int4")
    with pytest.raises(ValueError, match=r"quant\.mode='w4a16'.*accepted"):
        quant.QuantConfig(format="int8", mode="w4a16")
    with pytest.raises(ValueError, match=r"quant\.skip.*'embed'"):
        quant.QuantConfig(format="int8", skip=())
    odd = {**PARAMS, "layers": [{**PARAMS["layers"][0], "w_fused": PARAMS["layers"][0]["q"]}]}
    with pytest.raises(ValueError, match=r"quant\.format='int8'.*layers\[0\]\.w_fused"):
        quant.quantize_params(odd, INT8)
    monkeypatch.delattr(jnp, "float8_e4m3fn")
    with pytest.raises(ValueError, match=r"quant\.format='fp8' needs a jax with float8"):
        quant.QuantConfig(format="fp8")


def test_qurl_int8_run_trains_logs_mismatch_and_acr_and_resumes_exactly(tmp_path):
    """Sparse (snapkv) + int8 W8A8 rollouts with QuRL's ACR and invariant scaling: nonzero
    mismatch and ACR activity; resumed from its iteration-1 checkpoint, the run repeats
    iteration 2 exactly (the resumed trainer does not scale again) and refuses another scale."""
    common = (
        "train.iterations=2",
        "sft.steps=4",
        "train.save_every=1",
        "rl.mode=qurl",
        "rl.acr.c=1.01",
        "quant.format=int8",
        "quant.invariant_scaling=true",
    )
    Trainer(_cfg(tmp_path / "a", *common)).run()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "2")  # as if stopped after iteration 1
    Trainer(_cfg(tmp_path / "b", *common)).run()
    a, b = _strip_timing(read_metrics(tmp_path / "a")), _strip_timing(read_metrics(tmp_path / "b"))
    assert [r["step"] for r in b] == [1, 2]
    for k in a[1]:  # the same compiled programs on the same machine and state: bit-exact
        assert b[1][k] == a[1][k], (k, b[1][k], a[1][k])
    assert all(r["mismatch/kl_k3"] > 0 and r["acr/active_frac"] > 0 for r in a), a
    assert a[-1]["update/tokens"] > 0
    with pytest.raises(ValueError, match=r"quant\.invariant_scaling.*scaled by 1\.5"):
        Trainer(_cfg(tmp_path / "b", *common[:-1], "train.iterations=3")).run()


def test_generate_and_evaluate_quant_flags():
    """--quant / --quant-mode on both CLIs reach quantize_params (main() samples with its result)."""
    from sparserl_jax import evaluate, generate

    args = generate.build_parser().parse_args(["--checkpoint", "x", "--prompt", "p", "--quant", "int8"])
    q = generate.quantized(PARAMS, args)["layers"][0]["q"]
    assert isinstance(q, quant.QWeight) and (q.fmt, q.act) == ("int8", "int8")
    args = evaluate.build_parser().parse_args(["--checkpoint", "x", "--quant", "fp8", "--quant-mode", "w8a16"])
    q = generate.quantized(PARAMS, args)["layers"][0]["down"]
    assert (q.fmt, q.act, q.values.dtype) == ("fp8", None, jnp.float8_e4m3fn)
    assert generate.quantized(PARAMS, evaluate.build_parser().parse_args(["--checkpoint", "x"])) is PARAMS
    with pytest.raises(SystemExit):
        generate.build_parser().parse_args(["--checkpoint", "x", "--prompt", "p", "--quant", "int4"])


def test_dry_run_counts_the_quantized_copy_in_the_rollout_phase():
    from test_dryrun import item, run

    base = run("qwen2.5-1.5b", "1gpu")
    q = run("qwen2.5-1.5b", "1gpu", "quant.format=int8")
    m = q["model"]
    D, N, K, H, L = (m[k] for k in ("d_model", "n_heads", "n_kv_heads", "head_dim", "n_layers"))
    F = 8960  # Qwen2.5-1.5B's MLP width
    values = L * (2 * D * N * H + 2 * D * K * H + 3 * D * F)  # int8: one byte each
    scales = L * 4 * (N * H + 2 * K * H + D + 2 * F + D)  # float32: q, k, v, o, gate, up, down
    assert item(q, "quantized params (behaviour copy)") == values + scales
    assert q["phase_bytes"]["rollout"] == base["phase_bytes"]["rollout"] + values + scales
    assert q["phase_bytes"]["persistent"] == base["phase_bytes"]["persistent"]
