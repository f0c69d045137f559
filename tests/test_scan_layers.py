"""model.scan_layers (model/transformer.py _run_blocks): the layers under one lax.scan give the
unrolled model's hidden states, log-probs and gradients (every remat policy), queries / keys /
values and masked attention, to float32 tolerance (prefill stays unrolled); the compiled program holds one block
however deep the model (its dot count is flat in n_layers where the unrolled one grows); on a
mesh the gradient and scoring programs keep the unrolled one's layout (tests/scan_layers_worker.py, 8 fake devices); and the
learner runs with it."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float_tol import EPS32, forward_terms, logprob_tol, sum_tol
from test_sharding import run_on_fake_devices

from sparserl_jax.kvcache import cache as kvc
from sparserl_jax.model import remat
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig

B, T = 2, 16
FAMILIES = ("qwen2", "qwen3", "llama")  # q/k/v biases; q/k norms; llama3 RoPE scaling, no biases


def _cfg(family: str = "qwen2", n_layers: int = 3, scan: bool = False) -> ModelConfig:
    return ModelConfig.tiny(family, n_layers=n_layers, attention="xla", scan_layers=scan)


def _unrolled_and_scanned(family: str = "qwen2", n_layers: int = 3) -> tuple[ModelConfig, ModelConfig]:
    return _cfg(family, n_layers), _cfg(family, n_layers, scan=True)


@functools.cache
def _inputs(family: str = "qwen2"):
    """Params of init_params' structure from one draw, at a scale (matrices std 0.2, norms and
    biases 1 +- 0.3 / +- 0.3) where attention is far from uniform and every layer moves the
    residual stream, so a layer applied out of order or a mask on the wrong layer shows; tokens."""
    cfg = _cfg(family)
    shapes = jax.eval_shape(functools.partial(tf.init_params, cfg), jax.random.key(0))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    z = np.asarray(jax.random.normal(jax.random.key(1), (sum(x.size for _, x in leaves),), jnp.float32))
    out, i = [], 0
    for path, x in leaves:
        draw = z[i : i + x.size].reshape(x.shape)
        i += x.size
        name = jax.tree_util.keystr(path)
        out.append(jnp.asarray(1.0 + 0.3 * draw if "norm" in name else (0.3 if "bias" in name else 0.2) * draw))
    params = jax.tree_util.tree_unflatten(treedef, out)
    tokens = jax.random.randint(jax.random.key(2), (B, T), 0, cfg.vocab_size)
    return params, tokens


def _hidden_tol(cfg: ModelConfig, params) -> float:
    """Two float32 programs of the same model: each final hidden entry within forward_terms(T)
    EPS32 of the hidden row's magnitude (RMS-normed: ||h|| <= sqrt(D) max |final norm weight|)."""
    gain = float(np.abs(np.asarray(params["final_norm"])).max())
    return sum_tol(forward_terms(cfg, T), math.sqrt(cfg.d_model) * gain)


def _grad_tol(cfg: ModelConfig, ref: np.ndarray) -> float:
    """A gradient entry sums B T token terms, each a path of forward_terms float32 sums, in another
    order: n EPS32 of the leaf's largest entry, n = B T + forward_terms (tests/fsdp_layout_worker.py)."""
    return (B * T + forward_terms(cfg, T)) * EPS32 * float(np.abs(ref).max())


def _logprob_sum(cfg: ModelConfig, policy: str):
    return lambda p, t: tf.token_logprobs(p, cfg, t, remat=policy, chunk_tokens=T)[0].sum()


# one family in the default tier (the block code is shared; the others' extras are checked unrolled)
@pytest.mark.parametrize(
    "family", [f if f == "qwen2" else pytest.param(f, marks=pytest.mark.extended) for f in FAMILIES]
)
def test_scanned_forward_and_logprobs_equal_the_unrolled(family):
    """Hidden states and token log-probs (and their entropies) of the scanned model equal the
    unrolled model's; the same layers in reverse order (what a scan over the wrong axis would
    give) differ from them by far more than the tolerance."""
    unrolled, scanned = _unrolled_and_scanned(family)
    params, tokens = _inputs(family)
    fwd = jax.jit(tf.forward, static_argnums=1)
    h_want, h_got = fwd(params, unrolled, tokens), fwd(params, scanned, tokens)
    tol = _hidden_tol(unrolled, params)
    np.testing.assert_allclose(h_got, h_want, rtol=0, atol=tol)
    reversed_layers = dict(params, layers=params["layers"][::-1])
    assert float(jnp.abs(fwd(reversed_layers, scanned, tokens) - h_want).max()) > 100 * tol

    lp = jax.jit(functools.partial(tf.token_logprobs, chunk_tokens=T), static_argnums=1)
    (lp_want, ent_want), (lp_got, ent_got) = lp(params, unrolled, tokens), lp(params, scanned, tokens)
    lp_tol = logprob_tol(unrolled, params, T)
    np.testing.assert_allclose(lp_got, lp_want, rtol=0, atol=lp_tol)
    np.testing.assert_allclose(ent_got, ent_want, rtol=0, atol=lp_tol)  # lse - E[z]: the same error terms


