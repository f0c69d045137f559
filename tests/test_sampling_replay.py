"""Training with top-p / top-k: the sampler records each token's kept set (rollout/sampling.py
sample_kept) and every log-prob is renormalised over it (model.transformer.chunked_logprobs
kept_ids), so on-policy ratios are 1 (to the float noise of two programs) where without the
replay they are biased by the log of the kept mass."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float_tol import logprob_tol

from sparserl_jax.config import load_config
from sparserl_jax.kvcache import KVConfig
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rl import config as C
from sparserl_jax.rl.batch import assemble
from sparserl_jax.rl.update import make_score_fn
from sparserl_jax.rollout import sampler as smp
from sparserl_jax.rollout.config import SortedConfig
from sparserl_jax.rollout.engine import Finished, SlotEngine
from sparserl_jax.rollout.sampling import TIE_SLOTS, SamplingConfig, kept_width, processed_logprobs, sample_kept
from sparserl_jax.rollout.scheduler import SortedScheduler
from sparserl_jax.train import Trainer

CFG = ModelConfig.tiny("qwen2", vocab_size=64)
PARAMS = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, tf.init_params(CFG, jax.random.key(0)))
SMOKE = os.path.join(os.path.dirname(__file__), "..", "experiments", "configs", "smoke.yaml")
FILTERS = SamplingConfig(temperature=1.0, top_p=0.9, top_k=20)


def test_kept_set_logprobs_match_numpy():
    """chunked_logprobs with kept sets: log softmax over each position's set (float64 NumPy),
    the whole vocabulary where a position has none; without kept sets, the plain path."""
    rng = np.random.default_rng(0)
    B, T, D, V, K = 3, 7, 8, 32, 5
    h = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((D, V)), jnp.float32)
    targets = rng.integers(0, V, (B, T))
    kept = np.full((B, T, K), -1, np.int32)
    for b in range(B):
        for t in range(T - 2):  # the last two positions of every row have no set
            n = rng.integers(1, K + 1)
            ids = rng.choice(V, n, replace=False)
            ids[0] = targets[b, t]  # the sampled token is in its set
            kept[b, t, :n] = ids
    got, ent = tf.chunked_logprobs(h, w, jnp.asarray(targets), temperature=0.7, chunk_tokens=8, kept_ids=kept)
    plain, ent0 = tf.chunked_logprobs(h, w, jnp.asarray(targets), temperature=0.7, chunk_tokens=8)
    logits = np.einsum("btd,dv->btv", np.asarray(h, np.float64), np.asarray(w, np.float64)) / 0.7
    for b in range(B):
        for t in range(T):
            ids = kept[b, t][kept[b, t] >= 0]
            over = logits[b, t, ids] if len(ids) else logits[b, t]
            want = logits[b, t, targets[b, t]] - np.log(np.exp(over - over.max()).sum()) - over.max()
            assert float(got[b, t]) == pytest.approx(want, abs=1e-4), (b, t)
    np.testing.assert_array_equal(np.asarray(got)[:, -2:], np.asarray(plain)[:, -2:])
    np.testing.assert_array_equal(np.asarray(ent), np.asarray(ent0))  # the whole distribution's
    assert np.all(np.asarray(got)[:, :-2] >= np.asarray(plain)[:, :-2])  # a subset's mass is <= 1


def test_sample_kept_draws_from_the_recorded_set():
    """The kept set is the top-k / top-p set of the processed distribution, the token is drawn
    from it, and its log-prob is the set's renormalised one."""
    logits = jax.random.normal(jax.random.key(3), (64, 64)) * 3
    token, logp, ids = (np.asarray(x) for x in sample_kept(logits, jax.random.key(4), FILTERS))
    proc = np.asarray(processed_logprobs(logits, FILTERS))
    for b in range(64):
        kept = ids[b][ids[b] >= 0]
        np.testing.assert_array_equal(np.sort(kept), np.sort(np.nonzero(np.isfinite(proc[b]))[0]))
        assert token[b] in kept
        vals = proc[b, kept].astype(np.float64)
        want = proc[b, token[b]] - np.log(np.exp(vals - vals.max()).sum()) - vals.max()
        assert logp[b] == pytest.approx(want, abs=1e-5)
    assert 1 < np.mean([(i >= 0).sum() for i in ids]) < FILTERS.top_k  # top-p cut inside the top 20


def _tied_logits():
    """Logits h @ w over 32 tokens whose tokens 9-15 share one column of w (7 logits tied at every
    position), and positions that put that tied group at every rank from the top to the tail."""
    rng = np.random.default_rng(5)
    D, V, N = 8, 32, 24
    w = rng.standard_normal((D, V))
    w[:, 10:16] = w[:, 9:10]
    h = rng.standard_normal((N, D)) + np.linspace(-1.5, 2.5, N)[:, None] * w[:, 9] / np.sum(w[:, 9] ** 2)
    h, w = jnp.asarray(h, jnp.float32), jnp.asarray(w, jnp.float32)
    return h, w, jnp.dot(h, w, preferred_element_type=jnp.float32)


