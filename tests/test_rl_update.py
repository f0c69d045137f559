"""The jitted update step on a tiny model: finite gradients, skipping of non-finite steps,
micro-batch accumulation equal to the big-batch gradient, the scorer, the batch layout and the
optimizer. One update function is compiled and shared (model gradients compile slowly on CPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sparserl_jax import rl
from sparserl_jax.model import transformer
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rl import batch as batch_lib
from sparserl_jax.rl import update as update_lib
from sparserl_jax.rl.corrections import compose

MC = ModelConfig.tiny()
# tests here share compiled functions: keep them on one xdist worker (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("rl_update")
B, P, M = 8, 4, 8
T = P + M
CFG = rl.RLConfig(
    mode="sparse_rl",
    ibr=rl.IbrConfig(normalisation="global"),
    loss=rl.LossConfig(aggregation="token_mean", beta=0.01),
    update=rl.UpdateConfig(
        minibatch_size=4,
        micro_batch_size=2,
        temperature=0.9,
        remat=True,
        chunk_tokens=16,
        score_batch_size=3,
    ),
)
# plain SGD (update = -grad) with a step counter, so a parameter delta is the gradient itself


def key(seed):
    """A fresh jax.random key; the RBG generator compiles much faster than threefry on CPU."""
    return jax.random.key(seed, impl="rbg")


SGD_COUNTING = optax.chain(optax.sgd(1.0), optax.scale_by_schedule(lambda count: 1.0))


@jax.jit
def _random_rollout(key):
    """Random prompts and responses of random lengths (some empty), packed; noise, advantages.
    One uniform draw feeds everything (a single RNG call compiles fast on CPU)."""
    u = jax.random.uniform(key, (6, B, T))

    def ints(x, lo, hi):
        return (lo + x * (hi - lo)).astype(jnp.int32)  # in [lo, hi)

    prompts = ints(u[0, :, :P], 1, MC.vocab_size)
    resp = ints(u[1, :, :M], 1, MC.vocab_size)
    plens = ints(u[2, :, 0], 1, P + 1).at[2].set(1)
    rlens = ints(u[2, :, 1], 0, M + 1).at[0].set(M).at[1].set(0)
    rmask = jnp.arange(M)[None] < rlens[:, None]
    # log-probs in [-3, -0.1] on a grid of 1/1024, so every path through the program computes the
    # same bits (XLA may compute an expression twice in one program, once fused with an FMA)
    rlogp = -(102.0 + jnp.floor(2868.0 * u[3, :, :M])) / 1024.0
    packed = batch_lib.assemble(prompts, plens, resp, rlogp, rmask)
    raw = (prompts, plens, resp, rlens, rlogp)
    noise = 0.4 * jnp.sqrt(12.0) * (u[4] - 0.5)  # zero mean, std 0.4
    return packed, raw, noise, 2.0 * u[5, :, 0] - 1.0


@functools.partial(jax.jit, static_argnums=0)
def random_params(cfg, key):
    """Params with init_params' structure and scale (normal, std 0.02; norms near 1), drawn in
    one RNG call: init_params' many draws take seconds to compile on CPU."""
    shapes = jax.eval_shape(functools.partial(transformer.init_params, cfg), key)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    z = jax.random.normal(key, (sum(leaf.size for _, leaf in paths_leaves),))
    out, i = [], 0
    for path, leaf in paths_leaves:
        x = z[i : i + leaf.size].reshape(leaf.shape)
        i += leaf.size
        is_norm = "norm" in jax.tree_util.keystr(path)
        out.append((1.0 + 0.1 * x if is_norm else 0.02 * x).astype(leaf.dtype))
    return jax.tree.unflatten(treedef, out)


@functools.cache
def setup():
    k_params, k_ref, k_data = jax.random.split(key(0), 3)
    params, ref_params = random_params(MC, k_params), random_params(MC, k_ref)
    packed, _, noise, adv = _random_rollout(k_data)
    score = update_lib.make_score_fn(MC, CFG.update)
    old = score(params, packed["tokens"])
    # the sampler log-probs: the scored dense ones plus a sparsity mismatch
    sampler = jnp.where(packed["response_mask"], old + noise, 0.0)
    batch = dict(
        packed,
        sampler_logp=sampler,
        old_logp=old,
        ref_logp=score(ref_params, packed["tokens"]),
        advantages=adv,
    )
    upd = update_lib.make_update_fn(MC, CFG, SGD_COUNTING)
    return params, batch, upd, score


