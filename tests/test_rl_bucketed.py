"""The length-bucketed learner (rl/bucketed.py) against the one-program padded update
(rl/update.make_update_fn): the same parameters and metrics to float tolerance for every path
(pi_old scored or taken from the update's forward, pi_ref scored, fused or skipped, rows
regrouped by length or not, one or several minibatches and epochs), the bucket planning, and no
compilation after the first batch (a compile counter, not a timing)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring
from test_rl_update import SGD_COUNTING, M, _random_rollout, key, random_params

from sparserl_jax import rl
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rl import buckets
from sparserl_jax.rl import update as update_lib
from sparserl_jax.rl.bucketed import BucketedUpdate, Path
from sparserl_jax.rl.config import RejectionConfig
from sparserl_jax.rl.corrections import CORRECTIONS, Correction, register

MC = ModelConfig.tiny()
pytestmark = pytest.mark.xdist_group("rl_update")  # shares test_rl_update's compiled programs


def test_bucket_planning():
    assert buckets.bucket_widths(12, 4) == (4, 8, 12)
    assert buckets.bucket_widths(10, 4) == (4, 8, 10)
    assert buckets.bucket_widths(12, 0) == buckets.bucket_widths(12, 16) == (12,)
    assert buckets.width_for(5, (4, 8, 12)) == 8 and buckets.width_for(4, (4, 8, 12)) == 4
    with pytest.raises(ValueError, match="wider"):
        buckets.width_for(13, (4, 8, 12))
    mask = np.zeros((3, 6), bool)
    mask[0, 1:4] = True  # last response position 3 scores token 4: needs 5 columns
    mask[2, 2:6] = True  # up to the end: the full width
    np.testing.assert_array_equal(buckets.row_lengths(mask), [5, 1, 6])
    lengths = np.array([9, 2, 7, 3, 12, 1])
    plan = buckets.plan(lengths, np.arange(6), 2, (4, 8, 12), group=True)
    assert [list(mb.rows) for mb in plan] == [[5, 1], [3, 2], [0, 4]]
    assert [mb.width for mb in plan] == [4, 8, 12]
    plan = buckets.plan(lengths, np.arange(6), 4, (4, 8, 12), group=False)
    assert [list(mb.rows) for mb in plan] == [[0, 1, 2, 3], [4, 5]]
    assert [mb.width for mb in plan] == [12, 12]


def _cfg(
    mode="sparse_rl",
    *,
    normalisation="micro_batch",
    aggregation="seq_mean",
    beta=0.01,
    minibatch=8,
    micro=2,
    epochs=1,
    **update,
):
    update = {"length_bucket": 4, **update}
    return rl.RLConfig(
        mode=mode,
        ibr=rl.IbrConfig(normalisation=normalisation),
        loss=rl.LossConfig(aggregation=aggregation, beta=beta),
        update=rl.UpdateConfig(
            minibatch_size=minibatch,
            micro_batch_size=micro,
            epochs=epochs,
            temperature=0.9,
            chunk_tokens=16,
            score_batch_size=3,
            **update,
        ),
    )


P = Path
CASES = {  # name -> (config, the exact paths it allows; the test runs each)
    "sparse_rl, IBR per micro-batch: fused keeping the rows, or scored and regrouped": (
        _cfg(),
        [P(True, False, True), P(False, True, True)],
    ),
    "sparse_rl fused, no pi_ref (beta 0), regrouped, token mean": (
        _cfg(normalisation="none", beta=0.0, aggregation="token_mean"),
        [P(True, True, False)],
    ),
    "dense fused, regrouped": (_cfg("dense"), [P(True, True, True)]),
    "sparse_rl scored, global IBR, 2 minibatches, token mean": (
        _cfg(normalisation="global", aggregation="token_mean", minibatch=4),
        [P(False, True, True)],
    ),
    "qurl scored, 2 epochs (pi_ref scored), IBR per micro-batch fixed before regrouping": (
        _cfg("qurl", epochs=2),
        [P(False, True, False)],
    ),
    "sparse_rl padded widths, no regrouping": (
        _cfg(length_bucket=0, group_by_length=False, reuse_old_forward=False),
        [P(False, False, True)],
    ),
    # update.head_window="response" (the head over each row's M positions from its first response
    # position; at the 12-position width only, where M = 8 is narrower): pi_old fused or scored,
    # pi_ref in the micro-batch program or scored
    "sparse_rl, the head over the response window: fused, or scored and regrouped": (
        _cfg(head_window="response"),
        [P(True, False, True), P(False, True, True)],
    ),
}


def _batch():
    """A random rollout of 8 rows of width 12 with rows of 1-12 positions, a sparse sampler."""
    k_params, k_ref, k_data = jax.random.split(key(0), 3)
    packed, _, noise, adv = _random_rollout(k_data)
    params, ref_params = random_params(MC, k_params), random_params(MC, k_ref)
    return params, ref_params, packed, noise, adv


@functools.cache
def _case(name: str):
    """A case's batch, the padded update's result on it and its bucketed learner, built once for
    all of the case's paths (the learner compiles every path of a batch shape at its first call)."""
    return _padded_and_bucketed(CASES[name][0])


