"""Properties of the correction module: xi, r, SARS, IBR, TIS, ACR and the mismatch metrics."""

import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float_tol import EPS32, sum_tol

from sparserl_jax.config_io import from_dict
from sparserl_jax.rl import config as C
from sparserl_jax.rl import loss as loss_lib
from sparserl_jax.rl.corrections import CORRECTIONS, Correction, compose
from sparserl_jax.rl.corrections.ibr import IBR_MODES
from sparserl_jax.rl.corrections.xi import LEVELS

B, T = 8, 10
# tests here share compiled functions: keep them on one xdist worker (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("rl_corrections")


@jax.jit
def _inputs(key, scale):
    k = jax.random.split(key, 6)
    old = -jax.random.uniform(k[0], (B, T), minval=0.05, maxval=4.0)
    sampler = old + scale * jax.random.normal(k[1], (B, T))
    learner = old + 0.3 * jax.random.normal(k[2], (B, T))
    ref = old + 0.2 * jax.random.normal(k[3], (B, T))
    lengths = jax.random.randint(k[4], (B,), 1, T - 1)
    start = jax.random.randint(k[5], (B,), 0, 2)
    t = jnp.arange(T)[None]
    mask = (t >= start[:, None]) & (t < start[:, None] + lengths[:, None])
    return dict(learner=learner, old=old, ref=ref, sampler=sampler, mask=mask)


def inputs(seed, scale=0.5):
    return _inputs(jax.random.key(seed, impl="rbg"), scale)


@functools.partial(jax.jit, static_argnums=1, static_argnames="with_metrics")
def corr(inp, cfg, weight_norm=None, with_metrics=False):
    return compose.compute_corrections(
        inp["learner"],
        inp["old"],
        inp["ref"],
        inp["sampler"],
        inp["mask"],
        cfg,
        weight_norm=weight_norm,
        with_metrics=with_metrics,
    )


@functools.partial(jax.jit, static_argnums=1)
def corr_many(inp, cfgs):
    return [
        compose.compute_corrections(
            inp["learner"],
            inp["old"],
            inp["ref"],
            inp["sampler"],
            inp["mask"],
            c,
            with_metrics=False,
        )
        for c in cfgs
    ]


def np_(x):
    return np.asarray(x)


ALL_MODE_CFGS = tuple(
    C.RLConfig(
        mode=m,
        acr=C.AcrConfig(enabled=True),
        sars=C.SarsConfig(token_level=LEVELS[i % 3], veto_level=LEVELS[(i + 1) % 3]),
    )
    for i, m in enumerate(list(C.RL_MODES) + ["sparse_rl", "sparse_rl"])
)
# one config with every correction on, for the metrics
FULL = C.RLConfig(mode="sparse_rl", acr=C.AcrConfig(enabled=True, c=1.2))


def test_sampler_equal_old_changes_nothing():
    inp = inputs(0)
    inp = dict(inp, sampler=inp["old"])
    mask = np_(inp["mask"])
    for _cfg, c in zip(ALL_MODE_CFGS, corr_many(inp, ALL_MODE_CFGS)):
        np.testing.assert_array_equal(np_(c.xi), 1.0)
        np.testing.assert_array_equal(np_(c.accept), mask)
        np.testing.assert_array_equal(np_(c.veto), False)
        # xi = 1 exactly: every weight is 1 (or 1 / mean of ones = 1), exact
        np.testing.assert_allclose(np_(c.weight), mask.astype(np.float32), rtol=1e-6)
        np.testing.assert_array_equal(np_(c.r_acr), 1.0)
    m = {k: float(v) for k, v in corr(inp, FULL, with_metrics=True).metrics.items()}
    for k in (
        "mismatch/kl_k1",
        "mismatch/kl_k3",
        "mismatch/abs_dlogp_max",
        "weights/trunc_frac",
        "sars/token_reject_rate",
        "sars/seq_reject_rate",
        "sars/veto_rate",
        "acr/active_frac",
    ):
        assert m[k] == 0.0, k
    assert m["xi/p5"] == m["xi/p50"] == m["xi/p95"] == 1.0


