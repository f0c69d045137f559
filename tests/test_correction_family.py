"""The rejection and importance-weight family (rl/corrections/rejection.py, importance.py,
divergence.py), its presets and verl's off-policy diagnostics, against NumPy transcriptions of the
published formulas (tests/verl_reference.py: verl's rollout_corr_helper.py and presets, AReaL's
ratio rule and decoupled PPO loss) on random inputs; the length bias of the sequence product
against the geometric mean; the generated table of docs/implementation.md."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import verl_reference as V

from sparserl_jax.rl import config as C
from sparserl_jax.rl import correction_table, loss
from sparserl_jax.rl.advantages import token_advantages
from sparserl_jax.rl.corrections import CORRECTIONS, compose
from sparserl_jax.rl.corrections.divergence import AGGREGATIONS, STATISTICS

B, T = 16, 24
# tests here share compiled functions: keep them on one xdist worker (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("correction_family")


@jax.jit
def _inputs(key, scale):
    k = jax.random.split(key, 4)
    old = -jax.random.uniform(k[0], (B, T), minval=0.05, maxval=4.0)
    # a spread of mismatch scales over the rows (the first three all but dense, inside even
    # Geo-RS's 0.1% band), and a few catastrophic tokens in the others
    row_scale = scale * jnp.concatenate([jnp.full(3, 1e-4), jnp.linspace(0.002, 1.0, B - 3)])[:, None]
    sampler = old + row_scale * jax.random.normal(k[1], (B, T))
    rare = (jax.random.uniform(k[2], (B, T)) < 0.02) & (jnp.arange(B)[:, None] >= 3)
    sampler = sampler + jnp.where(rare, 10.0, 0.0)
    lengths = jax.random.randint(k[3], (B,), 1, T + 1)
    mask = jnp.arange(T)[None] < lengths[:, None]
    return old, sampler, mask


def inputs(seed, scale=0.6):
    old, sampler, mask = (np.asarray(x) for x in _inputs(jax.random.key(seed, impl="rbg"), scale))
    return old, sampler, mask


@functools.partial(jax.jit, static_argnums=3)
def behaviours(old, sampler, mask, cfgs):
    """(accept, raw weight, metrics) of several configs on one input, in one compiled call."""
    out = []
    for c in cfgs:
        b = compose.behaviour(old, sampler, mask, c)
        out.append((b.accept, b.weight, compose.behaviour_metrics(b, c)))
    return out


def _log_ratio(old, sampler, mask):
    return np.where(mask, old.astype(np.float64) - sampler.astype(np.float64), 0.0)


def _assert_keep_equal(got, want, stat, bounds, mask):
    """Equal keep masks on the response, except where the float64 statistic lies within float32
    rounding of a bound (there either answer is right); and the rule must both keep and reject."""
    scale = np.maximum(np.abs(stat), 1.0)
    near = np.zeros_like(mask)
    for b in bounds:
        near |= np.abs(stat - b) <= 1e-5 * scale
    sel = mask & ~near
    np.testing.assert_array_equal(got[sel], want[sel])
    assert want[mask].any() and not want[mask].all(), "inputs must exercise both sides of the bound"


def _bounds_of(statistic, lo, hi):
    if statistic == "k1":
        return [np.log(1.0 / hi if lo is None else lo), np.log(hi)]
    return [hi] + ([] if lo is None else [lo])


# ----------------------------------------------------------------------------- the pieces


def _rejection_cases():
    """(RejectionConfig, reference keep + statistic) for every statistic and aggregation, with
    bounds that split the inputs."""
    thresholds = {  # (lo, hi) per statistic and aggregation, chosen inside the inputs' range
        ("ratio", "token"): (0.7, 1.4),
        ("ratio", "sum"): (0.3, 3.0),
        ("ratio", "mean"): (0.8, 1.2),
        ("ratio", "max"): (None, 2.5),
        ("k1", "token"): (0.7, 1.4),
        ("k1", "sum"): (0.3, 3.0),
        ("k1", "mean"): (0.8, 1.25),
        ("k2", "token"): (None, 0.05),
        ("k2", "sum"): (None, 1.0),
        ("k2", "mean"): (None, 0.05),
        ("k2", "max"): (None, 0.3),
        ("k3", "token"): (None, 0.05),
        ("k3", "sum"): (None, 1.0),
        ("k3", "mean"): (None, 0.05),
        ("k3", "max"): (None, 0.3),
    }
    cases = []
    for (statistic, aggregation), (lo, hi) in thresholds.items():
        cfg = C.RLConfig(
            mode="dense",
            rejection=C.RejectionConfig(enabled=True, statistic=statistic, aggregation=aggregation, lo=lo, hi=hi),
        )
        cases.append((cfg, statistic, aggregation, lo, hi))
    return cases


def _reference_keep(log_ratio, mask, statistic, aggregation, lo, hi):
    if statistic == "ratio":
        return V.areal_ratio_keep(log_ratio, mask, aggregation, lo, hi)
    option = f"{'token' if aggregation == 'token' else 'seq_' + aggregation}_{statistic}"
    return V.rejection_keep(log_ratio, mask, option, lo, hi)


def test_every_statistic_and_aggregation_matches_the_published_formula():
    """rejection at each (statistic, aggregation) = verl's rollout_rs option (AReaL's ratio rule)
    on random inputs (k1 max is in neither: verl and AReaL leave it out, and so do these cases)."""
    cases = _rejection_cases()
    covered = {(s, a) for _, s, a, _, _ in cases}
    assert covered == {(s, a) for s in STATISTICS for a in AGGREGATIONS} - {("k1", "max")}
    for seed in range(3):
        old, sampler, mask = inputs(seed)
        lr = _log_ratio(old, sampler, mask)
        got = behaviours(old, sampler, mask, tuple(c for c, *_ in cases))
        for (_, statistic, aggregation, lo, hi), (accept, _, metrics) in zip(cases, got):
            keep, stat = _reference_keep(lr, mask, statistic, aggregation, lo, hi)
            _assert_keep_equal(np.asarray(accept), keep & mask, stat, _bounds_of(statistic, lo, hi), mask)
            assert float(metrics["rejection/reject_frac"]) == pytest.approx((~keep)[mask].mean(), abs=2.0 / mask.sum())


def test_importance_weights_match_the_published_formula():
    """importance at each level, truncated and IcePop-masked, = verl's IS weights (token and
    sequence level) and AReaL's geometric-mean weight."""
    cases = [
        (C.ImportanceConfig(enabled=True, level=lvl, action=act, lo=lo, hi=hi), lvl, lo, hi, act == "mask")
        for lvl in ("token", "sequence", "geometric")
        for act, lo, hi in (("clamp", None, 1.3), ("mask", 0.7, 1.6))
    ] + [(C.ImportanceConfig(enabled=True, level="geometric", lo=0.9, hi=1.1), "geometric", 0.9, 1.1, False)]
    cfgs = tuple(C.RLConfig(mode="dense", importance=c) for c, *_ in cases)
    for seed in range(3):
        old, sampler, mask = inputs(seed)
        lr = _log_ratio(old, sampler, mask)
        for (_, level, lo, hi, icepop), (accept, w, metrics) in zip(cases, behaviours(old, sampler, mask, cfgs)):
            want = V.is_weights(lr, mask, level, hi, lo, icepop=icepop) * mask
            np.testing.assert_allclose(np.asarray(w), want, rtol=2e-5, atol=1e-30)
            np.testing.assert_array_equal(np.asarray(accept), mask)  # weights only: no rejection
            assert float(metrics["importance/ess"]) == pytest.approx(V.ess(want, mask, hi), rel=1e-4)
            assert (want[mask] != np.exp(np.clip(lr, -20, 20))[mask]).any() or level != "token"


