"""Rollout diagnostics: the loop detector, SARS rejections by advantage sign and position (the
update's own accept mask), and their presence in every training iteration's metrics."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from compile_cache import compile_cache_in_process
from fresh_rng import rng_from

from sparserl_jax.config import load_config
from sparserl_jax.rl import config as C
from sparserl_jax.rl import diagnostics as D
from sparserl_jax.rl.corrections.compose import compute_corrections
from sparserl_jax.train import Trainer

SMOKE = os.path.join(os.path.dirname(__file__), "..", "experiments", "configs", "smoke.yaml")


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(tmp_path_factory):
    """The trainer here repeats programs other trainers compiled: with the session's
    compilation cache they compile once (tests/compile_cache.py)."""
    with compile_cache_in_process(tmp_path_factory):
        yield


def _unit(rng, n):
    return [int(t) for t in rng.choice(np.arange(1000, 2000), size=n, replace=False)]


def test_loop_detector():
    rng = rng_from(0)
    u, other = _unit(rng, 12), _unit(rng, 30)
    assert D.has_loop(u + u)
    assert D.has_loop(other[:7] + u + u + other[7:])  # a loop in the middle
    assert not D.has_loop(other)
    near = u + u[:5] + [u[5] + 1] + u[6:]  # one token changed in the copy
    assert not D.has_loop(other[:4] + near + other[4:])
    assert not D.has_loop(u + u[:-1])  # the copy is one token short
    nine = u[:9]
    assert not D.has_loop(nine * 3)  # a 9-token unit: no 10+ token span repeats back to back
    assert D.has_loop(nine * 4)  # ... but 4 copies hold 2 copies of an 18-token span
    assert D.has_loop([7] * 20) and not D.has_loop([7] * 19)
    assert not D.has_loop(u + u, min_repeats=3) and D.has_loop(u * 3, min_repeats=3)
    assert D.has_loop(u + u, min_span=12) and not D.has_loop(u + u, min_span=13)
    periodic = ([5] * 15 + [6]) * 2  # the 10-gram of 5s recurs at distance 1 inside the unit
    assert D.has_loop(periodic) and not D.has_loop(periodic[:-1])


def test_loop_fraction_ignores_padding():
    rng = rng_from(1)
    u, other = _unit(rng, 12), _unit(rng, 40)
    T = 40
    rows = [
        other[:12] + [0] * (T - 12),  # padding beyond the length would look like a loop
        u + u + other[: T - 24],
        (u + u[:5] + [u[5] + 1] + u[6:] + other)[:T],
    ]
    tokens = np.array(rows)
    assert D.loop_fraction(tokens, np.array([12, T, T])) == pytest.approx(1 / 3)
    assert D.loop_fraction(tokens, np.array([T, T, T])) == pytest.approx(2 / 3)
    assert D.loop_fraction(tokens, np.array([12, 23, T])) == 0.0


def test_rejection_diagnostics_hand_computed():
    T = 8
    spans = [(2, 4), (1, 5), (3, 2), (0, 4)]  # (first mask position, response length) per row
    mask = np.zeros((4, T), bool)
    for b, (s, n) in enumerate(spans):
        mask[b, s : s + n] = True
    accept = mask.copy()
    accept[0, [2, 5]] = False  # tokens 0 and 3 of 4
    accept[1, 5] = False  # token 4 of 5
    accept[2] = False  # vetoed: tokens 0 and 1 of 2
    adv = np.array([1.0, -0.5, 0.0, 2.0])
    out = D.rejection_diagnostics(accept, mask, adv)
    assert out["diag/reject_rate_pos_adv"] == pytest.approx(2 / 8)  # rows 0 and 3
    assert out["diag/reject_rate_neg_adv"] == pytest.approx(1 / 5)  # row 1; row 2 has A = 0
    hist = np.array([out[f"diag/reject_pos_{i}"] for i in range(10)])
    # bins floor(10 j / M): row 0 -> 0, 7; row 1 -> 8; row 2 -> 0, 5
    np.testing.assert_allclose(hist, np.array([2, 0, 0, 0, 0, 1, 0, 1, 1, 0]) / 5)  # counts / 5 in float64
    assert hist.sum() == pytest.approx(1.0)

    none = D.rejection_diagnostics(mask, mask, -np.abs(adv) - 1)
    assert none["diag/reject_rate_neg_adv"] == 0.0
    assert none["diag/reject_rate_pos_adv"] == 0.0  # no response with A > 0
    assert all(none[f"diag/reject_pos_{i}"] == 0.0 for i in range(10))


def _random_batch(seed, B=8, T=24):
    """Random response spans, log-probs with a sampler that strays from pi_old (some tokens out of
    SARS's band, one response with a near-impossible token), advantages of both signs."""
    rng = rng_from(seed)
    mask = np.zeros((B, T), bool)
    for b in range(B):
        s = int(rng.integers(0, 6))
        mask[b, s : s + int(rng.integers(4, T - s))] = True
    old = np.log(rng.uniform(0.05, 1.0, (B, T))).astype(np.float32)
    sampler = (old + rng.normal(0.0, 0.4, (B, T))).astype(np.float32)
    b_veto = int(np.nonzero(mask.any(1))[0][0])
    old[b_veto, np.argmax(mask[b_veto])] = sampler[b_veto, np.argmax(mask[b_veto])] - 12.0
    adv = rng.normal(size=B).astype(np.float32)
    tokens = rng.integers(3, 100, (B, T)).astype(np.int32)
    return tokens, mask, sampler, old, adv


@pytest.mark.parametrize(
    "cfg",
    [
        C.RLConfig(mode="sparse_rl"),
        C.RLConfig(mode="sars_only", sars=C.SarsConfig(veto_level="geometric", veto_threshold=0.6)),
        C.RLConfig(mode="sparse_rl", ibr=C.IbrConfig(mode="mask", lo=0.8, hi=1.2)),  # rejects more
        C.RLConfig(mode="dense"),
    ],
    ids=["sparse_rl", "sars_geometric", "ibr_mask", "dense"],
)
def test_rollout_diagnostics_use_the_update_accept_mask(cfg):
    tokens, mask, sampler, old, adv = _random_batch(2)
    out = D.rollout_diagnostics(tokens, mask, sampler, old, adv, cfg)
    assert set(out) == set(D.DIAGNOSTIC_KEYS)
    # the corrections at the first minibatch (learner = pi_old), as micro_batch_loss builds them
    corr = compute_corrections(
        jnp.asarray(old), jnp.asarray(old), jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask), cfg
    )
    accept, veto = np.asarray(corr.accept), np.asarray(corr.veto)
    expected = D.rejection_diagnostics(accept, mask, adv)
    for k, v in expected.items():  # the same accept mask through the same function: exact
        assert out[k] == pytest.approx(v, abs=1e-7), k  # (a differing mask moves a rate >= 1/192)
    rejected = (mask & ~accept).sum()
    if cfg.mode == "dense":
        assert rejected == 0 and out["diag/reject_rate_pos_adv"] == 0.0
    else:
        assert 0 < rejected < mask.sum() and veto.any()
        assert out["diag/reject_rate_pos_adv"] > 0 and out["diag/reject_rate_neg_adv"] > 0