def test_ratios_xi_and_r():
    inp = inputs(1)
    c = corr(inp, C.RLConfig(mode="naive_sparse"))
    mask = np_(inp["mask"])
    old, sampler, learner, ref = (np_(inp[k]) for k in ("old", "sampler", "learner", "ref"))
    np.testing.assert_allclose(np_(c.xi), np.where(mask, np.exp(old - sampler), 1.0), rtol=1e-5)
    np.testing.assert_allclose(np_(c.r), np.where(mask, np.exp(learner - old), 1.0), rtol=1e-5)
    # one float32 subtraction of the same float32 inputs (|q| < 3): one rounding, <= 1.8e-7
    np.testing.assert_allclose(np_(c.kl_q), np.where(mask, ref - learner, 0.0), atol=1e-6)
    # naive sparse: no weights and no rejections even though xi != 1
    np.testing.assert_array_equal(np_(c.accept), mask)
    np.testing.assert_array_equal(np_(c.weight), mask.astype(np.float32))
    assert np.abs(np_(c.xi) - 1)[mask].max() > 0.5


def test_log_ratios_clamped_and_padding_ignored():
    inp = inputs(2)
    mask = inp["mask"]
    sampler = jnp.where(mask, inp["old"] - 50.0, jnp.nan)  # xi = e^50, and NaN in the padding
    learner = jnp.where(mask, inp["old"] + 30.0, jnp.inf)
    inp = dict(inp, sampler=sampler, learner=learner, ref=jnp.where(mask, inp["ref"], jnp.nan))
    for cfg in (C.RLConfig(mode="ibr_only"), C.RLConfig(mode="qurl")):
        c = corr(inp, cfg)
        for leaf in jax.tree.leaves(c):
            assert np.all(np.isfinite(np_(leaf)))
        m = np_(mask)
        np.testing.assert_allclose(np_(c.xi)[m], np.exp(20.0), rtol=1e-5)
        np.testing.assert_allclose(np_(c.r)[m], np.exp(20.0), rtol=1e-5)
        np.testing.assert_allclose(np_(c.kl_q)[m], -20.0)  # clamped to log_ratio_clamp: exact


@pytest.mark.parametrize("level", LEVELS)
def test_veto_fires_exactly_below_threshold(level):
    thr = 1e-4
    cfg = C.RLConfig(mode="sars_only", sars=C.SarsConfig(token_rule=False, veto_level=level))
    for seed in range(4):
        inp = inputs(10 + seed, scale=0.3)
        mask = np_(inp["mask"])
        key = jax.random.key(100 + seed, impl="rbg")
        # push each row's ratio at this level to threshold * exp(delta), |delta| in [0.05, 1]
        delta = np_(jax.random.uniform(key, (B,), minval=0.05, maxval=1.0))
        delta = delta * np.where(np.arange(B) % 2 == 0, -1, 1)
        log_xi = np_(inp["old"] - inp["sampler"])
        target = np.log(thr) + delta
        shift = np.zeros((B, T), np.float32)
        for i in range(B):
            idx = np.nonzero(mask[i])[0]
            if level == "token":
                j = idx[seed % len(idx)]
                shift[i, j] = log_xi[i, j] - target[i]
                # keep the other tokens above the threshold
            elif level == "sequence":
                shift[i, idx[0]] = log_xi[i, idx].sum() - target[i]
            else:
                shift[i, idx] = log_xi[i, idx].mean() - target[i]
        inp = dict(inp, sampler=inp["sampler"] + shift)
        c = corr(inp, cfg)
        lx = np_(inp["old"] - inp["sampler"]).astype(np.float64)
        want = np.zeros(B, bool)
        for i in range(B):
            idx = np.nonzero(mask[i])[0]
            v = {
                "token": np.exp(lx[i, idx]).min(),
                "sequence": np.exp(lx[i, idx].sum()),
                "geometric": np.exp(lx[i, idx].mean()),
            }[level]
            want[i] = v < thr
        assert want.any() and not want.all()
        np.testing.assert_array_equal(np_(c.veto), want)
        np.testing.assert_array_equal(np_(c.accept), mask & ~want[:, None])


@pytest.mark.parametrize("level", LEVELS)
def test_token_band(level):
    cfg = C.RLConfig(mode="sars_only", sars=C.SarsConfig(veto=False, token_level=level))
    inp = inputs(3, scale={"token": 0.4, "sequence": 0.3, "geometric": 1.0}[level])
    c = corr(inp, cfg)
    mask = np_(inp["mask"])
    lx = np.where(mask, np_(inp["old"] - inp["sampler"]), 0.0).astype(np.float64)
    if level == "token":
        ratio = np.exp(lx)
    elif level == "sequence":
        ratio = np.repeat(np.exp(lx.sum(1, keepdims=True)), T, 1)
    else:
        ratio = np.repeat(np.exp(lx.sum(1, keepdims=True) / mask.sum(1, keepdims=True)), T, 1)
    want = mask & (ratio >= 0.5) & (ratio <= 1.5)
    np.testing.assert_array_equal(np_(c.accept), want)
    assert 0 < want.sum() < mask.sum()
    if level != "token":  # whole responses go
        assert np.all(want.any(1) == (want.sum(1) == mask.sum(1)))