# full (the overlays' policy) in the default tier; tests/test_remat.py orders the three unrolled
@pytest.mark.parametrize(
    "policy", [p if p == "full" else pytest.param(p, marks=pytest.mark.extended) for p in remat.POLICIES]
)
def test_scanned_gradient_equals_the_unrolled_under_every_remat_policy(policy):
    """d sum(log-probs) / d params, scanned under rl.update.remat=`policy` (checkpointed inside the
    scan body), equals the unrolled model's under the same policy, leaf by leaf: each layer's
    gradient lands in its own layer (the stack's transpose splits it back)."""
    unrolled, scanned = _unrolled_and_scanned()
    params, tokens = _inputs()
    want = jax.jit(jax.grad(_logprob_sum(unrolled, policy)))(params, tokens)
    got = jax.jit(jax.grad(_logprob_sum(scanned, policy)))(params, tokens)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        assert float(np.abs(w).max()) > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(g, w, rtol=0, atol=_grad_tol(unrolled, w), err_msg=jax.tree_util.keystr(path))


def test_scanned_qkv_and_masked_attention_equal_the_unrolled():
    """return_qkv: per-layer lists of [B, T, N, H] queries and [B, T, K, H] keys and values, as the
    unrolled model returns them; attn_masks: one random [B, N, T, T] mask per layer (each
    query's own position kept), stacked and scanned, gives the unrolled model's hidden states,
    and a mask moved to another layer does not."""
    unrolled, scanned = _unrolled_and_scanned()
    params, tokens = _inputs()
    L, N = unrolled.n_layers, unrolled.n_heads
    fwd = jax.jit(tf.forward, static_argnums=1, static_argnames="return_qkv")
    want, got = fwd(params, unrolled, tokens, return_qkv=True), fwd(params, scanned, tokens, return_qkv=True)
    tol = _hidden_tol(unrolled, params)
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=tol)
    for name, ws, gs in zip(("q", "k", "v"), want[1:], got[1:]):
        assert isinstance(gs, list) and len(gs) == L, name
        for i, (w, g) in enumerate(zip(ws, gs)):
            assert g.shape == w.shape, (name, i)
            # a layer's q, k or v: the residual stream's error through i layers, then one D-term
            # projection, relative to the largest entry's terms (|h| |w| summed: max |w| sqrt(D) ||x||)
            np.testing.assert_allclose(g, w, rtol=0, atol=sum_tol(forward_terms(unrolled, T), float(np.abs(w).max())))

    rng = np.random.default_rng(0)
    masks = rng.random((L, B, N, T, T)) < 0.6
    masks[..., np.arange(T), np.arange(T)] = True
    masks = [jnp.asarray(m) for m in masks]
    want = fwd(params, unrolled, tokens, attn_masks=masks)
    np.testing.assert_allclose(fwd(params, scanned, tokens, attn_masks=masks), want, rtol=0, atol=tol)
    rolled = masks[1:] + masks[:1]
    assert float(jnp.abs(fwd(params, scanned, tokens, attn_masks=rolled) - want).max()) > 100 * tol


def test_prefill_stays_unrolled_under_scan_layers():
    """A sampler's prefill runs the layers unrolled whatever model.scan_layers says (a scan stacks a
    copy of the weights inside its program: on a rollout layout, where every chip holds the whole
    compute copy, that doubles it): with the scanned config its compiled program holds no while
    loop, and its logits and cache are the unrolled config's bit for bit."""
    unrolled, scanned = _unrolled_and_scanned()
    params, tokens = _inputs()
    lengths = jnp.array([T, T - 5])
    prefill = jax.jit(tf.prefill, static_argnums=1)
    cache = kvc.init_cache(B, unrolled.n_layers, unrolled.n_kv_heads, T + 4, unrolled.head_dim)
    assert _whiles(prefill.lower(params, scanned, tokens, lengths, cache).compile().as_text()) == 0
    (lw, cw), (lg, cg) = (
        prefill(params, unrolled, tokens, lengths, cache),
        prefill(params, scanned, tokens, lengths, cache),
    )
    np.testing.assert_array_equal(lg, lw)
    for name in ("k", "v", "fill"):
        for g, w in zip(jax.tree.leaves(getattr(cg, name)), jax.tree.leaves(getattr(cw, name)), strict=True):
            np.testing.assert_array_equal(g, w, err_msg=f"cache.{name}")