def _padded_and_bucketed(cfg: rl.RLConfig):
    params, ref_params, packed, noise, adv = _batch()
    score = update_lib.make_score_fn(MC, cfg.update)
    old = score(params, packed["tokens"])
    sampler = jnp.where(packed["response_mask"], old + noise, 0.0)
    ref_batch = dict(
        packed, sampler_logp=sampler, old_logp=old, ref_logp=score(ref_params, packed["tokens"]), advantages=adv
    )
    want_params, _, want = update_lib.make_update_fn(MC, cfg, SGD_COUNTING)(
        params, SGD_COUNTING.init(params), ref_batch
    )
    host = {k: np.asarray(v) for k, v in dict(packed, sampler_logp=sampler, advantages=adv).items()}
    response_len = M if cfg.update.head_window == "response" else None  # rollout.max_new_tokens
    upd = BucketedUpdate(MC, cfg, SGD_COUNTING, donate=False, response_len=response_len)
    return params, ref_params, host, old, want_params, want, upd


@pytest.mark.parametrize("name,i", [(n, i) for n, (_, paths) in CASES.items() for i in range(len(paths))])
def test_bucketed_update_equals_padded_update(name, i, monkeypatch):
    cfg, paths = CASES[name]
    path = paths[i]
    params, ref_params, host, old, want_params, want, upd = _case(name)
    assert upd.paths(8) == paths
    monkeypatch.setattr(upd, "choose", lambda lengths, widths: path)  # this path, whatever it costs
    lengths = buckets.row_lengths(host["response_mask"])
    assert len(set(lengths)) > 3 and lengths.max() > 8  # rows of many widths, some at the full width
    got_params, state, out = upd(params, ref_params, SGD_COUNTING.init(params), host)

    assert int(state[1].count) == int(want["steps"])
    # Float tolerance: the same float32 sums over ~100 tokens in another order (other micro-batch
    # compositions and widths, the denominator applied once at the end), so relative ~1e-6 per
    # sum; a gradient entry differs by up to ~1e-5 of the largest one; plus the rounding of
    # p - g itself (one float32 ulp of |p| per step). A wrong path (a missing row, a wrong
    # normaliser or denominator) changes entries by >= 10% of the largest.
    _assert_same_params(cfg, params, want_params, got_params)
    want = {k: float(v) for k, v in want.items()}
    if cfg.loss.beta == 0:
        assert "loss/kl_ref" not in out.metrics
        want.pop("loss/kl_ref")
    assert out.metrics.pop("old_from_update") == float(path.fused)
    assert set(out.metrics) == set(want)
    for k, v in want.items():
        # metrics are means of O(1) per-token values over the same tokens: relative 1e-5
        np.testing.assert_allclose(out.metrics[k], v, rtol=1e-4, atol=1e-6, err_msg=k)
    mask = host["response_mask"]
    # pi_old: the learner's forward (fused) or the bucketed scorer, on every response token
    np.testing.assert_allclose(out.old_logp[mask], np.asarray(old)[mask], rtol=0, atol=2e-5)
    assert out.score_s == 0.0 if path.fused and (path.ref_inside or cfg.loss.beta == 0) else out.score_s > 0
    full = 8 * 12 * cfg.update.epochs
    assert out.positions < full if cfg.update.length_bucket else out.positions == full