@pytest.mark.parametrize("ibr_mode", IBR_MODES)
def test_ibr_weights_and_normalisation(ibr_mode):
    inp = inputs(4, scale=0.5)
    mask = np_(inp["mask"])
    xi = np.exp(np_(inp["old"] - inp["sampler"]).astype(np.float64))
    in_range = (xi >= 0.5) & (xi <= 1.5)
    raw = {"truncate": np.minimum(xi, 1.5), "clip": np.clip(xi, 0.5, 1.5), "mask": xi}[ibr_mode]
    cfgs = tuple(
        C.RLConfig(mode="ibr_only", ibr=C.IbrConfig(mode=ibr_mode, normalisation=n)) for n in ("micro_batch", "none")
    )
    normed, unnormed = corr_many(inp, cfgs)
    # "mask" mode (mask_rejects, the authors'): out-of-range tokens leave the loss altogether
    acc = mask & in_range if ibr_mode == "mask" else mask
    np.testing.assert_array_equal(np_(normed.accept), acc)
    np.testing.assert_allclose(np_(unnormed.weight), np.where(acc, raw, 0.0), rtol=1e-5)
    # normalised over every valid token (the authors' loss masks), proportions kept
    w = np_(normed.weight)
    np.testing.assert_allclose(w, np.where(acc, raw / raw[mask].mean(), 0.0), rtol=1e-5)
    assert 0 < np.mean((np.minimum(xi, 1.5) != xi)[mask]) < 1
    if ibr_mode == "truncate":  # a given (global) normaliser is used as is
        given = corr(inp, cfgs[0], jnp.float32(2.0))
        np.testing.assert_allclose(np_(given.weight), np.where(mask, raw / 2.0, 0.0), rtol=1e-5)


def test_ibr_mask_mode_without_rejection_keeps_tokens_at_weight_zero():
    inp = inputs(4, scale=0.5)
    mask = np_(inp["mask"])
    xi = np.exp(np_(inp["old"] - inp["sampler"]).astype(np.float64))
    raw = np.where((xi >= 0.5) & (xi <= 1.5), xi, 0.0)
    cfg = C.RLConfig(mode="ibr_only", ibr=C.IbrConfig(mode="mask", mask_rejects=False, normalise_over="accepted"))
    c = corr(inp, cfg)
    np.testing.assert_array_equal(np_(c.accept), mask)
    np.testing.assert_allclose(np_(c.weight), np.where(mask, raw / raw[mask].mean(), 0.0), rtol=1e-5)
    assert 0 < (raw[mask] == 0).sum() < mask.sum()


def test_normaliser_over_valid_or_accepted_tokens_with_sars():
    cfg = C.RLConfig(mode="sparse_rl", sars=C.SarsConfig(token_level="geometric"))
    cfg_acc = C.RLConfig(
        mode="sparse_rl", sars=C.SarsConfig(token_level="geometric"), ibr=C.IbrConfig(normalise_over="accepted")
    )
    inp = inputs(5, scale=0.6)
    c, c_acc = corr_many(inp, (cfg, cfg_acc))
    acc, mask = np_(c.accept), np_(inp["mask"])
    assert 0 < acc.sum() < mask.sum()
    xi = np_(c.xi).astype(np.float64)
    w_raw = np.minimum(xi, 1.5)
    # authors: the mean over every valid token, rejected ones included
    np.testing.assert_allclose(np_(c.weight), np.where(acc, w_raw / w_raw[mask].mean(), 0), rtol=1e-5)
    # "accepted": the accepted weights average exactly 1
    # two float32 means over <= B T = 80 weights (the normaliser's, this one): 80 EPS32 = 9.5e-6
    assert np_(c_acc.weight)[acc].mean() == pytest.approx(1.0, rel=1e-5)
    assert np.all(np_(c.weight)[~acc] == 0) and np.all(np_(c_acc.weight)[~acc] == 0)
    norm = jax.jit(lambda o, s, k: compose.weight_normaliser(compose.behaviour(o, s, k, cfg), cfg))(
        inp["old"], inp["sampler"], inp["mask"]
    )
    assert float(norm) == pytest.approx(w_raw[mask].mean(), rel=1e-5)
    # the weights are constants for autodiff
    g = jax.jit(
        jax.grad(
            lambda old, s: jnp.sum(
                compose.compute_corrections(
                    inp["learner"], old, inp["ref"], s, inp["mask"], cfg, with_metrics=False
                ).weight
            ),
            argnums=(0, 1),
        )
    )
    for gi in g(inp["old"], inp["sampler"]):
        assert np.all(np_(gi) == 0)