@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_ties_at_the_kth_logit_are_kept_and_replayed(top_p):
    """Several logits tied at the k-th largest value: the sampler keeps every tied token, as
    processed_logprobs and vLLM's top-k do (not exactly k), records that set (the record is
    kept_width(k) = k + TIE_SLOTS wide), draws from it with processed_logprobs' probabilities, and
    the learner's replay over the recorded ids gives the sampler's log-prob."""
    h, w, logits = _tied_logits()
    cfg = SamplingConfig(temperature=1.0, top_p=top_p, top_k=4)
    proc = np.asarray(processed_logprobs(logits, cfg))
    sizes = []
    for seed in range(8):
        token, logp, ids = (np.asarray(x) for x in sample_kept(logits, jax.random.key(seed), cfg))
        assert ids.shape == (h.shape[0], kept_width(cfg.top_k)) == (h.shape[0], cfg.top_k + TIE_SLOTS)
        for b in range(h.shape[0]):
            kept = ids[b][ids[b] >= 0]
            np.testing.assert_array_equal(np.sort(kept), np.nonzero(np.isfinite(proc[b]))[0])
            assert token[b] in kept and logp[b] == pytest.approx(proc[b, token[b]], abs=1e-5)
            sizes.append(len(kept))
        replay, _ = tf.chunked_logprobs(h[None], w, jnp.asarray(token)[None], chunk_tokens=8, kept_ids=ids[None])
        np.testing.assert_allclose(np.asarray(replay)[0], logp, atol=1e-5)
    # the tied group straddles the 4th rank at some positions: sets of more than k tokens
    assert max(sizes) > cfg.top_k and (top_p < 1 or min(sizes) >= cfg.top_k)


def test_ties_beyond_the_record_are_cut_and_the_draw_follows_the_cut():
    """More than TIE_SLOTS tokens tied at the k-th value (here every logit equal): the set is cut
    to the record's width, the lowest ids first (lax.top_k's order), and the token is drawn from
    that cut set with its renormalised log-prob, which the replay reproduces."""
    V, k = 64, 4
    width = kept_width(k)
    logits = jnp.zeros((16, V))
    cfg = SamplingConfig(temperature=1.0, top_k=k)
    assert np.isfinite(np.asarray(processed_logprobs(logits, cfg))).all()  # the top-k rule keeps all 64
    token, logp, ids = (np.asarray(x) for x in sample_kept(logits, jax.random.key(0), cfg))
    np.testing.assert_array_equal(ids, np.broadcast_to(np.arange(width), (16, width)))
    assert np.all(token < width) and len(set(token.tolist())) > 1
    np.testing.assert_allclose(logp, -np.log(width), rtol=1e-6)
    h, w = jnp.ones((16, 1)), jnp.zeros((1, V))  # logits 0 everywhere, through the learner's path
    replay, _ = tf.chunked_logprobs(h[None], w, jnp.asarray(token)[None], chunk_tokens=8, kept_ids=ids[None])
    np.testing.assert_allclose(np.asarray(replay)[0], logp, rtol=1e-6)


def _sorted_rollout(prompts, lengths, cfg):
    """The SortedRL scheduler's rollout of 2 prompts x 2 samples on Q = 3 slots in partial mode,
    resume 'prefill', the same weights at both harvests: prompt 1's first sample is harvested
    mid-way at the first harvest and resumed after re-prefilling (forced lengths 3, 4 and M, M).
    Returns the two harvests' (prompt tokens, prompt lengths, Rollout) joined."""
    M = cfg.max_new_tokens
    engine = SlotEngine(CFG, cfg, 3, prompts.shape[1], segment_chunks=1)
    sched = SortedScheduler(
        engine, SortedConfig(mode="partial", group_batches=2, resume="prefill"), prompts_per_batch=1, samples=2
    )
    sched.load_group([0, 1], np.asarray(prompts[::2]), np.asarray(lengths[::2]), jax.random.key(1), [[3, 4], [M, M]])
    (ptok0, plen0, first), (ptok1, plen1, second) = (sched.next_batch(PARAMS, v)[1:4] for v in range(2))
    assert len(set(second.version[0])) == 2  # prompt 1's first sample was resumed at the harvest
    ptok, plen = np.concatenate([ptok0, ptok1]), np.concatenate([plen0, plen1])
    return ptok, plen, Finished.concat([first, second]).to_rollout()


