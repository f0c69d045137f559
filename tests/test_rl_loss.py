"""The corrected GRPO loss against an independent NumPy implementation written from
docs/methods.md#sars, #ibr, #the-objective, #tis and #acr, on random inputs, for every mode,
both aggregations, all SARS levels, every IBR variant and ACR."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import verl_reference
from float_tol import sum_tol

from sparserl_jax.rl import advantages as adv_lib
from sparserl_jax.rl import config as C
from sparserl_jax.rl import loss
from sparserl_jax.rl.corrections import compose
from sparserl_jax.rl.corrections.ibr import IBR_MODES
from sparserl_jax.rl.corrections.xi import LEVELS

B, T = 6, 12
# tests here share compiled functions: keep them on one xdist worker (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("rl_loss")

# mode -> (SARS, IBR, TIS, ACR), restated from docs/methods.md, not imported; the frameworks'
# presets (verl's, as tests/verl_reference.py restates them) use none of the four
REF_MODES = {
    "dense": (0, 0, 0, 0),
    "naive_sparse": (0, 0, 0, 0),
    "sparse_rl": (1, 1, 0, 0),
    "sars_only": (1, 0, 0, 0),
    "ibr_only": (0, 1, 0, 0),
    "tis": (0, 0, 1, 0),
    "qurl": (0, 0, 1, 1),
    **{name: (0, 0, 0, 0) for name in verl_reference.VERL_PRESETS},
}


def np_reference(inp, cfg: C.RLConfig, magnitude: bool = False) -> float:
    """Loop-per-response NumPy (float64) version of l_t and its aggregation (of |l_t| with
    `magnitude`: what loss_tol scales)."""
    learner, old, ref, sampler, mask, adv_B, ent = (
        np.asarray(inp[k], np.float64) if k != "mask" else np.asarray(inp[k], bool)
        for k in ("learner", "old", "ref", "sampler", "mask", "adv", "entropy")
    )
    use_sars, use_ibr, use_tis, use_acr = REF_MODES[cfg.mode]
    use_acr = use_acr or cfg.acr.enabled
    s, ib, lc = cfg.sars, cfg.ibr, cfg.loss
    accept = np.zeros((B, T), bool)
    w = np.zeros((B, T))
    xi = np.ones((B, T))
    preset = cfg.mode in verl_reference.VERL_PRESETS
    if preset:  # the verl preset's modified response mask and IS weights
        preset_keep, preset_w = verl_reference.verl_preset(cfg.mode, np.where(mask, old - sampler, 0.0), mask)
    for i in range(B):
        idx = np.nonzero(mask[i])[0]
        if len(idx) == 0:
            continue
        lx = old[i, idx] - sampler[i, idx]
        xi_i = np.exp(np.clip(lx, -20, 20))
        xi[i, idx] = xi_i

        def at_level(level):
            if level == "token":
                return xi_i  # noqa: B023 (called within the iteration)
            agg = lx.sum() if level == "sequence" else lx.mean()  # noqa: B023 (called within the iteration)
            return np.full(len(idx), np.exp(np.clip(agg, -20, 20)))  # noqa: B023 (called within the iteration)

        keep = np.ones(len(idx), bool)
        if use_sars:
            if s.token_rule:
                a = at_level(s.token_level)
                keep &= (a >= s.token_lo) & (a <= s.token_hi)
            if s.veto and np.any(at_level(s.veto_level) < s.veto_threshold):
                keep[:] = False
        if use_ibr:
            in_band = (xi_i >= ib.lo) & (xi_i <= ib.hi)
            if ib.mode == "truncate":
                wi = np.minimum(xi_i, ib.cap)
            elif ib.mode == "clip":
                wi = np.clip(xi_i, ib.lo, ib.hi)
            elif ib.mask_rejects:  # out-of-band tokens leave the loss; w = xi elsewhere
                wi = xi_i
                keep &= in_band
            else:
                wi = np.where(in_band, xi_i, 0.0)
        elif use_tis:
            wi = np.minimum(xi_i, cfg.tis.cap)
        elif preset:
            wi = preset_w[i, idx]
            keep &= preset_keep[i, idx]
        else:
            wi = np.ones(len(idx))
        accept[i, idx] = keep
        w[i, idx] = wi
    if use_ibr and ib.normalisation != "none":
        over = accept if ib.normalise_over == "accepted" else mask
        mean = w[over].sum() / max(over.sum(), 1)
        if mean > 1e-8:
            w = w / mean

    total, n_tok = 0.0, 0
    for i in range(B):
        per_resp = []
        for t in np.nonzero(accept[i])[0]:
            behaviour = sampler if cfg.ratio_against == "sampler" else old
            r = np.exp(np.clip(learner[i, t] - behaviour[i, t], -20, 20))
            a = adv_B[i]
            upper = 1 + lc.eps_high
            if use_acr:
                upper = upper / min(1.0, cfg.acr.c / xi[i, t])
            pg = max(-r * a, -np.clip(r, 1 - lc.eps_low, upper) * a)
            q = ref[i, t] - learner[i, t]
            kl = np.clip(np.exp(q) - q - 1, -lc.kl_clamp, lc.kl_clamp)
            lt = w[i, t] * pg + lc.beta * kl - lc.entropy_coef * ent[i, t]
            per_resp.append(abs(lt) if magnitude else lt)
        n_tok += len(per_resp)
        if lc.aggregation == "token_mean":
            total += sum(per_resp)
        elif per_resp:
            total += np.mean(per_resp)
    return total / max(n_tok, 1) if lc.aggregation == "token_mean" else total / B


def loss_tol(inp, cfg: C.RLConfig) -> float:
    """Float noise of the float32 loss against float64 or another float32 program: its sums of
    <= B T token terms, taken in another order, move it by up to B T EPS32 times the same
    aggregation of |l_t| (float_tol.sum_tol; the few roundings inside each l_t are far below).
    About 1e-5 here; a wrong weight, bound or denominator moves the loss by > 1e-3."""
    return sum_tol(B * T, np_reference(inp, cfg, magnitude=True))


@jax.jit
def _random_inputs(key, mismatch):
    k = jax.random.split(key, 8)
    old = -jax.random.uniform(k[0], (B, T), minval=0.05, maxval=4.0)
    sampler = old + mismatch * jax.random.normal(k[1], (B, T))
    # a few catastrophic tokens: the dense policy finds them near-impossible (xi << 1e-4)
    sampler = sampler + jnp.where(jax.random.uniform(k[2], (B, T)) < 0.04, 12.0, 0.0)
    sampler = sampler.at[1, 2].add(12.0)  # row 1 always has one (its mask starts at 2)
    learner = old + 0.3 * jax.random.normal(k[3], (B, T))
    ref = old + 0.5 * jax.random.normal(k[4], (B, T))
    lengths = jax.random.randint(k[5], (B,), 2, T - 3)
    mask = (jnp.arange(T)[None] >= 2) & (jnp.arange(T)[None] < 2 + lengths[:, None])
    return dict(
        learner=learner,
        old=old,
        ref=ref,
        sampler=sampler,
        mask=mask,
        adv=jax.random.normal(k[6], (B,)),
        entropy=jax.random.uniform(k[7], (B, T), minval=0.1, maxval=3.0),
    )


def random_inputs(seed: int, *, mismatch: float = 0.45) -> dict:
    return _random_inputs(jax.random.key(seed, impl="rbg"), mismatch)


def jax_loss(inp, cfg):
    corr = compose.compute_corrections(
        inp["learner"],
        inp["old"],
        inp["ref"],
        inp["sampler"],
        inp["mask"],
        cfg,
        with_metrics=False,
    )
    a = adv_lib.token_advantages(inp["adv"], inp["mask"])
    return loss.policy_loss(corr, a, inp["entropy"], cfg.loss)


jloss = jax.jit(jax_loss, static_argnums=1)
jcorr = jax.jit(functools.partial(compose.compute_corrections, with_metrics=False), static_argnums=5)


@functools.partial(jax.jit, static_argnums=1)
def corr_metrics(inp, cfgs):
    """The correction metrics of several configs on one input, in one compiled call."""
    return [compose.mismatch_metrics(inp["old"], inp["sampler"], inp["mask"], c) for c in cfgs]


def many_losses(inp, cfgs):
    """Losses of several configs on one input, in one compiled call."""
    return pair_losses([(inp, c) for c in cfgs])


def pair_losses(pairs):
    """Losses of several (input, config) pairs, in one compiled call."""
    inps, cfgs = zip(*pairs)
    return np.asarray(_pairs(list(inps), tuple(cfgs)))


@functools.partial(jax.jit, static_argnums=1)
def _pairs(inps, cfgs):
    return jnp.stack([jax_loss(inp, c)[0] for inp, c in zip(inps, cfgs)])


def _cfg(mode, agg="seq_mean", **kw):
    base = dict(
        mode=mode,
        loss=C.LossConfig(aggregation=agg, eps_high=0.28, beta=0.05, entropy_coef=0.01),
    )
    base.update(kw)
    return C.RLConfig(**base)


CASES = (
    [_cfg(m, agg) for m in C.RL_MODES for agg in C.AGGREGATIONS]
    + [
        _cfg("sparse_rl", C.AGGREGATIONS[i % 2], sars=C.SarsConfig(token_level=tl, veto_level=vl))
        for i, (tl, vl) in enumerate((tl, vl) for tl in LEVELS for vl in LEVELS)
        if (tl, vl) != ("token", "token")
    ]
    + [
        _cfg("ibr_only", "token_mean", ibr=C.IbrConfig(mode=im, normalisation=nm))
        for im in IBR_MODES
        for nm in ("micro_batch", "none")
    ]
    + [
        _cfg("ibr_only", "seq_mean", ibr=C.IbrConfig(mode="mask", mask_rejects=False)),
        _cfg("sparse_rl", "seq_mean", ibr=C.IbrConfig(normalise_over="accepted")),
        _cfg("naive_sparse", "seq_mean", ratio_against="sampler"),
        _cfg("sparse_rl", "seq_mean", acr=C.AcrConfig(enabled=True, c=1.2)),
        _cfg("qurl", "token_mean", tis=C.TisConfig(cap=1.3), acr=C.AcrConfig(c=1.3)),
        _cfg("sparse_rl", "token_mean", sars=C.SarsConfig(token_rule=False)),
        _cfg("sparse_rl", "seq_mean", sars=C.SarsConfig(veto=False, veto_threshold=0.3)),
    ]
)


def _case_id(cfg):
    s = cfg.sars
    ib = cfg.ibr
    return (
        f"{cfg.mode}-{cfg.loss.aggregation}-{s.token_level}-{s.veto_level}-{ib.mode}-"
        f"{ib.normalisation}-{ib.normalise_over}-{ib.mask_rejects}-{cfg.ratio_against}-"
        f"acr{int('acr' in cfg.corrections)}"
    )


SEEDS = (0, 1, 2)


@functools.cache
def _all_case_losses():
    """Every case's loss for every seed, from one compiled function (one compile, not 32)."""
    f = jax.jit(lambda inp: jnp.stack([jax_loss(inp, c)[0] for c in CASES]))
    return {seed: np.asarray(f(random_inputs(seed))) for seed in SEEDS}