def test_tis_weights():
    inp = inputs(6, scale=0.8)
    c = corr(inp, C.RLConfig(mode="tis", tis=C.TisConfig(cap=1.4)))
    mask = np_(inp["mask"])
    xi = np.exp(np_(inp["old"] - inp["sampler"]))
    np.testing.assert_allclose(np_(c.weight), np.where(mask, np.minimum(xi, 1.4), 0), rtol=1e-5)
    np.testing.assert_array_equal(np_(c.accept), mask)  # TIS rejects nothing
    np.testing.assert_array_equal(np_(c.r_acr), 1.0)  # and has no ACR


def test_acr_moves_only_the_upper_bound_where_rho_exceeds_c():
    c_val, eps = 1.3, 0.2
    inp = inputs(7, scale=0.6)
    no_kl = C.LossConfig(beta=0.0, aggregation="token_mean")
    cfg = C.RLConfig(mode="qurl", tis=C.TisConfig(cap=c_val), acr=C.AcrConfig(c=c_val), loss=no_kl)
    tis_cfg = C.RLConfig(mode="tis", tis=C.TisConfig(cap=c_val), loss=no_kl)
    c, c_tis = corr_many(inp, (cfg, tis_cfg))
    mask = np_(inp["mask"])
    xi = np_(c.xi)
    big = mask & (xi > c_val)
    assert big.any() and (mask & ~big).any()
    np.testing.assert_array_equal(np_(c.r_acr)[~big], 1.0)
    # C / xi in float32 against float64: C's rounding to float32 and the division's, <= 2u
    np.testing.assert_allclose(np_(c.r_acr)[big], c_val / xi[big], rtol=1e-6)

    # ratios set inside (1 + eps, (1 + eps) * rho / C): clipped by TIS, not by QuRL, for A > 0
    upper_acr = (1 + eps) * np.maximum(xi / c_val, 1.0)
    r_mid = np.where(big, 0.5 * ((1 + eps) + upper_acr), 1.0 + eps + 0.05)
    learner = inp["old"] + jnp.log(jnp.asarray(r_mid, jnp.float32))
    adv_pos = jnp.where(inp["mask"], 1.0, 0.0)

    @functools.partial(jax.jit, static_argnums=0)
    def grads_both(cfg_, adv, learner_):
        def f(lp):
            cc = compose.compute_corrections(
                lp, inp["old"], inp["ref"], inp["sampler"], inp["mask"], cfg_, with_metrics=False
            )
            return loss_lib.policy_loss(cc, adv, None, cfg_.loss)[0]

        return jax.grad(f)(learner_)

    def grads(cfg_, adv, learner_):
        return np_(grads_both(cfg_, adv, learner_))

    g_acr, g_tis = grads(cfg, adv_pos, learner), grads(tis_cfg, adv_pos, learner)
    assert np.all(g_acr[big] != 0) and np.all(g_tis[big] == 0)
    # where rho <= C the two objectives agree (both gradients are exactly 0 there: next line)
    np.testing.assert_allclose(g_acr[mask & ~big], g_tis[mask & ~big], rtol=1e-6)
    assert np.all(g_acr[mask & ~big] == 0)
    # the lower bound never moves: r < 1 - eps with A < 0 is clipped under both
    learner_low = inp["old"] + jnp.log(0.7)
    g_acr, g_tis = grads(cfg, -adv_pos, learner_low), grads(tis_cfg, -adv_pos, learner_low)
    assert np.all(g_acr[mask] == 0) and np.all(g_tis[mask] == 0)