def run(batch):
    params, _, upd, _ = setup()
    opt_state = SGD_COUNTING.init(params)
    new_params, new_state, metrics = upd(params, opt_state, batch)
    return params, new_params, new_state, {k: float(v) for k, v in metrics.items()}


def count(state):
    return int(state[1].count)


def test_update_step_is_finite_and_moves_params():
    _, batch, upd, _ = setup()
    assert hasattr(upd, "lower")  # a jitted function
    params, new_params, state, m = run(batch)
    assert m["skipped"] == 0 and m["steps"] == 2 and count(state) == 2
    for k in ("loss", "grad_norm", "loss/pg", "loss/entropy", "mismatch/kl_k3", "ibr/normaliser"):
        assert np.isfinite(m[k]), k
    assert m["grad_norm"] > 0
    assert 0 < m["sars/token_reject_rate"] < 1  # the mismatch makes SARS reject some tokens
    for p0, p1 in zip(jax.tree.leaves(params), jax.tree.leaves(new_params)):
        assert np.all(np.isfinite(np.asarray(p1)))
        assert not np.array_equal(np.asarray(p0), np.asarray(p1))


def test_nan_batch_is_skipped():
    _, batch, _, _ = setup()
    nan_batch = dict(batch, advantages=jnp.full_like(batch["advantages"], jnp.nan))
    params, new_params, state, m = run(nan_batch)
    assert m["skipped"] == 2 and count(state) == 0
    for p0, p1 in zip(jax.tree.leaves(params), jax.tree.leaves(new_params)):
        np.testing.assert_array_equal(np.asarray(p0), np.asarray(p1))


def test_micro_batch_accumulation_equals_big_batch_gradient():
    """Minibatch 1 of 2 clean, minibatch 2 NaN (skipped: skipped = 1): the parameter change of
    the one SGD step is minus the accumulated gradient over micro-batches of 2, which must equal
    the gradient of the loss over the whole minibatch of 4 computed in one pass."""
    params, batch, _, _ = setup()
    half_nan = dict(batch, advantages=batch["advantages"].at[4:].set(jnp.nan))
    _, new_params, state, m = run(half_nan)
    assert m["skipped"] == 1 and count(state) == 1
    delta = jax.tree.map(lambda a, b: a - b, params, new_params)

    mb1 = {k: v[:4] for k, v in batch.items()}
    norm = compose.weight_normaliser(
        compose.behaviour(batch["old_logp"], batch["sampler_logp"], batch["response_mask"], CFG), CFG
    )  # global: over all 8 responses
    big_cfg = rl.RLConfig(
        mode=CFG.mode,
        ibr=CFG.ibr,
        loss=CFG.loss,
        update=rl.UpdateConfig(minibatch_size=4, micro_batch_size=4, temperature=0.9),
    )
    grad = jax.jit(jax.grad(lambda p: update_lib.micro_batch_loss(p, mb1, MC, big_cfg, weight_norm=norm)[0]))(params)
    for d, g in zip(jax.tree.leaves(delta), jax.tree.leaves(grad)):
        np.testing.assert_allclose(np.asarray(d), np.asarray(g), rtol=2e-4, atol=2e-7)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grad)) > 1e-4


def test_score_matches_token_logprobs():
    params, batch, _, score = setup()
    got = score(params, batch["tokens"][:7])  # 7 rows in chunks of 3
    want, _ = jax.jit(lambda p, t: transformer.token_logprobs(p, MC, t, temperature=0.9))(params, batch["tokens"][:7])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert got.shape == (7, T)