# ----------------------------------------------------------------------------- the presets


def test_every_preset_is_verls_at_its_published_defaults():
    """rl.mode=<preset> gives verl's preset (RolloutCorrectionConfig.<method>() at its defaults):
    the same modified response mask and IS weights on random inputs."""
    names = tuple(V.VERL_PRESETS)
    assert set(names) <= set(C.RL_MODES)
    cfgs = tuple(C.RLConfig(mode=n) for n in names)
    rejected = set()
    for seed in range(3):
        old, sampler, mask = inputs(seed, scale=0.25)
        lr = _log_ratio(old, sampler, mask)
        for name, (accept, w, _) in zip(names, behaviours(old, sampler, mask, cfgs)):
            keep, want_w = V.verl_preset(name, lr, mask)
            level, _, rs, rs_thr = V.VERL_PRESETS[name]
            if rs is not None:
                lo, hi = V._bounds(rs_thr)
                stat = V.rejection_keep(lr, mask, rs, lo, hi)[1]
                _assert_keep_equal(np.asarray(accept), keep, stat, _bounds_of(rs[-2:], lo, hi), mask)
                rejected.add(name)
            else:
                np.testing.assert_array_equal(np.asarray(accept), mask)
            np.testing.assert_allclose(np.asarray(w), want_w * mask, rtol=2e-5, atol=1e-30)
    assert rejected == {n for n, p in V.VERL_PRESETS.items() if p[2] is not None}