def test_loss_matches_numpy_reference():
    """One test over all cases (not parametrized) so that one worker compiles them all."""
    failures = []
    for seed in SEEDS:
        inp = random_inputs(seed)
        for case, cfg in enumerate(CASES):
            got = _all_case_losses()[seed][case]
            want = np_reference(inp, cfg)
            if not np.isclose(got, want, rtol=0, atol=loss_tol(inp, cfg)):
                failures.append(f"{_case_id(cfg)} seed {seed}: jax {got} numpy {want}")
    assert not failures, "\n".join(failures)


def test_reference_cases_exercise_the_corrections():
    """The random inputs hit every branch: rejections, vetoes, truncation, clipping."""
    for seed in SEEDS:
        inp = random_inputs(seed)
        cfg = _cfg("sparse_rl")
        _, lm = jloss(inp, cfg)
        m, m_ibr = corr_metrics(inp, (cfg, _cfg("ibr_only")))
        assert 0.05 < float(m["sars/token_reject_rate"]) < 0.95
        assert float(m["sars/veto_rate"]) > 0
        assert 0 < float(lm["loss/clip_frac"]) < 1
        # inside the SARS band [0.5, 1.5] the IBR cap 1.5 never binds; without SARS it does
        assert float(m["weights/trunc_frac"]) == 0
        assert float(m_ibr["weights/trunc_frac"]) > 0
        # and the modes give different losses on them
        idx = [i for i, c in enumerate(CASES) if c in (_cfg("naive_sparse"), cfg, _cfg("tis"))]
        assert len(idx) == 3
        assert len({round(float(v), 6) for v in _all_case_losses()[seed][idx]}) == 3