def test_batch_layout():
    """tokens = prompt + response; position t of every [B, T] array scores tokens[t + 1]."""
    k_data = jax.random.split(key(0), 3)[2]
    out, (prompts, plens, resp, rlens, rlogp), _, _ = _random_rollout(k_data)
    tok, mask, slp = (np.asarray(out[k]) for k in ("tokens", "response_mask", "sampler_logp"))
    prompts, plens, resp, rlens, rlogp = map(np.asarray, (prompts, plens, resp, rlens, rlogp))
    assert (rlens == 0).any() and (plens == 1).any()  # the edge cases are covered
    assert tok.shape == mask.shape == slp.shape == (B, T)
    for b in range(B):
        p, n = plens[b], rlens[b]
        np.testing.assert_array_equal(tok[b, :p], prompts[b, :p])
        np.testing.assert_array_equal(tok[b, p : p + n], resp[b, :n])
        assert np.all(tok[b, p + n :] == 0)
        want_mask = np.zeros(T, bool)
        want_mask[p - 1 : p + n - 1] = True
        np.testing.assert_array_equal(mask[b], want_mask)
        for j in range(n):
            t = p - 1 + j
            assert tok[b, t + 1] == resp[b, j] and slp[b, t] == rlogp[b, j]
        assert np.all(slp[b, ~want_mask] == 0)
    np.testing.assert_array_equal(
        np.asarray(batch_lib.response_mask_from_lengths(jnp.asarray(plens), jnp.asarray(plens + rlens), T)),
        mask,
    )


def test_bad_batches_raise():
    params, batch, upd, _ = setup()
    state = SGD_COUNTING.init(params)
    with pytest.raises(ValueError, match="missing keys.*ref_logp"):
        upd(params, state, {k: v for k, v in batch.items() if k != "ref_logp"})
    with pytest.raises(ValueError, match="update.minibatch_size=4"):
        upd(params, state, {k: v[:6] for k, v in batch.items()})
    with pytest.raises(ValueError, match="advantages"):
        upd(params, state, dict(batch, advantages=batch["advantages"][:, None]))


def test_optimizer_and_schedules():
    cfg = rl.OptimConfig(lr=0.1, weight_decay=0.1, grad_clip=1.0)
    opt = rl.make_optimizer(cfg)
    p = {"w": jax.random.normal(key(4), (3, 4))}
    state = opt.init(p)
    opt_update = jax.jit(opt.update)
    # zero gradient: only decoupled weight decay acts, p <- p - lr * wd * p
    upd, _ = opt_update({"w": jnp.zeros((3, 4))}, state, p)
    np.testing.assert_allclose(np.asarray(upd["w"]), -0.1 * 0.1 * np.asarray(p["w"]), rtol=1e-5)
    # a huge gradient is clipped to norm 1 before Adam: the same step as the clipped gradient
    g = 1e4 * jax.random.normal(key(5), (3, 4))
    u_big, _ = opt_update({"w": g}, state, p)
    u_unit, _ = opt_update({"w": g / jnp.linalg.norm(g)}, state, p)
    np.testing.assert_allclose(np.asarray(u_big["w"]), np.asarray(u_unit["w"]), rtol=1e-5)

    const = rl.make_schedule(rl.OptimConfig(lr=1e-3))
    assert float(const(0)) == float(const(1000)) == pytest.approx(1e-3)
    warm = rl.make_schedule(rl.OptimConfig(lr=1e-3, schedule="warmup", warmup_steps=10))
    assert float(warm(0)) == 0.0 and float(warm(5)) == pytest.approx(5e-4)
    assert float(warm(10)) == float(warm(500)) == pytest.approx(1e-3)
    cos = rl.make_schedule(
        rl.OptimConfig(lr=1e-3, schedule="cosine", warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    )
    assert float(cos(5)) == pytest.approx(5e-4)
    assert float(cos(10)) == pytest.approx(1e-3)
    assert float(cos(60)) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4), rel=1e-4)
    assert float(cos(110)) == pytest.approx(1e-4, rel=1e-4)
    cos0 = rl.make_schedule(rl.OptimConfig(lr=1e-3, schedule="cosine", total_steps=100))
    assert float(cos0(0)) == pytest.approx(1e-3) and float(cos0(100)) == pytest.approx(0.0)