def test_existing_modes_are_untouched_by_the_family():
    """The family's sections at their defaults are off: Sparse-RL's and QuRL's modes apply only
    their own corrections."""
    for mode, names in {"dense": (), "sparse_rl": ("sars", "ibr"), "tis": ("tis",), "qurl": ("tis", "acr")}.items():
        assert C.RLConfig(mode=mode).corrections == names
    cfg = C.RLConfig(mode="sparse_rl", k3_rs=C.K3RsConfig(enabled=True))
    assert cfg.corrections == ("sars", "ibr", "k3_rs")
    with pytest.raises(ValueError, match=r"weights tokens by ibr and icepop"):
        C.RLConfig(mode="sparse_rl", icepop=C.IcepopConfig(enabled=True))


# ----------------------------------------------------------------------------- the denominator


@functools.partial(jax.jit, static_argnums=5)
def _loss(learner, old, sampler, mask, adv_B, cfg):
    """The loss of one batch (pi_ref = pi_theta: no KL) and its Corrections' counted mask."""
    corr = compose.compute_corrections(learner, old, learner, sampler, mask, cfg, with_metrics=False)
    value, metrics = loss.policy_loss(corr, token_advantages(adv_B, mask), None, cfg.loss)
    return value, metrics, corr.counted


def _areal_case(seed, lo, hi):
    """Random inputs with the learner moved off pi_old (the PPO clip binds on some tokens), and no
    xi within float32 rounding of a bound (there the two programs may decide either way)."""
    old, sampler, mask = inputs(seed, scale=0.4)
    rng = np.random.default_rng(seed)
    learner = (old + 0.3 * rng.standard_normal(old.shape)).astype(np.float32)
    adv_B = rng.standard_normal(B).astype(np.float32)
    xi = np.exp(_log_ratio(old, sampler, mask))
    assert not any((np.abs(xi - b) <= 1e-5 * b)[mask].any() for b in (lo, hi))
    return learner, old, sampler, mask, adv_B


def _areal_cfg(denominator, aggregation="token_mean", lo=0.7, hi=1.4):
    """AReaL's mask-mode decoupled loss in our terms: `rejection` at [lo, hi] and, for AReaL's
    behave_imp_weight (the raw xi on the kept tokens), token importance weights truncated at hi
    (a kept token's xi is <= hi, so the truncation never binds on it)."""
    return C.RLConfig(
        mode="dense",
        rejection=C.RejectionConfig(enabled=True, lo=lo, hi=hi, denominator=denominator),
        importance=C.ImportanceConfig(enabled=True, hi=hi),
        loss=C.LossConfig(aggregation=aggregation, beta=0.0),
    )


def test_areals_denominator_is_ppo_actor_loss_fns():
    """rejection with denominator="before" (its default, AReaL's) = AReaL's ppo_actor_loss_fn
    (tests/verl_reference.py areal_ppo_actor_loss: sum over the kept tokens / the loss mask's
    count before rejection) on random inputs where the rule rejects some tokens; "after" divides
    by the kept tokens instead, N_before / N_kept times AReaL's value."""
    lo, hi = 0.7, 1.4
    assert C.RejectionConfig().denominator == "before"
    for seed in range(3):
        learner, old, sampler, mask, adv_B = _areal_case(seed, lo, hi)
        f64 = lambda x: x.astype(np.float64)  # noqa: E731
        adv = np.where(mask, adv_B[:, None], 0.0)
        want, kept = V.areal_ppo_actor_loss(f64(learner), f64(old), f64(sampler), adv, mask, 0.2, hi, lo)
        n_before, n_kept = mask.sum(), kept.sum()
        assert 0 < n_kept < n_before - 10  # the rule rejects a good share, and keeps some
        before, m_before, counted = _loss(learner, old, sampler, mask, adv_B, _areal_cfg("before", lo=lo, hi=hi))
        after, m_after, none = _loss(learner, old, sampler, mask, adv_B, _areal_cfg("after", lo=lo, hi=hi))
        assert float(before) == pytest.approx(want, rel=1e-5, abs=1e-7)
        assert float(after) == pytest.approx(want * n_before / n_kept, rel=1e-5, abs=1e-7)
        np.testing.assert_array_equal(np.asarray(counted), mask)  # nothing else rejects here
        assert none is None and "counted_tokens" not in m_after
        assert float(m_before["tokens"]) == float(m_after["tokens"]) == n_kept
        assert float(m_before["counted_tokens"]) == n_before