def _assert_same_params(cfg, params, want_params, got_params):
    eps = np.finfo(np.float32).eps
    for w, g, p in zip(jax.tree.leaves(want_params), jax.tree.leaves(got_params), jax.tree.leaves(params)):
        w, g, p = np.asarray(w), np.asarray(g), np.asarray(p)
        delta = np.abs(w - p).max()  # SGD at lr 1: the gradient itself
        ulps = cfg.update.epochs * 2 * eps * np.abs(p).max()
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-4 * delta + ulps)


@dataclasses.dataclass(frozen=True)
class ToyWeightConfig:
    """A weighting correction the package does not ship: w = min(xi, cap), normalised to mean 1
    over the whole rollout batch (its own choice, not rl.ibr's)."""

    cap: float = 1.25


TOY_WEIGHT = Correction(
    name="toy_weight",
    settings=ToyWeightConfig,
    weight=lambda m, s: jnp.minimum(m.xi, s.cap),
    normalise=lambda s: ("global", "valid"),
)


@dataclasses.dataclass(frozen=True)
class RLConfigWithToyWeight(rl.RLConfig):
    toy_weight: ToyWeightConfig = ToyWeightConfig()


@pytest.fixture
def toy_weight(monkeypatch):
    register(TOY_WEIGHT)
    monkeypatch.setitem(rl.RL_MODES, "toy_weight", ("sars", "toy_weight"))
    yield
    del CORRECTIONS["toy_weight"]


def test_a_new_weighting_correction_is_normalised_alike_by_both_updates(toy_weight):
    """The padded update and the bucketed one read a weighting correction's normalisation from the
    same code: a toy one normalised globally gives one update through both, although rl.ibr (not
    in force) says "micro_batch"."""
    base = _cfg(minibatch=4)
    cfg = RLConfigWithToyWeight(mode="toy_weight", loss=base.loss, update=base.update)
    assert cfg.ibr.normalisation == "micro_batch" and cfg.corrections == ("sars", "toy_weight")
    params, ref_params, host, _, want_params, want, upd = _padded_and_bucketed(cfg)
    assert upd.paths(8) == [P(False, True, True)]  # global: every row's pi_old scored first
    got_params, _, out = upd(params, ref_params, SGD_COUNTING.init(params), host)
    _assert_same_params(cfg, params, want_params, got_params)
    assert "ibr/normaliser" in want and float(want["ibr/normaliser"]) != 1.0
    np.testing.assert_allclose(out.metrics["ibr/normaliser"], float(want["ibr/normaliser"]), rtol=1e-5)


