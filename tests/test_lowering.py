"""Programs lowered for GPU (cuda) and TPU on this CPU machine, at the real configs' shapes.

jax.export lowers a jitted function for a platform the machine lacks; nothing is compiled for it
and nothing big is allocated (parameters, optimizer state and batches are ShapeDtypeStructs). For
Qwen2.5-1.5B and 7B (bf16 compute over float32 master weights, head_dim 128, the authors' R-KV
budget 512 + buffer 128): the Pallas decode kernel at several batch sizes, one full sampler call
with attn_impl=pallas, and the update step (the padded one, and the trainer's bucketed programs:
a micro-batch's gradient from the bfloat16 compute copy, the AdamW step on the master, the re-cast). What only hardware can check - that Mosaic / Triton compile the kernels, and their speed -
is not covered. The Triton custom call has no export compatibility guarantee, so its safety check
is disabled (lowering only; the serialized module is never reused).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax import export

from sparserl_jax import kernels
from sparserl_jax.config import load_config
from sparserl_jax.dryrun import model_config
from sparserl_jax.kernels import decode_attention_gpu as gpu
from sparserl_jax.model import precision
from sparserl_jax.model import sharding as shd
from sparserl_jax.rl import bucketed
from sparserl_jax.rl.batch import BATCH_KEYS
from sparserl_jax.rl.optim import make_optimizer
from sparserl_jax.rl.update import make_update_fn
from sparserl_jax.rollout import sampler as smp

REAL = pathlib.Path(__file__).parent.parent / "experiments/configs/real"
MODELS = ("qwen2.5-1.5b", "qwen2.5-7b")
# jax platform name -> (kernels' platform, a string the lowered module must contain)
PLATFORMS = {"tpu": ("tpu", "tpu_custom_call"), "cuda": ("gpu", "__gpu$xla.gpu.triton")}
DISABLED = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
needs_triton = pytest.mark.skipif(not gpu.TRITON_AVAILABLE, reason=f"jax {jax.__version__} has no Pallas Triton")


def _platforms():
    return [pytest.param(p, marks=needs_triton) if p == "cuda" else p for p in PLATFORMS]


@functools.cache
def real(name: str):
    cfg = load_config([str(REAL / f"{name}.yaml")])
    model_cfg, _ = model_config(cfg, str(REAL / "arch" / f"{name}.json"))
    assert model_cfg.head_dim == 128 and jnp.dtype(model_cfg.dtype) == jnp.bfloat16
    return cfg, model_cfg


def lower(fn, platform: str, *args) -> str:
    """The StableHLO text of `fn(*args)` exported for `platform` (lowering only)."""
    return export.export(fn, platforms=[platform], disabled_checks=DISABLED)(*args).mlir_module()


def sds(shape, dtype, sharding=None):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)


@pytest.mark.parametrize("platform", _platforms())
@pytest.mark.parametrize("name", MODELS)
def test_decode_kernel_lowers_at_real_shapes(name, platform):
    cfg, m = real(name)
    C = cfg.kv.budget + cfg.kv.buffer
    assert C == 640
    kernel_platform, marker = PLATFORMS[platform]
    fn = jax.jit(functools.partial(kernels.decode_attention, impl="pallas", platform=kernel_platform))
    for B in (1, 8, 64, 256):
        kv = sds((B, m.n_kv_heads, C, m.head_dim), m.dtype)
        text = lower(fn, platform, sds((B, m.n_heads, m.head_dim), m.dtype), kv, kv, sds((B,), "int32"))
        assert marker in text, (name, platform, B)


@pytest.mark.parametrize("platform", _platforms())
def test_shapes_the_kernel_cannot_tile_fail_with_our_message(platform):
    kernel_platform, _ = PLATFORMS[platform]
    q, kv = sds((8, 12, 96), "bfloat16"), sds((8, 2, 640, 96), "bfloat16")
    fill = sds((8,), "int32")
    if platform == "cuda":  # Triton tiles need power-of-two head dims
        fn = jax.jit(functools.partial(kernels.decode_attention, impl="pallas", platform="gpu"))
        with pytest.raises(ValueError, match=r"impl='pallas' on gpu: head_dim=96 must be a power of two"):
            lower(fn, platform, q, kv, kv, fill)
    else:  # Mosaic bf16 tiles are 16 sublanes
        fn = jax.jit(functools.partial(kernels.decode_attention, impl="pallas", platform=kernel_platform, block_c=200))
        with pytest.raises(ValueError, match=r"block_c=200 must be a multiple of 16 for bfloat16"):
            lower(fn, platform, q, kv, kv, fill)


@pytest.mark.parametrize("platform", _platforms())
# 7B in the extended tier: the same head_dim and kernel tiles as 1.5B (its decode kernel lowers above)
@pytest.mark.parametrize(
    "name", [pytest.param(m, marks=pytest.mark.extended) if m == "qwen2.5-7b" else m for m in MODELS]
)
def test_sampler_and_update_step_lower_at_real_shapes(name, platform):
    """One generate call (R-KV 512 + 128, 4096 new tokens, the Pallas kernel) and the update
    step (micro-batch 4, remat) on the real architecture, parameters as shapes only."""
    cfg, m = real(name)
    kernel_platform, marker = PLATFORMS[platform]
    params = shd.abstract_params(m)
    B, P = 8, 256
    scfg = smp.SamplerConfig(
        max_new_tokens=cfg.rollout.max_new_tokens,
        kv=cfg.kv,
        eos_token_ids=(m.vocab_size - 1,),
        attn_impl="pallas",
        attn_platform=kernel_platform,
    )
    gen = jax.jit(lambda params, prompts, lengths, key: smp.generate(params, m, prompts, lengths, key, scfg))
    key = jax.eval_shape(jax.random.key, 0)
    text = lower(gen, platform, params, sds((B, P), "int32"), sds((B,), "int32"), key)
    assert marker in text, (name, platform)  # one jitted kernel, called from every layer

    rl = dataclasses.replace(cfg.rl, update=dataclasses.replace(cfg.rl.update, minibatch_size=B))
    optimizer = make_optimizer(rl.optim)
    update = make_update_fn(m, rl, optimizer)
    opt_state = jax.eval_shape(optimizer.init, params)
    T = P + 128
    dtypes = {"tokens": "int32", "response_mask": "bool", "advantages": "float32"}
    batch = {k: sds((B,) if k == "advantages" else (B, T), dtypes.get(k, "float32")) for k in BATCH_KEYS}
    text = lower(update, platform, params, opt_state, batch)
    assert "stablehlo.while" in text or "stablehlo.dot_general" in text


@pytest.mark.parametrize("platform", _platforms())
def test_mixed_precision_update_programs_lower_at_real_shapes(platform):
    """The trainer's update (rl/bucketed.py) at bfloat16 compute over float32 master weights
    (model/precision.py): a micro-batch's gradient (pi_ref inside, remat) from the bfloat16
    compute copies, the AdamW step on the float32 master and the re-cast of the compute copy,
    on Qwen2.5-7B's shapes: gradients accumulate in float32, log-probs are float32."""
    cfg, m = real("qwen2.5-7b")
    assert (m.dtype, m.param_dtype) == ("bfloat16", "float32")
    master = shd.abstract_params(m)
    assert {x.dtype for x in jax.tree.leaves(master)} == {jnp.dtype(jnp.float32)}
    compute = jax.tree.map(lambda x: sds(x.shape, m.dtype), master)
    acc = jax.tree.map(lambda x: sds(x.shape, "float32"), master)
    B, T = cfg.rl.update.micro_batch_size, 256 + 128
    mb = {
        "tokens": sds((B, T), "int32"),
        "response_mask": sds((B, T), "bool"),
        "sampler_logp": sds((B, T), "float32"),
        "advantages": sds((B,), "float32"),
    }
    micro = jax.jit(functools.partial(bucketed._micro_step, m, cfg.rl, fused=True))
    acc_out, num, _, logp, top = jax.eval_shape(micro, compute, compute, acc, mb, None)
    assert {x.dtype for x in jax.tree.leaves(acc_out)} == {jnp.dtype(jnp.float32)}
    assert num.dtype == logp.dtype == jnp.float32 and logp.shape == (B, T) and top is None
    text = lower(micro, platform, compute, compute, acc, mb, None)
    assert "bf16" in text and "stablehlo.dot_general" in text
    optimizer = make_optimizer(cfg.rl.optim)
    opt_state = jax.eval_shape(optimizer.init, master)
    assert {x.dtype for x in jax.tree.leaves(opt_state) if x.ndim} == {jnp.dtype(jnp.float32)}
    apply = jax.jit(functools.partial(bucketed._apply, optimizer))
    new, _, _ = jax.eval_shape(apply, master, opt_state, acc, sds((), "float32"), sds((), "float32"))
    assert {x.dtype for x in jax.tree.leaves(new)} == {jnp.dtype(jnp.float32)}
    lower(apply, platform, master, opt_state, acc, sds((), "float32"), sds((), "float32"))
    recast = jax.jit(functools.partial(precision.cast_floats, dtype=m.dtype))
    assert jax.tree.map(lambda x: x.dtype, jax.eval_shape(recast, master)) == jax.tree.map(lambda x: x.dtype, compute)
    assert "stablehlo.convert" in lower(recast, platform, master)
