"""rollout.draw: the inverse-CDF draw against a float64 NumPy quantile function, its distribution,
its refusal of filtered tokens, and its per-row keys (rollout/sampling.py draw_categorical)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparserl_jax.config import load_config
from sparserl_jax.rollout import sampling
from sparserl_jax.rollout.sampling import INVERSE_CDF_BLOCK, SamplingConfig


def _logp(seed: int, B: int, V: int, scale: float = 3.0) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(B, V)) * scale
    return (x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)).astype(
        np.float32
    )


def _quantile64(u: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """The reference: the first token whose float64 cumulative probability exceeds u."""
    cdf = np.cumsum(np.exp(logp.astype(np.float64)), axis=-1)
    cdf /= cdf[:, -1:]
    return np.array([np.searchsorted(c, x, side="right") for c, x in zip(cdf, u)])


@pytest.mark.parametrize("V", [7, INVERSE_CDF_BLOCK, 3 * INVERSE_CDF_BLOCK + 45])
def test_inverse_cdf_is_the_float64_quantile_away_from_its_boundaries(V):
    B = 64
    logp = _logp(V, B, V)
    u = np.random.default_rng(1).uniform(size=B).astype(np.float32)
    got = np.asarray(jax.jit(sampling.inverse_cdf)(jnp.asarray(u), jnp.asarray(logp)))
    want = _quantile64(u.astype(np.float64), logp)
    # a threshold within float32 rounding of a cumulative boundary may fall either side of it
    cdf = np.cumsum(np.exp(logp.astype(np.float64)), axis=-1)
    cdf /= cdf[:, -1:]
    # float32 sums (one block's exclusive total plus a cumulative sum inside the block): at most
    # C + blocks additions of unit roundoff each, and one rounding per exp, on a total of 1
    blocks = -(-V // INVERSE_CDF_BLOCK)
    slack = 2 * (INVERSE_CDF_BLOCK + blocks + 1) * 2.0**-24
    near = np.array([np.min(np.abs(c - x)) < slack for c, x in zip(cdf, u)])
    assert (got[~near] == want[~near]).all() and (~near).sum() >= B // 2
    assert (np.abs(got - want) <= 1).all()


def test_inverse_cdf_never_draws_a_filtered_token():
    """top-k over a long vocabulary leaves whole blocks of probability 0, and thresholds at every
    quantile, block boundaries and the ends included, still land on a kept token."""
    V, k = 5 * INVERSE_CDF_BLOCK + 3, 6
    logits = jnp.asarray(_logp(3, 4, V))
    logp = sampling.processed_logprobs(logits, SamplingConfig(top_k=k))
    kept = np.isfinite(np.asarray(logp))
    assert (kept.sum(-1) == k).all()
    qs = np.concatenate([np.linspace(0, 1, 2001, endpoint=False), [np.nextafter(np.float32(1), np.float32(0))]])
    fn = jax.jit(jax.vmap(sampling.inverse_cdf, in_axes=(0, None)))
    tokens = np.asarray(fn(jnp.asarray(qs[:, None], jnp.float32).repeat(4, 1), logp))
    rows = np.arange(4)[None, :].repeat(len(qs), 0)
    assert kept[rows, tokens].all()
    # every kept token is reached (the quantile function covers the support)
    for b in range(4):
        assert set(tokens[:, b]) == set(np.flatnonzero(kept[b]))


def test_the_draws_follow_the_distribution():
    """200,000 draws of a 300-token distribution (two blocks) by per-row keys: the counts within a
    chi-square bound that a correct sampler exceeds with probability below 1e-6."""
    V, n = 300, 200_000
    logp = jnp.asarray(_logp(5, 1, V, scale=1.5))
    keys = jax.random.split(jax.random.key(0), n)
    tokens = np.asarray(
        jax.jit(lambda k: sampling.draw_categorical(k, jnp.broadcast_to(logp, (n, V)), "inverse_cdf"))(keys)
    )
    p = np.exp(np.asarray(logp, np.float64))[0]
    p /= p.sum()
    counts = np.bincount(tokens, minlength=V)
    expected = n * p
    big = expected >= 5  # the chi-square approximation's rule; the rest pooled
    chi2 = ((counts[big] - expected[big]) ** 2 / expected[big]).sum()
    pooled_e, pooled_c = expected[~big].sum(), counts[~big].sum()
    chi2 += (pooled_c - pooled_e) ** 2 / max(pooled_e, 1e-9)
    dof = big.sum()  # (bins - 1) with the pooled bin
    # Wilson-Hilferty: chi2_dof's 1 - 1e-6 quantile
    z = 4.753
    bound = dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < bound, (chi2, bound, dof)


def test_a_rows_draw_depends_on_its_key_and_row_only():
    B, V = 8, 700
    logp = jnp.asarray(_logp(7, B, V, scale=0.5))
    keys = jax.random.split(jax.random.key(3), B)
    draw = jax.jit(lambda k, lp: sampling.draw_categorical(k, lp, "inverse_cdf"))
    got = np.asarray(draw(keys, logp))
    perm = np.random.default_rng(0).permutation(B)
    assert (np.asarray(draw(keys[perm], logp[perm])) == got[perm]).all()
    # one key for the batch draws too, and the Gumbel draw is jax.random.categorical's
    assert np.asarray(draw(jax.random.key(1), logp)).shape == (B,)
    gumbel = sampling.draw_categorical(jax.random.key(1), logp, "gumbel")
    assert (np.asarray(gumbel) == np.asarray(jax.random.categorical(jax.random.key(1), logp, axis=-1))).all()


def test_sample_and_sample_kept_use_the_configured_draw():
    B, V = 16, 600
    logits = jnp.asarray(_logp(9, B, V))
    keys = jax.random.split(jax.random.key(4), B)
    cfg = SamplingConfig(temperature=1.0, top_k=5, draw="inverse_cdf")
    tok, lp = sampling.sample(logits, keys, cfg)
    logp = sampling.processed_logprobs(logits, cfg)
    assert np.isfinite(np.asarray(lp)).all()
    np.testing.assert_array_equal(np.asarray(lp), np.asarray(logp)[np.arange(B), np.asarray(tok)])
    tok_k, lp_k, ids = sampling.sample_kept(logits, keys, cfg)
    assert all(int(t) in set(np.asarray(r)) for t, r in zip(tok_k, ids))
    assert np.isfinite(np.asarray(lp_k)).all()


def test_a_bad_draw_names_the_setting():
    with pytest.raises(ValueError, match="rollout.draw='gumbel2'"):
        SamplingConfig(draw="gumbel2")
    with pytest.raises(ValueError, match="rollout.draw"):
        load_config([], ["rollout.draw=cdf"])