def test_areals_denominator_is_counted_alike_by_both_updates():
    """A rejection whose denominator is "before" (AReaL's) divides the minibatch's gradient by
    the response tokens counted before it rejects (token mean, one minibatch): the padded update's
    gradient is the "after" one times N_kept / N_before, and the bucketed update (which sums the
    micro-batches' counts) takes the same step."""
    base = _cfg("dense", normalisation="none", aggregation="token_mean", beta=0.0)
    cfgs = {
        d: dataclasses.replace(base, rejection=RejectionConfig(enabled=True, lo=0.8, hi=1.25, denominator=d))
        for d in ("before", "after")
    }
    params, ref_params, host, _, want_before, m_before, upd = _padded_and_bucketed(cfgs["before"])
    _, _, _, _, want_after, m_after, _ = _padded_and_bucketed(cfgs["after"])
    n_kept, n_before = float(m_before["tokens"]), float(m_before["counted_tokens"])
    assert 0 < n_kept < n_before == host["response_mask"].sum() and "counted_tokens" not in m_after
    eps = np.finfo(np.float32).eps
    for p, b, a in zip(jax.tree.leaves(params), jax.tree.leaves(want_before), jax.tree.leaves(want_after)):
        p, b, a = np.asarray(p), np.asarray(b), np.asarray(a)  # SGD at lr 1: the gradients
        want = (a - p) * n_kept / n_before
        np.testing.assert_allclose(b - p, want, rtol=0, atol=1e-5 * np.abs(want).max() + 4 * eps * np.abs(p).max())
    got_params, _, out = upd(params, ref_params, SGD_COUNTING.init(params), host)
    _assert_same_params(cfgs["before"], params, want_before, got_params)
    assert out.metrics["counted_tokens"] == n_before and out.metrics["tokens"] == n_kept


def test_the_cheaper_exact_path_is_chosen():
    """IBR per micro-batch: rows of equal length make the fused path (no scoring pass) cheaper; a
    long row in every micro-batch makes scoring first and regrouping cheaper."""
    upd = BucketedUpdate(MC, _cfg(), SGD_COUNTING)
    widths = (4, 8, 12)
    fused, scored = upd.paths(8)
    assert upd.choose(np.full(8, 7), widths) == fused
    uneven = np.array([12, 1, 12, 1, 12, 1, 12, 1])  # micro-batches of 2: each holds a long row
    assert upd.cost(fused, uneven, widths) == 8 * 12 * 4  # every micro-batch at full width, + pi_ref
    # scored: length-sorted scoring chunks of 3 rows (widths 4, 12, 12), then micro-batches of 2
    # regrouped (two at width 4, two at 12), forward + backward + pi_ref inside
    assert upd.cost(scored, uneven, widths) == (3 * 4 + 3 * 12 + 2 * 12) + (2 * 2 * 4 + 2 * 2 * 12) * 4
    assert upd.choose(uneven, widths) == scored


def test_no_compilation_after_the_first_batch():
    """Every width is compiled by the first call; later batches of other lengths compile nothing."""
    cfg = _cfg(normalisation="global", minibatch=4, beta=0.01)  # scored path: score + update programs
    params, ref_params, packed, noise, adv = _batch()
    upd = BucketedUpdate(MC, cfg, SGD_COUNTING, donate=True)
    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if "backend_compile" in event else None
    )
    state = SGD_COUNTING.init(params)
    params = jax.tree.map(jnp.copy, params)  # donated below
    for i in range(3):
        mask = np.asarray(packed["response_mask"]).copy()
        if i == 1:
            mask[:, 6:] = False  # every row short: only the narrow widths run
        host = {
            "tokens": np.asarray(packed["tokens"]),
            "response_mask": mask,
            "sampler_logp": np.where(mask, -1.0 - 0.1 * i, 0.0).astype(np.float32),
            "advantages": np.asarray(adv),
        }
        n0 = len(compiles)
        params, state, out = upd(params, ref_params, state, host)
        if i == 0:
            assert len(compiles) > n0  # the first call compiles every width
        else:
            assert len(compiles) == n0, f"batch {i} compiled {compiles[n0:]}"
        assert np.isfinite(out.metrics["loss"])