def test_the_denominator_before_rejection_in_seq_mean_and_beside_sars():
    """seq_mean with "before": each response's kept tokens summed over its tokens counted before
    the rejection, then the mean over responses; beside SARS (whose rejections leave the
    denominator) the count is of the tokens SARS keeps, the rejection's own rejects included."""
    lo, hi = 0.7, 1.4
    learner, old, sampler, mask, adv_B = _areal_case(0, lo, hi)
    cfg = _areal_cfg("before", "seq_mean", lo=lo, hi=hi)
    got, _, _ = _loss(learner, old, sampler, mask, adv_B, cfg)
    f64 = lambda x: x.astype(np.float64)  # noqa: E731
    adv = np.where(mask, adv_B[:, None], 0.0)
    _, kept = V.areal_ppo_actor_loss(f64(learner), f64(old), f64(sampler), adv, mask, 0.2, hi, lo)
    xi = np.exp(_log_ratio(old, sampler, mask))
    r = np.exp(f64(learner) - f64(old))
    pg = np.maximum(-adv * r, -adv * np.clip(r, 0.8, 1.2)) * xi
    rows = np.where(kept, pg, 0.0).sum(-1) / np.maximum(mask.sum(-1), 1)
    assert float(got) == pytest.approx(rows.sum() / B, rel=1e-5, abs=1e-7)
    # beside SARS's token band [0.5, 1.5] (and veto): SARS's rejects leave the count
    both = C.RLConfig(mode="sars_only", rejection=C.RejectionConfig(enabled=True, lo=lo, hi=hi))
    assert compose.counts_rejections(both) and not compose.counts_rejections(C.RLConfig(mode="sars_only"))
    _, metrics, counted = _loss(learner, old, sampler, mask, adv_B, both)
    sars_keep = np.asarray(compose.behaviour(old, sampler, mask, C.RLConfig(mode="sars_only")).accept)
    np.testing.assert_array_equal(np.asarray(counted), sars_keep)
    assert float(metrics["tokens"]) < sars_keep.sum() == float(metrics["counted_tokens"])


def test_no_preset_keeps_its_rejections_counted():
    """Every preset (Sparse-RL's, QuRL's, verl's) removes its rejected tokens from the
    denominator, as before the setting existed: Corrections.counted is None (the loss divides by
    accept), and the verl family's rejections default to "after"."""
    for mode in C.RL_MODES:
        assert not compose.counts_rejections(C.RLConfig(mode=mode)), mode
    for section in (C.GeoRsConfig, C.SeqMaskConfig, C.K3RsConfig):
        assert section().denominator == "after"
    old, sampler, mask = inputs(1)
    rng = np.random.default_rng(1)
    learner = (old + 0.3 * rng.standard_normal(old.shape)).astype(np.float32)
    adv_B = rng.standard_normal(B).astype(np.float32)
    for mode in ("sparse_rl", "geo_rs", "k3_rs_seq_tis"):
        value, metrics, counted = _loss(learner, old, sampler, mask, adv_B, C.RLConfig(mode=mode))
        assert counted is None and "counted_tokens" not in metrics and np.isfinite(float(value))


# ----------------------------------------------------------------------------- length bias


def test_the_sequence_product_is_length_biased_and_the_geometric_mean_is_not():
    """The same per-token mismatch in a short and a long response: the product's fixed band
    rejects the long one, the geometric mean treats both alike; with i.i.d. per-token noise the
    product rejects long responses far more often."""
    lengths = np.array([4, 64])
    mask = np.arange(64)[None] < lengths[:, None]
    old = np.full((2, 64), -1.0, np.float32)
    sampler = old - 0.05  # xi_t = exp(0.05) on every token
    seq, geo = (
        C.RLConfig(mode="seq_mask_tis"),
        C.RLConfig(
            mode="dense",
            rejection=C.RejectionConfig(enabled=True, statistic="ratio", aggregation="mean", lo=0.5, hi=2.0),
        ),
    )
    (a_seq, _, _), (a_geo, _, _) = behaviours(old, sampler, mask, (seq, geo))
    # product exp(0.2) = 1.22 kept; exp(3.2) = 24.5 rejected. Geometric mean exp(0.05) both kept
    assert np.asarray(a_seq)[0, :4].all() and not np.asarray(a_seq)[1].any()
    np.testing.assert_array_equal(np.asarray(a_geo), mask)
    # i.i.d. noise, 200 responses of each length: reject rates by length
    rng = np.random.default_rng(0)
    n, L = 200, 64
    lengths = np.repeat([4, 64], n)
    mask = np.arange(L)[None] < lengths[:, None]
    old = np.full((2 * n, L), -1.0, np.float32)
    sampler = (old + 0.2 * rng.standard_normal(old.shape)).astype(np.float32)
    geo_band = C.RLConfig(
        mode="dense", rejection=C.RejectionConfig(enabled=True, statistic="ratio", aggregation="mean", lo=0.9, hi=1.1)
    )
    (a_seq, _, _), (a_geo, _, _) = behaviours(old, sampler, mask, (seq, geo_band))
    rate = lambda a, rows: 1.0 - np.asarray(a)[rows, 0].mean()  # noqa: E731 (a response's fate)
    short, long = slice(0, n), slice(n, 2 * n)
    assert rate(a_seq, long) > rate(a_seq, short) + 0.4, (rate(a_seq, short), rate(a_seq, long))
    # the geometric mean's spread shrinks with length: never more rejection for long responses
    assert rate(a_geo, long) <= rate(a_geo, short)