def test_sampler_equal_old_gives_plain_grpo():
    """With pi_sparse == pi_old every mode reduces to plain GRPO (no weights, no rejections)."""
    inp = random_inputs(1)
    inp["sampler"] = inp["old"]
    cfgs = [_cfg(mode, C.AGGREGATIONS[i % 2], acr=C.AcrConfig(enabled=True)) for i, mode in enumerate(C.RL_MODES)] + [
        _cfg("sparse_rl", agg, sars=C.SarsConfig(token_level=lvl, veto_level=lvl))
        for agg, lvl in zip(C.AGGREGATIONS, ("sequence", "geometric"))
    ]
    got = many_losses(inp, cfgs)
    for cfg, g in zip(cfgs, got):
        dense = _cfg("dense", cfg.loss.aggregation)
        np.testing.assert_allclose(g, np_reference(inp, dense), atol=loss_tol(inp, dense))
    corr = jcorr(inp["learner"], inp["old"], inp["ref"], inp["sampler"], inp["mask"], cfgs[2])
    assert cfgs[2].mode == "sparse_rl"
    np.testing.assert_array_equal(np.asarray(corr.accept), np.asarray(inp["mask"]))
    np.testing.assert_array_equal(np.asarray(corr.weight), np.asarray(inp["mask"], np.float32))
    np.testing.assert_array_equal(np.asarray(corr.r_acr), 1.0)