def test_response_tokens_follow_the_batch_layout():
    tokens = np.array([[11, 12, 13, 21, 22, 0], [11, 21, 22, 23, 24, 0]])
    mask = np.array([[0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]], bool)  # t scores tokens[t + 1]
    resp, lengths = D.response_tokens(tokens, mask)
    assert lengths.tolist() == [2, 4]
    assert resp[0, :2].tolist() == [21, 22] and resp[1, :4].tolist() == [21, 22, 23, 24]


def test_every_iteration_logs_the_diagnostics(tmp_path):
    cfg = load_config(
        [SMOKE], [f"train.out_dir={tmp_path}", "train.progress=false", "sft.steps=2", "train.iterations=2"]
    )
    history = Trainer(cfg).run()
    assert len(history) == 2
    for h in history:
        missing = [k for k in D.DIAGNOSTIC_KEYS if k not in h]
        assert not missing, missing
        assert all(np.isfinite(h[k]) for k in D.DIAGNOSTIC_KEYS)
        assert h["time/diagnostics_s"] >= 0
        hist = sum(h[f"diag/reject_pos_{i}"] for i in range(D.N_BINS))
        assert hist == pytest.approx(1.0 if h["sars/token_reject_rate"] > 0 else 0.0)


def test_agreement_is_one_minus_total_variation_over_the_candidates():
    """Sparrow's per-token acceptance rate sum_v min(p_s, p_d): over the whole vocabulary it is
    1 - TV (its bounds meet); over fewer candidates the bounds hold the exact value between them;
    a dense sampler (p_s = p_d) has upper bound 1."""
    from sparserl_jax.rl.diagnostics import agreement, agreement_metrics

    rng = np.random.default_rng(0)
    V, A = 50, 8
    ls = rng.standard_normal((3, 4, V)) * 2
    ld = ls + 0.5 * rng.standard_normal((3, 4, V))
    ps = np.exp(ls) / np.exp(ls).sum(-1, keepdims=True)
    pd = np.exp(ld) / np.exp(ld).sum(-1, keepdims=True)
    exact = 1.0 - 0.5 * np.abs(ps - pd).sum(-1)
    every = np.broadcast_to(np.arange(V), (3, 4, V))
    lo, hi = agreement(every, np.log(ps), np.log(pd))
    np.testing.assert_allclose(lo, exact, rtol=1e-12)
    np.testing.assert_allclose(hi, exact, rtol=1e-12)
    top = np.argsort(-ps, axis=-1)[..., :A]
    lo, hi = agreement(top, np.log(np.take_along_axis(ps, top, -1)), np.log(np.take_along_axis(pd, top, -1)))
    assert np.all(lo <= exact + 1e-12) and np.all(exact <= hi + 1e-12) and np.all(lo < exact)
    lo, hi = agreement(top, np.log(np.take_along_axis(ps, top, -1)), np.log(np.take_along_axis(ps, top, -1)))
    np.testing.assert_allclose(hi, 1.0)
    top[0, 0, 3:] = -1  # fewer candidates count less
    assert (
        agreement(top, np.log(np.take_along_axis(ps, top, -1)), np.log(np.take_along_axis(pd, top, -1)))[0][0, 0]
        < lo[0, 0]
    )
    mask = np.ones((3, 4), bool)
    m = agreement_metrics(every, np.log(ps), np.log(pd), mask)
    assert m["agreement/p5"] == pytest.approx(np.quantile(exact, 0.05))
    assert m["agreement/mean"] == pytest.approx(exact.mean()) == m["agreement/upper_mean"]