def test_metrics_match_numpy():
    inp = inputs(8, scale=0.7)
    t0 = int(np.argmax(np_(inp["mask"])[2]))
    inp = dict(inp, sampler=inp["sampler"].at[2, t0].add(12.0))  # one vetoed response
    m = {k: float(v) for k, v in corr(inp, FULL, with_metrics=True).metrics.items()}
    m_direct = jax.jit(compose.mismatch_metrics, static_argnums=3)(inp["old"], inp["sampler"], inp["mask"], FULL)
    mask = np_(inp["mask"])
    lx = np.where(mask, np_(inp["old"]) - np_(inp["sampler"]), 0.0).astype(np.float64)
    d, xi = lx[mask], np.exp(lx[mask])
    # two programs may sum the n <= B T masked terms of a mean in another order: a mean moves by
    # sum_tol(n, sum |term|) / n, n EPS32 relative for positive terms; k1's have both signs
    n = int(mask.sum())
    k1_tol = sum_tol(n, np.abs(d).sum()) / n
    assert {k: float(v) for k, v in m_direct.items()} == pytest.approx(m, rel=n * EPS32, abs=k1_tol)
    # float32 against float64: the same sum's rounding, plus one per float32 difference d
    assert m["mismatch/kl_k1"] == pytest.approx(np.mean(-d), rel=1e-4, abs=2 * k1_tol)
    assert m["mismatch/kl_k3"] == pytest.approx(np.mean(xi - d - 1), rel=1e-4)
    assert m["mismatch/abs_dlogp_mean"] == pytest.approx(np.abs(d).mean(), rel=1e-5)
    assert m["mismatch/abs_dlogp_max"] == pytest.approx(np.abs(d).max(), rel=1e-5)
    for p in (5, 50, 95):
        assert m[f"xi/p{p}"] == pytest.approx(np.quantile(xi, p / 100), rel=1e-5)
    assert m["xi/p5"] < m["xi/p50"] < m["xi/p95"]
    # SARS rates from the token band [0.5, 1.5] and the veto at 1e-4
    xi_all = np.exp(lx)
    veto = (mask & (xi_all < 1e-4)).any(1)
    acc = mask & (xi_all >= 0.5) & (xi_all <= 1.5) & ~veto[:, None]
    has = mask.any(1)
    assert veto.sum() == 1
    # rates are count ratios: one float32 rounding (6e-8 relative) within approx's 1e-6
    assert m["sars/veto_rate"] == pytest.approx(veto.sum() / has.sum())
    assert m["sars/token_reject_rate"] == pytest.approx(1 - acc.sum() / mask.sum(), rel=1e-5)
    assert m["sars/seq_reject_rate"] == pytest.approx((has & ~acc.any(1)).sum() / has.sum())
    assert m["weights/trunc_frac"] == pytest.approx(np.mean(xi_all[acc] > 1.5), abs=1e-6)
    assert m["acr/active_frac"] == pytest.approx(np.mean(xi > 1.2), rel=1e-5)
    assert m["acr/active_frac"] > 0


BAD_SETTINGS = (
    (C.RLConfig, dict(mode="bogus"), r"rl\.mode='bogus'.*sparse_rl"),
    (C.SarsConfig, dict(token_level="word"), r"sars\.token_level"),
    (C.SarsConfig, dict(veto_level="batch"), r"sars\.veto_level"),
    (C.SarsConfig, dict(token_lo=1.5, token_hi=0.5), r"sars\.token_hi"),
    (C.IbrConfig, dict(normalisation="batch"), r"ibr\.normalisation.*global"),
    (C.IbrConfig, dict(mode="soft"), r"ibr\.mode"),
    (C.IbrConfig, dict(normalise_over="tokens"), r"ibr\.normalise_over='tokens'.*valid"),
    (C.IbrConfig, dict(mask_rejects="yes"), r"ibr\.mask_rejects"),
    (C.RLConfig, dict(ratio_against="dense"), r"rl\.ratio_against='dense'.*sampler"),
    (C.LossConfig, dict(aggregation="sum"), r"loss\.aggregation.*seq_mean"),
    (C.AcrConfig, dict(c=0.0), r"acr\.c"),
    (C.UpdateConfig, dict(minibatch_size=10, micro_batch_size=4), r"update\.minibatch_size.*micro_batch_size"),
    (C.OptimConfig, dict(schedule="linear"), r"optim\.schedule"),
    (C.OptimConfig, dict(schedule="cosine", warmup_steps=10, total_steps=5), r"optim\.total_steps"),
)