def test_rejected_tokens_leave_the_denominator():
    inp = random_inputs(2, mismatch=0.0)
    mask = np.asarray(inp["mask"])
    i, t = 0, int(np.nonzero(mask[0])[0][0])
    sampler = np.asarray(inp["old"]).copy()
    sampler[i, t] += 3.0  # xi = e^-3: outside [0.5, 1.5], above the veto threshold
    inp["sampler"] = jnp.asarray(sampler)
    masked = dict(inp, mask=inp["mask"].at[i, t].set(False), sampler=inp["old"])
    moved = dict(inp, learner=inp["learner"].at[i, t].add(5.0))
    for agg in C.AGGREGATIONS:
        cfg = _cfg("sars_only", agg, loss=C.LossConfig(aggregation=agg, beta=0.0))
        dense = _cfg("dense", agg, loss=cfg.loss)
        got, kept, want, got_moved = pair_losses([(inp, cfg), (inp, dense), (masked, dense), (moved, cfg)])
        # the same loss as dense training on the batch with that token masked out (another
        # program: loss_tol) ...
        tol = loss_tol(inp, cfg)
        np.testing.assert_allclose(got, want, atol=tol)
        # ... which differs from keeping it
        assert abs(got - kept) > 100 * tol
        # and the rejected token's learner log-prob no longer matters
        np.testing.assert_allclose(got_moved, got, atol=tol)
    _, metrics = jloss(inp, cfg)
    assert float(metrics["tokens"]) == mask.sum() - 1