def _with_kept_and_top(packed, n_kept=5, n_top=4):
    """The batch's response positions with random kept sets (the scored token among them) and
    top candidates (a sampler's, inside its kept set): the replay and the agreement's inputs."""
    rng = np.random.default_rng(0)
    tokens, mask = np.asarray(packed["tokens"]), np.asarray(packed["response_mask"])
    B_, T_ = tokens.shape
    kept = np.full((B_, T_, n_kept), -1, np.int32)
    top = np.full((B_, T_, n_top), -1, np.int32)
    for b, t in zip(*np.nonzero(mask)):
        n = rng.integers(2, n_kept + 1)
        ids = rng.choice(MC.vocab_size, n, replace=False)
        ids[0] = tokens[b, (t + 1) % T_]
        kept[b, t, :n] = ids
        top[b, t, : min(n, n_top)] = ids[:n_top]
    return kept, top


_FUSED, _SCORED = CASES["sparse_rl, IBR per micro-batch: fused keeping the rows, or scored and regrouped"][1]


# the scored path's replay also runs end to end in the default tier (tests/test_sampling_replay.py's
# top-p run scores pi_old first); its comparison with the padded update is the extended tier's
@pytest.mark.parametrize("path", [_FUSED, pytest.param(_SCORED, marks=pytest.mark.extended)])
def test_replayed_kept_sets_and_top_candidates_through_both_paths(path, monkeypatch):
    """With kept sets (top-p / top-k training) and top candidates (the agreement), each exact
    path equals the padded update fed the same kept sets, and returns pi_old's log-probs of the
    top candidates as one teacher-forced forward computes them."""
    cfg = _cfg()
    params, ref_params, packed, noise, adv = _batch()
    kept, top = _with_kept_and_top(packed)
    score = update_lib.make_score_fn(MC, cfg.update)
    old = score(params, packed["tokens"], jnp.asarray(kept))
    plain = score(params, packed["tokens"])
    mask = np.asarray(packed["response_mask"])
    assert np.all(np.asarray(old)[mask] >= np.asarray(plain)[mask])  # renormalised over fewer tokens
    sampler = jnp.where(packed["response_mask"], old + noise, 0.0)
    ref_batch = dict(
        packed,
        sampler_logp=sampler,
        old_logp=old,
        ref_logp=score(ref_params, packed["tokens"], jnp.asarray(kept)),
        advantages=adv,
        kept_ids=jnp.asarray(kept),
    )
    want_params, _, want = update_lib.make_update_fn(MC, cfg, SGD_COUNTING)(
        params, SGD_COUNTING.init(params), ref_batch
    )
    host = {k: np.asarray(v) for k, v in dict(packed, sampler_logp=sampler, advantages=adv).items()}
    host.update(kept_ids=kept, top_ids=top)
    upd = BucketedUpdate(MC, cfg, SGD_COUNTING, donate=False, kept_k=kept.shape[-1], top_k=top.shape[-1])
    monkeypatch.setattr(upd, "choose", lambda lengths, widths: path)
    got_params, _, out = upd(params, ref_params, SGD_COUNTING.init(params), host)
    _assert_same_params(cfg, params, want_params, got_params)
    np.testing.assert_allclose(out.old_logp[mask], np.asarray(old)[mask], rtol=0, atol=2e-5)
    for k in ("loss/pg", "mismatch/kl_k3"):
        np.testing.assert_allclose(out.metrics[k], float(want[k]), rtol=1e-4, atol=1e-6, err_msg=k)
    # pi_old of the top candidates: a teacher-forced forward with the same kept sets
    _, _, want_top = jax.jit(
        lambda p: tf.token_logprobs(
            p, MC, packed["tokens"], temperature=0.9, chunk_tokens=16, kept_ids=kept, gather_ids=top
        )
    )(params)
    has = (top >= 0) & mask[:, :, None]
    np.testing.assert_allclose(out.old_top_logp[has], np.asarray(want_top)[has], rtol=0, atol=2e-5)
    assert np.all(np.isneginf(out.old_top_logp[top < 0]))
    # a batch without what the update was built for is refused, naming it
    with pytest.raises(ValueError, match=r"lacks the sampler's top candidates"):
        upd(params, ref_params, SGD_COUNTING.init(params), {k: v for k, v in host.items() if k != "top_ids"})