def _on_policy_xi(scheduler: str):
    """log xi = log pi_old - log pi_sampler on the response tokens of a dense rollout sampled
    with top-p 0.9 / top-k 20 by the static sampler or the SortedRL scheduler, pi_old = the
    sampler's own weights: (scored with the replay of the kept sets, scored without)."""
    B, P, M = 4, 6, 10
    prompts = jax.random.randint(jax.random.key(7), (B, P), 1, CFG.vocab_size)
    lengths = jnp.full((B,), P)
    cfg = smp.SamplerConfig(max_new_tokens=M, sampling=FILTERS, kv=KVConfig(buffer=5), replay_filters=True)
    if scheduler == "batch":
        out = smp.generate_jit(PARAMS, CFG, prompts, lengths, jax.random.key(1), cfg)
    else:
        prompts, lengths, out = _sorted_rollout(prompts, lengths, cfg)
    batch = assemble(prompts, lengths, out.tokens, out.logprobs, out.mask, response_kept_ids=out.kept_ids)
    score = make_score_fn(CFG, C.UpdateConfig(minibatch_size=4, micro_batch_size=4, score_batch_size=2))
    mask, sampler_logp = np.asarray(batch["response_mask"]), np.asarray(batch["sampler_logp"])
    return tuple(
        (np.asarray(score(PARAMS, batch["tokens"], ids)) - sampler_logp)[mask] for ids in (batch["kept_ids"], None)
    )


@pytest.mark.parametrize("scheduler", ["batch", "sorted"])
def test_on_policy_ratios_are_one_with_the_replay_and_biased_without(scheduler):
    """The acceptance check of the replay: xi = pi_old / pi_sampler (and so r, TIS, SARS) is 1 on
    policy with top-p 0.9 and top-k 20 to the float noise of decode vs teacher forcing, from the
    static sampler and from the SortedRL scheduler (a response resumed after a harvest among
    them); scored over the whole vocabulary it is the kept mass, < 1 by far more than that noise."""
    tol = logprob_tol(CFG, PARAMS, keys=16)
    with_replay, without = _on_policy_xi(scheduler)
    assert np.abs(with_replay).max() <= tol, (np.abs(with_replay).max(), tol)
    assert np.all(without <= tol) and np.mean(without) < -20 * tol, (np.mean(without), tol)
    # every correction reads that xi: SARS accepts every token, IBR's weights are 1
    rl = C.RLConfig(mode="sparse_rl")
    assert float(np.mean((np.exp(with_replay) >= rl.sars.token_lo) & (np.exp(with_replay) <= rl.sars.token_hi))) == 1


# the SortedRL scheduler on-policy: every trained token sampled by the current weights
SCHEDULERS = {"batch": (), "sorted": ("rollout.scheduler=sorted", "sorted.mode=on_policy", "sorted.group_batches=2")}


@pytest.mark.slow
@pytest.mark.parametrize(
    "scheduler",
    # the sorted run in the extended tier: its replay is the on-policy ratio test's above (sorted,
    # a resumed row among them), its agreement logging test_train_sorted's
    [pytest.param("batch"), pytest.param("sorted", marks=pytest.mark.extended)],
)
def test_dense_top_p_training_runs_end_to_end(tmp_path, scheduler):
    """A dense run sampled with top-p 0.9 within top-k 20 trains, with the static sampler or the
    SortedRL scheduler: finite updates, pi_old replayed over the kept sets equals the sampler's
    log-probs (mismatch at float noise), and the agreement's tail is logged."""
    cfg = load_config(
        [SMOKE],
        [
            f"train.out_dir={tmp_path}",
            "train.progress=false",
            "train.iterations=2",
            "rl.mode=dense",
            "kv.policy=none",
            "rollout.top_p=0.9",
            "rollout.top_k=20",
            "rollout.agreement_k=20",  # a dense run records no candidates unless asked ("auto")
            *SCHEDULERS[scheduler],
        ],
    )
    trainer = Trainer(cfg)
    assert trainer.sampler_cfg.replay_filters and trainer.learner.update.kept_k == kept_width(20)
    trainer.start()
    # the float noise of decode against teacher forcing for this model over the run's widest rows
    tol = logprob_tol(trainer.model_cfg, trainer.params, keys=cfg.data.max_prompt_len + cfg.rollout.max_new_tokens)
    metrics = list(trainer.run())
    assert len(metrics) == 2
    for m in metrics:
        assert np.isfinite(m["update/loss"]) and m["update/skipped"] == 0
        assert m["mismatch/abs_dlogp_max"] <= tol, (m["mismatch/abs_dlogp_max"], tol)
        assert np.exp(-tol) <= m["xi/p5"] and m["xi/p95"] <= np.exp(tol)
        # the agreement with pi_old: a dense sampler's upper bound is 1 (its truncation is all
        # that separates the bounds)
        assert 0 < m["agreement/p5"] <= m["agreement/mean"] <= 1 and m["agreement/upper_p5"] > 0.999