def test_fully_rejected_response_counts_as_zero_in_seq_mean():
    inp = random_inputs(3, mismatch=0.0)
    inp["sampler"] = inp["old"].at[0].add(-12.0)  # xi = e^12 everywhere in row 0: all rejected
    cfg = _cfg("sars_only", "seq_mean", loss=C.LossConfig(beta=0.0))
    rest = {k: v[1:] for k, v in inp.items()}
    got, dense_rest = pair_losses([(inp, cfg), (rest, _cfg("dense", loss=cfg.loss))])
    assert abs(dense_rest) > 1e-3
    # the other B - 1 responses' mean, rescaled to a division by B (two programs: loss_tol)
    np.testing.assert_allclose(float(got), float(dense_rest) * (B - 1) / B, atol=loss_tol(inp, cfg))


def test_gradient_flows_through_r_only():
    """w and xi are constants: no gradient reaches the sampler or old log-probs through them,
    and d loss / d learner matches the clipped-surrogate derivative."""
    inp = random_inputs(4)
    cfg = _cfg("sparse_rl", "token_mean", loss=C.LossConfig(aggregation="token_mean", beta=0.0))

    def f(learner, sampler):
        return jax_loss(dict(inp, learner=learner, sampler=sampler), cfg)[0]

    g_learner, g_sampler = jax.jit(jax.grad(f, argnums=(0, 1)))(inp["learner"], inp["sampler"])
    assert np.all(np.asarray(g_sampler) == 0)
    corr = jcorr(inp["learner"], inp["old"], inp["ref"], inp["sampler"], inp["mask"], cfg)
    r, w, acc = (np.asarray(x) for x in (corr.r, corr.weight, corr.accept))
    a = np.asarray(inp["adv"])[:, None]
    active = ~(((a > 0) & (r > 1.2)) | ((a < 0) & (r < 0.8)))  # unclipped branch is the max
    want = np.where(acc & active, -w * r * a, 0.0) / acc.sum()
    # per token, no sums: a few roundings (1e-4 >> 4 EPS32); the zeros are exact
    np.testing.assert_allclose(np.asarray(g_learner), want, rtol=1e-4, atol=1e-8)
    assert np.any(acc & ~active) and np.any(acc & active)


def test_entropy_bonus_and_kl():
    inp = random_inputs(5)
    base = _cfg("dense", "token_mean", loss=C.LossConfig(aggregation="token_mean", beta=0.0))
    _, m = jloss(inp, base)
    with_ent = dataclasses.replace(base, loss=C.LossConfig(aggregation="token_mean", beta=0.0, entropy_coef=0.1))
    l0, l1 = many_losses(inp, [base, with_ent])
    # three programs' token means (loss_tol of the larger loss bounds each)
    np.testing.assert_allclose(float(l1), float(l0) - 0.1 * float(m["loss/entropy"]), atol=3 * loss_tol(inp, with_ent))
    q = np.asarray(inp["ref"] - inp["learner"], np.float64)
    # a mean of <= B T = 72 positive terms: 72 EPS32 = 8.6e-6 relative, plus exp's rounding
    np.testing.assert_allclose(
        float(m["loss/kl_ref"]),
        np.clip(np.exp(q) - q - 1, -10, 10)[np.asarray(inp["mask"])].mean(),
        rtol=1e-5,
    )
    k3 = np.asarray(loss.k3_kl(jnp.linspace(-30, 30, 61), 10.0))
    assert np.all(k3 >= 0) and k3.max() == 10.0  # the value is clamped, not q


def test_explicit_denominator_rescales():
    inp = random_inputs(6)
    cfg = _cfg("sparse_rl", "token_mean")

    @jax.jit
    def both(inp):
        corr = compose.compute_corrections(inp["learner"], inp["old"], inp["ref"], inp["sampler"], inp["mask"], cfg)
        a = adv_lib.token_advantages(inp["adv"], inp["mask"])
        l_default, m = loss.policy_loss(corr, a, inp["entropy"], cfg.loss)
        l_explicit, _ = loss.policy_loss(corr, a, inp["entropy"], cfg.loss, denominator=2 * m["tokens"])
        return l_default, l_explicit

    l_default, l_explicit = both(inp)
    # the same sum, over 2n or over n and halved (one program, but it may sum twice)
    np.testing.assert_allclose(float(l_explicit), float(l_default) / 2, atol=loss_tol(inp, cfg) / 2)


