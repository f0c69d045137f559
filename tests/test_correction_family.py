"""The rejection and importance-weight family (rl/corrections/rejection.py, importance.py,
divergence.py), its presets and verl's off-policy diagnostics, against NumPy transcriptions of the
published formulas (tests/verl_reference.py: verl's rollout_corr_helper.py and presets, AReaL's
ratio rule) on random inputs; the length bias of the sequence product against the geometric mean;
the generated table of docs/implementation.md."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import verl_reference as V

from sparserl_jax.rl import config as C
from sparserl_jax.rl import correction_table
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