def test_scanned_forward_reads_quantized_weights():
    """Rollouts may read int8 weights (quant/, QWeight leaves: values and scales stacked alike):
    weight-only int8 (w8a16: the dot in float32 on the int8 values, then the channel scale, so
    float32 sums as any dot) gives the unrolled model's hidden states."""
    from sparserl_jax.quant.config import QuantConfig
    from sparserl_jax.quant.core import QWeight
    from sparserl_jax.quant.params import quantize_params

    unrolled, scanned = _unrolled_and_scanned()
    params, tokens = _inputs()
    qparams = quantize_params(params, QuantConfig(format="int8", mode="w8a16"))
    assert isinstance(qparams["layers"][0]["q"], QWeight)
    fwd = jax.jit(tf.forward, static_argnums=1)
    want = fwd(qparams, unrolled, tokens)
    np.testing.assert_allclose(fwd(qparams, scanned, tokens), want, rtol=0, atol=_hidden_tol(unrolled, params))


def _dots(hlo: str) -> int:
    return len(re.findall(r"\sdot\(", hlo))


def _whiles(hlo: str) -> int:
    return len(re.findall(r"\swhile\(", hlo))


def test_the_scanned_program_holds_one_block_however_deep():
    """Compiled HLO of the forward at n_layers 2 and 4: the unrolled program holds a block's dots
    per layer (twice as many at 4) and no loop; the scanned one a single block's dots at both
    depths, in its one while loop."""
    params, tokens = _inputs()
    found = {}
    for L in (2, 4):
        p = dict(params, layers=[params["layers"][i % 3] for i in range(L)])
        for scan in (False, True):
            fwd = jax.jit(functools.partial(tf.forward, cfg=_cfg(n_layers=L, scan=scan)))
            hlo = fwd.lower(p, tokens=tokens).compile().as_text()
            found[L, scan] = (_dots(hlo), _whiles(hlo))
    (d2, w2), (d4, w4) = found[2, False], found[4, False]
    assert d4 == 2 * d2 and w2 == w4 == 0, found  # unrolled: L copies of the block
    assert found[2, True] == found[4, True] == (d2 // 2, 1), found  # scanned: one block in one loop


@pytest.mark.slow
def test_scanned_programs_keep_the_layout_on_8_devices():
    """Mesh (data, fsdp, tensor) = (1, 4, 2), tests/scan_layers_worker.py: the scanned gradient
    and scoring programs hold B / (data x fsdp) rows per device, stack the weights in their shards
    and gather one layer's weights inside the loop (none outside), and their numbers equal the
    unrolled programs' on the mesh."""
    out = run_on_fake_devices("scan_layers_worker.py", "SCAN_LAYERS_OK")
    records = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("SCAN_LAYERS ")]
    assert [r["program"] for r in records] == ["token_logprobs gradient", "token_logprobs"]
    for r in records:
        assert r["activation_rows_per_device"] == 4 and r["stacked_q_shard"] and not r["stacked_q_gathered"], r
        assert min(r["layer_weight_gathers_in_loops"].values()) >= 1, r
        assert sum(r["layer_weight_gathers_outside_loops"].values()) == 0, r


def test_the_setting_is_validated():
    assert not ModelConfig().scan_layers
    with pytest.raises(ValueError, match=r"model\.scan_layers='yes' must be true or false"):
        ModelConfig(scan_layers="yes")


def test_the_learner_runs_one_update_scanned_as_unrolled():
    """The learner (rl/bucketed.py BucketedUpdate, the trainer's update) on one rollout batch with
    model.scan_layers, at its cheapest path (one width, pi_old from the update's own forward, no
    pi_ref: one compiled micro-batch gradient program): the parameters after the update equal the
    unrolled learner's, and its metrics too."""
    from test_rl_bucketed import MC, _assert_same_params, _batch
    from test_rl_bucketed import _cfg as rl_cfg
    from test_rl_update import SGD_COUNTING

    from sparserl_jax.rl.bucketed import BucketedUpdate

    cfg = rl_cfg(normalisation="none", beta=0.0, length_bucket=0, compile_ahead=False)
    params, ref_params, packed, noise, adv = _batch()
    mask = np.asarray(packed["response_mask"])
    host = {
        "tokens": np.asarray(packed["tokens"]),
        "response_mask": mask,
        "sampler_logp": np.where(mask, -1.0 + np.asarray(noise), 0.0).astype(np.float32),
        "advantages": np.asarray(adv),
    }
    outs = {}
    for scan in (False, True):
        upd = BucketedUpdate(dataclasses.replace(MC, scan_layers=scan), cfg, SGD_COUNTING, donate=False)
        outs[scan] = upd(params, ref_params, SGD_COUNTING.init(params), host)
    (want_params, _, want), (got_params, _, got) = outs[False], outs[True]
    assert want.metrics["old_from_update"] == 1.0  # the fused path: one program
    _assert_same_params(cfg, params, want_params, got_params)
    assert set(got.metrics) == set(want.metrics)
    for k, v in want.metrics.items():
        # means of O(1) per-token values over the same tokens (test_rl_bucketed's tolerance)
        np.testing.assert_allclose(got.metrics[k], v, rtol=1e-4, atol=1e-6, err_msg=k)