def test_grpo_advantages():
    rewards = jax.random.bernoulli(jax.random.key(7, impl="rbg"), 0.5, (12,)).astype(jnp.float32)
    rewards = rewards.at[:4].set(jnp.array([1.0, 0.0, 0.0, 1.0]))
    rewards = rewards.at[4:8].set(1.0)  # a group with identical rewards
    grpo = jax.jit(adv_lib.grpo_advantages, static_argnums=1, static_argnames="scale_by_std")
    a = np.asarray(grpo(rewards, 4))
    r = np.asarray(rewards).reshape(3, 4)
    want = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
    # a 4-term mean and std per group, then one division: a few roundings of |a| <= 1.5
    np.testing.assert_allclose(a, want.reshape(-1), rtol=1e-5, atol=1e-6)
    assert np.all(a[4:8] == 0)
    np.testing.assert_allclose(a[:4], [0.8660254, -0.8660254, -0.8660254, 0.8660254], rtol=1e-5)
    centred = np.asarray(grpo(rewards, 4, scale_by_std=False))
    # 0/1 rewards over groups of 4: the means and differences are multiples of 1/4, exact
    np.testing.assert_allclose(centred, (r - r.mean(1, keepdims=True)).reshape(-1), atol=1e-6)
    mask = jnp.arange(5)[None] < jnp.array([2, 5, 0, 1, 3, 4, 1, 1, 2, 2, 3, 3])[:, None]
    tok = np.asarray(adv_lib.token_advantages(jnp.asarray(a), mask))
    np.testing.assert_allclose(tok, np.where(np.asarray(mask), a[:, None], 0.0))
    with pytest.raises(ValueError, match="group_size"):
        adv_lib.grpo_advantages(rewards, 5)


def test_micro_batch_losses_add_up_to_the_batch_loss():
    """With the batch's denominator and a global IBR normaliser, the losses of micro-batches add
    up to the loss of the whole batch, for both aggregations (what gradient accumulation needs)."""
    inp = random_inputs(8)

    @functools.partial(jax.jit, static_argnums=1)
    def split_vs_whole(inp, cfg):
        norm = compose.weight_normaliser(compose.behaviour(inp["old"], inp["sampler"], inp["mask"], cfg), cfg)
        whole_corr = compose.compute_corrections(
            inp["learner"],
            inp["old"],
            inp["ref"],
            inp["sampler"],
            inp["mask"],
            cfg,
            weight_norm=norm,
            with_metrics=False,
        )
        adv = adv_lib.token_advantages(inp["adv"], inp["mask"])
        whole, _ = loss.policy_loss(whole_corr, adv, inp["entropy"], cfg.loss)
        denom = loss.loss_denominator(whole_corr.accept, cfg.loss)
        parts = []
        for s in (slice(0, 2), slice(2, 3), slice(3, B)):
            part = {k: v[s] for k, v in inp.items()}
            c = compose.compute_corrections(
                part["learner"],
                part["old"],
                part["ref"],
                part["sampler"],
                part["mask"],
                cfg,
                weight_norm=norm,
                with_metrics=False,
            )
            a = adv_lib.token_advantages(part["adv"], part["mask"])
            parts.append(loss.policy_loss(c, a, part["entropy"], cfg.loss, denominator=denom)[0])
        return whole, jnp.stack(parts)

    for agg in C.AGGREGATIONS:
        cfg = _cfg("sparse_rl", agg, ibr=C.IbrConfig(normalisation="global"))
        whole, parts = split_vs_whole(inp, cfg)
        tol = loss_tol(inp, cfg)  # the same token terms summed in other groupings
        np.testing.assert_allclose(float(jnp.sum(parts)), float(whole), atol=tol)
        assert len({round(float(p), 6) for p in parts}) == 3
        np.testing.assert_allclose(float(whole), np_reference(inp, cfg), atol=tol)
