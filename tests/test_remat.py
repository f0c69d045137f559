"""rl.update.remat's policies (model/remat.py): what each keeps for the backward pass (JAX's own
list of saved residuals), what it recomputes (the compiled gradient's FLOPs), the same gradients,
and the setting's errors."""

from __future__ import annotations

import contextlib
import io
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float_tol import EPS32

from sparserl_jax.model import remat
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rl.config import UpdateConfig

CFG = ModelConfig.tiny("qwen2", attention="xla", n_layers=3, d_ff=256)
B, T = 2, 32
ITEM = {"f32": 4, "bf16": 2, "s32": 4, "bool": 1, "pred": 1}


def _loss(policy):
    return lambda p, t: tf.token_logprobs(p, CFG, t, remat=policy, chunk_tokens=32)[0].sum()


def _inputs():
    params = tf.init_params(CFG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, CFG.vocab_size)
    return params, tokens


def _saved(policy) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every residual JAX saves for the backward pass (jax.ad_checkpoint's
    print_saved_residuals, read back), the parameters excluded."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        jax.ad_checkpoint.print_saved_residuals(_loss(policy), *_inputs())
    out = []
    for line in buf.getvalue().splitlines():
        m = re.match(r"(\w+)\[([\d,]*)\]", line)
        if m and "from the argument" not in line:
            out.append((m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)))
    return out


def _bytes(saved) -> int:
    return sum(ITEM.get(dt, 4) * math.prod(shape) for dt, shape in saved)


def test_policy_names_and_the_settings_error():
    assert [remat.policy_name(v) for v in (True, False, "none", "full", "selective")] == [
        "full",
        "none",
        "none",
        "full",
        "selective",
    ]
    assert UpdateConfig(remat="selective").remat == "selective"
    with pytest.raises(ValueError, match=r"rl.update.remat='some': expected one of none, full, selective"):
        UpdateConfig(remat="some")


def test_each_policy_keeps_what_it_says():
    """none keeps the MLP's [B, T, F] intermediates; full keeps no [B, T, F] and no per-head
    [B, T, N, H] array; selective keeps each layer's q (and k, v, attention output) but no
    [B, T, F]; so the saved bytes order none > selective > full."""
    F, N, H = CFG.d_ff, CFG.n_heads, CFG.head_dim
    saved = {p: _saved(p) for p in remat.POLICIES}

    def count(p, shape):
        return sum(s == shape for _, s in saved[p])

    assert count("none", (B, T, F)) >= CFG.n_layers
    assert count("full", (B, T, F)) == count("selective", (B, T, F)) == 0
    assert count("full", (B, T, N, H)) == 0
    assert count("selective", (B, T, N, H)) >= 2 * CFG.n_layers  # q and the attention output
    sizes = {p: _bytes(s) for p, s in saved.items()}
    assert sizes["none"] > sizes["selective"] > sizes["full"], sizes


def test_policies_give_the_same_gradient_and_order_the_recompute():
    """The same gradient under every policy (float32 sums in a different order at most); the
    compiled gradient's FLOPs: full recomputes every block (most), selective the norms and MLP,
    none nothing (least)."""
    params, tokens = _inputs()
    grads, flops = {}, {}
    for p in remat.POLICIES:
        fn = jax.jit(jax.grad(_loss(p)))
        grads[p] = fn(params, tokens)
        flops[p] = fn.lower(params, tokens).compile().cost_analysis()
        flops[p] = (flops[p][0] if isinstance(flops[p], list) else flops[p])["flops"]
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(grads["none"]))
    for p in ("full", "selective"):
        for a, b in zip(jax.tree.leaves(grads[p]), jax.tree.leaves(grads["none"])):
            np.testing.assert_allclose(a, b, atol=64 * T * EPS32 * scale)
    assert flops["full"] > flops["selective"] > flops["none"], flops