# ----------------------------------------------------------------------------- diagnostics


def test_off_policy_diagnostics_match_verl():
    """mismatch/kl_k1, kl_k3, chi2_token, chi2_seq, log_ppl_diff, log_ppl_abs_diff = verl's
    compute_offpolicy_metrics; ess_token = verl's ESS formula applied to xi."""
    cfg = C.RLConfig(mode="sparse_rl")
    for seed in range(2):
        old, sampler, mask = inputs(seed, scale=0.2)
        sampler = np.where(sampler > old + 5, old, sampler)  # chi2 of exp(+-20) tokens: no tolerance meaningful
        ((_, _, m),) = behaviours(old, sampler, mask, (cfg,))
        ref = V.offpolicy_metrics(old.astype(np.float64), sampler.astype(np.float64), mask)
        pairs = {
            "mismatch/kl_k1": "kl",
            "mismatch/kl_k3": "k3_kl",
            "mismatch/chi2_token": "chi2_token",
            "mismatch/chi2_seq": "chi2_seq",
            "mismatch/log_ppl_diff": "log_ppl_diff",
            "mismatch/log_ppl_abs_diff": "log_ppl_abs_diff",
        }
        for ours, theirs in pairs.items():
            assert float(m[ours]) == pytest.approx(ref[theirs], rel=1e-4, abs=1e-6), ours
        xi = np.exp(np.clip(_log_ratio(old, sampler, mask), -20, 20))
        assert float(m["mismatch/ess_token"]) == pytest.approx(V.ess(xi, mask, np.inf), rel=1e-4)
        assert 0 < float(m["weights/ess"]) <= 1


# ----------------------------------------------------------------------------- config and docs


@pytest.mark.parametrize(
    "section, kwargs, match",
    [
        (C.RejectionConfig, dict(statistic="k4"), r"rejection\.statistic='k4'"),
        (C.K3RsConfig, dict(lo=0.1), r"k3_rs\.lo=0\.1: the k3 statistic is >= 0"),
        (C.GeoRsConfig, dict(lo=2.0), r"geo_rs\.lo=2\.0 must be a number in \(0, geo_rs\.hi=1\.001\)"),
        (C.SeqMaskConfig, dict(hi=0), r"seq_mask\.hi=0 must be a number > 0"),
        (C.ImportanceConfig, dict(action="mask"), r"importance\.action='mask' \(IcePop\) needs a lower bound"),
        (C.IcepopConfig, dict(level="sentence"), r"icepop\.level='sentence'"),
        (C.RejectionConfig, dict(denominator="kept"), r"rejection\.denominator='kept'.*'after', 'before'"),
    ],
)
def test_bad_settings_name_the_setting(section, kwargs, match):
    with pytest.raises(ValueError, match=match):
        section(**kwargs)


def test_the_docs_table_is_the_registry():
    """docs/implementation.md's table is what `python -m sparserl_jax.rl.correction_table`
    renders from the registry and RL_MODES; every correction and mode documents its source."""
    with open(correction_table.DOC) as f:
        _, table, _ = correction_table.split_doc(f.read())
    assert table == correction_table.render(), "run: python -m sparserl_jax.rl.correction_table --write"
    for name, c in CORRECTIONS.items():
        assert c.source and c.formula and c.frameworks, name
    assert set(C.MODE_NOTES) == set(C.RL_MODES)
    for mode in C.RL_MODES:
        assert f"| `{mode}` |" in table