def test_config_validation_names_the_setting():
    for factory, kwargs, pattern in BAD_SETTINGS:
        with pytest.raises(ValueError, match=pattern):
            factory(**kwargs)
    cfg = from_dict(C.RLConfig, {"mode": "qurl", "acr": {"c": 3.0}, "loss": {"aggregation": "token_mean"}}, "rl")
    assert cfg.acr.c == 3.0 and cfg.loss.aggregation == "token_mean" and cfg.sars == C.SarsConfig()
    assert cfg.corrections == ("tis", "acr")
    assert "acr" in C.RLConfig(mode="sparse_rl", acr=C.AcrConfig(enabled=True)).corrections
    with pytest.raises(ValueError, match=r"rl\.sars\.lo: unknown setting"):
        from_dict(C.RLConfig, {"sars": {"lo": 0.1}}, "rl")


def test_training_sampling_must_match_the_scorer():
    u = C.UpdateConfig(minibatch_size=4, micro_batch_size=4, temperature=0.9)
    C.check_training_sampling(u, 0.9, 1.0, 0)
    with pytest.raises(ValueError, match=r"rollout\.temperature=1.0 differs.*rl\.update\.temperature=0\.9"):
        C.check_training_sampling(u, 1.0, 1.0, 0)
    # top-k, and top-p within a top-k, train (the kept set is replayed); top-p alone has no bound
    C.check_training_sampling(u, 0.9, 1.0, 20)
    C.check_training_sampling(u, 0.9, 0.9, 20)
    with pytest.raises(ValueError, match=r"rollout\.top_p=0\.95 with rollout\.top_k=0: .* set rollout\.top_k"):
        C.check_training_sampling(u, 0.9, 0.95, 0)
    # the run config refuses it too, with either scheduler; filters within a top-k train with both
    from sparserl_jax.config import load_config

    for scheduler in ("batch", "sorted"):
        with pytest.raises(ValueError, match=r"rollout\.top_p=0\.9 with rollout\.top_k=0"):
            load_config([], ["rollout.top_p=0.9", f"rollout.scheduler={scheduler}"])
        for filters in (["rollout.top_k=20"], ["rollout.top_p=0.9", "rollout.top_k=20"]):
            assert load_config([], [*filters, f"rollout.scheduler={scheduler}"]).rollout.filters
    with pytest.raises(ValueError, match=r"rollout\.temperature=0\.7 differs"):
        load_config([], ["rollout.temperature=0.7"])
    assert load_config([], ["rollout.temperature=0.7", "rl.update.temperature=0.7"])


# ----------------------------------------------------------------------------- the registry


def test_every_correction_has_its_rl_config_section():
    """A registered correction is configured as rl.<name>: an RLConfig field of its settings
    class, whose default is that class's default."""
    hints = typing.get_type_hints(C.RLConfig)
    for name, c in CORRECTIONS.items():
        assert c.name == name
        assert hints.get(name) is c.settings, (name, hints.get(name))
        assert getattr(C.RLConfig(), name) == c.settings()


def test_every_mode_applies_its_row_of_the_registry():
    """A mode applies exactly its RL_MODES row (the docs' preset table is generated from it:
    tests/test_correction_family.py)."""
    for mode, names in C.RL_MODES.items():
        assert set(names) <= set(CORRECTIONS), mode
        assert C.RLConfig(mode=mode).corrections == names


def test_composition_rules(monkeypatch):
    # acr.enabled adds ACR to any mode, once
    assert C.RLConfig(mode="dense", acr=C.AcrConfig(enabled=True)).corrections == ("acr",)
    assert C.RLConfig(mode="qurl", acr=C.AcrConfig(enabled=True)).corrections == ("tis", "acr")
    # at most one weighting correction; only registered names
    monkeypatch.setitem(C.RL_MODES, "ibr_and_tis", ("ibr", "tis"))
    with pytest.raises(ValueError, match=r"rl\.mode='ibr_and_tis' weights tokens by ibr and tis"):
        C.RLConfig(mode="ibr_and_tis")
    monkeypatch.setitem(C.RL_MODES, "typo", ("sars", "ibrr"))
    with pytest.raises(
        ValueError,
        match=r"rl\.mode='typo' names unregistered correction\(s\) "
        r"ibrr",
    ):
        C.RLConfig(mode="typo")
    with pytest.raises(ValueError, match=r"correction 'noop' contributes nothing"):
        Correction(name="noop", settings=C.TisConfig)
