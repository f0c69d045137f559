"""The slot engine and the SortedRL scheduler: equal to the static sampler, per-request results
under refills, harvests, versions, bubble ratios, resume, an 8-device mesh and bad settings."""

import collections
import dataclasses
import os
import pathlib
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparserl_jax import kvcache as kv
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rollout import sampler as smp
from sparserl_jax.rollout.config import SortedConfig
from sparserl_jax.rollout.engine import SlotEngine, bubble_ratio
from sparserl_jax.rollout.sampling import SamplingConfig
from sparserl_jax.rollout.scheduler import SortedScheduler
from sparserl_jax.rollout.stats import rollout_bubble

CFG = ModelConfig.tiny("qwen2", vocab_size=64, n_layers=1)  # one layer: half the compile time
PARAMS = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, tf.init_params(CFG, jax.random.key(0)))
P = 10


def _prompts(n, seed=7):
    tokens = np.array(jax.random.randint(jax.random.key(seed), (n, P), 1, CFG.vocab_size), np.int32)
    lengths = np.asarray(jax.random.randint(jax.random.key(seed + 1), (n,), 3, P + 1), np.int32)
    tokens[np.arange(P)[None] >= lengths[:, None]] = 0
    return tokens, lengths


def _kv(policy, trigger="interval"):
    return kv.KVConfig(policy=policy, budget=8, buffer=4, window=2, trigger=trigger, newline_token_ids=(3,))


def _assert_same(got, ref, rows=None):
    """Engine rows (Finished) equal the static sampler's (Rollout) on the generated tokens."""
    rows = slice(None) if rows is None else rows
    mask = np.asarray(ref.mask)[rows]
    np.testing.assert_array_equal(got.lengths, np.asarray(ref.lengths)[rows])
    np.testing.assert_array_equal(got.tokens, np.asarray(ref.tokens)[rows])
    np.testing.assert_allclose(got.logprobs, np.asarray(ref.logprobs)[rows], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got.kept * mask, np.asarray(ref.kept)[rows] * mask)
    np.testing.assert_array_equal(got.n_compressions, np.asarray(ref.n_compressions)[rows])


def _assert_same_records(got, ref, rtol=1e-5, atol=1e-6):
    """Engine rows' per-token records (kept sets, top candidates) equal the static sampler's rows,
    every position (-1 / 0 after the end): the ids exactly, the log-probs as the sampler's."""
    for name in ("kept_ids", "top_ids"):
        np.testing.assert_array_equal(getattr(got, name), np.asarray(getattr(ref, name)), err_msg=name)
    np.testing.assert_allclose(got.top_logp, np.asarray(ref.top_logp), rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "policy,trigger",
    [(p, "interval") for p in ("none", "streaming", "h2o", "snapkv", "rkv", "random")]
    + [("snapkv", "newline"), ("random", "newline")],
)
def test_engine_with_enough_slots_equals_the_static_sampler(policy, trigger):
    eng = _engine(policy, trigger)
    tokens, lengths = _prompts(3)
    ids = np.array([4, 0, 9], np.int32)
    ref = smp.generate_jit(
        PARAMS, CFG, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(2), eng.cfg, jnp.asarray(ids)
    )
    got = eng.run(PARAMS, jax.random.key(2), tokens, lengths, ids)
    _assert_same(got, ref)
    assert 0.0 <= eng.stats.bubble_slots() < 1.0


# ----------------------------------------------------------------------------- refills

N = 5  # requests in the refill tests, on Q = 3 slots
M = 12
ENGINES = {}
# top-p 0.9 within top-k 20, recording each token's kept set and its 20 most probable tokens
RECORDS = dict(sampling=SamplingConfig(top_p=0.9, top_k=20), replay_filters=True, agreement_k=20)


def _engine(policy, trigger="interval", records=False):
    """One engine (and its compiled programs) per KV setting for the whole module: Q = 3;
    `records`: the sampler records each token's kept set and top candidates (RECORDS)."""
    if (policy, trigger, records) not in ENGINES:
        extra = RECORDS if records else {}
        cfg = smp.SamplerConfig(max_new_tokens=M, eos_token_ids=(5,), kv=_kv(policy, trigger), **extra)
        ENGINES[policy, trigger, records] = SlotEngine(CFG, cfg, 3, P, segment_chunks=1)
    return ENGINES[policy, trigger, records]


REFS = {}


def _refill_case(policy):
    """N = 5 requests and their static-sampler generation (one batch, no refills)."""
    eng = _engine(policy)
    if policy not in REFS:
        tokens, lengths = _prompts(N, seed=3)
        REFS[policy] = (
            tokens,
            lengths,
            smp.generate_jit(PARAMS, CFG, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(4), eng.cfg),
        )
    return (eng, *REFS[policy])


@settings(max_examples=2, deadline=None)
@given(order=st.permutations(range(N)), limits=st.lists(st.integers(1, M), min_size=N, max_size=N))
@pytest.mark.parametrize("policy", ["none", "snapkv"])
def test_refills_give_each_request_its_own_generation(policy, order, limits):
    """With Q < N, any admission order and forced lengths, request r's tokens and log-probs are
    those of its generation without refills (a prefix of it, when forced shorter); slots reused
    after long occupants carry nothing over."""
    eng, tokens, lengths, ref = _refill_case(policy)
    order = np.asarray(order)
    got = eng.run(PARAMS, jax.random.key(4), tokens[order], lengths[order], order, limits=np.asarray(limits))
    full = np.asarray(ref.lengths)[order]
    for j, r in enumerate(order):
        n = min(limits[j], full[j])
        assert got.lengths[j] == n
        np.testing.assert_array_equal(got.tokens[j, :n], np.asarray(ref.tokens)[r, :n])
        np.testing.assert_allclose(got.logprobs[j, :n], np.asarray(ref.logprobs)[r, :n], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got.kept[j, :n], np.asarray(ref.kept)[r, :n])
        assert (got.tokens[j, n:] == 0).all() and (got.logprobs[j, n:] == 0).all()


def test_refills_record_each_requests_kept_sets_and_top_candidates():
    """With filters and records on (RECORDS), Q = 3 < N = 5 requests in a shuffled order with
    forced lengths: each request's kept sets, top ids and top log-probs are its generation's
    without refills (up to the forced end; -1 / 0 after it), and so are its tokens."""
    eng = _engine("snapkv", records=True)
    tokens, lengths = _prompts(N, seed=3)
    order, limits = np.array([3, 0, 4, 1, 2]), np.array([M, 2, 7, M, 5])
    got = eng.run(PARAMS, jax.random.key(4), tokens[order], lengths[order], order, limits=limits)
    ref = smp.generate_jit(
        PARAMS,
        CFG,
        jnp.asarray(tokens[order]),
        jnp.asarray(lengths[order]),
        jax.random.key(4),
        eng.cfg,
        jnp.asarray(order),
        jnp.asarray(limits),
    )
    _assert_same(got, ref)
    _assert_same_records(got, ref)
    assert (got.kept_ids[:, :, 1] >= 0).any() and (got.kept_ids[:, :, -1] == -1).any()  # top-p cut inside the 20


def test_bubble_ratio_equals_a_hand_computed_schedule():
    # Eq. 4: intervals (running, seconds) with Q = 4: (0 * 1 + 2 * 1 + 4 * 0.5) / (2.5 * 4)
    assert bubble_ratio([(4, 1.0), (2, 1.0), (0, 0.5)], 4) == pytest.approx(0.4)
    # static batch: rows of 2 and 8 tokens run 8 steps: 1 - 10 / 16
    assert rollout_bubble(np.array([2, 8]), 8, 4)["rollout/bubble_slots"] == pytest.approx(0.375)
    # engine, Q = 3, segments of 4 steps, forced lengths 2, 8, 4, 4 (FIFO; these requests run
    # past 8 tokens unforced): segment 1 runs requests 0 (2 steps), 1 (4) and 2 (4); 0 and 2 are
    # replaced by 3; segment 2 runs 1 (4) and 3 (4): 18 active of 24 slot-steps
    eng, tokens, lengths, ref = _refill_case("none")
    rows = np.flatnonzero(np.asarray(ref.lengths) >= 8)[:4]
    assert len(rows) == 4, "the example needs four requests of 8+ tokens"
    stats0 = dataclasses.replace(eng.stats)
    eng.run(PARAMS, jax.random.key(4), tokens[rows], lengths[rows], rows, limits=np.array([2, 8, 4, 4]))
    assert eng.stats.active_slot_steps - stats0.active_slot_steps == 18
    assert eng.stats.slot_steps - stats0.slot_steps == 24


# ----------------------------------------------------------------------------- scheduler


def _scheduler(mode, group_batches=2, limits=None, resume="cache", records=False):
    eng = _engine("none", records=records)
    sched = SortedScheduler(
        eng,
        SortedConfig(mode=mode, slots=3, group_batches=group_batches, resume=resume),
        prompts_per_batch=2,
        samples=2,
    )
    tok, ln = _prompts(2 * group_batches, seed=11)
    sched.load_group(list(range(len(tok))), tok, ln, jax.random.key(4), limits)
    return sched


@pytest.mark.parametrize("mode", ["on_policy", "partial"])
def test_harvests_are_complete_groups_with_the_right_versions(mode):
    """Exactly b = 2 complete groups per harvest; grouped loading trains every prompt of the
    group once; on-policy tokens all have the current version; partial staleness < n."""
    sched = _scheduler(mode, limits=np.array([[2, 3], [4, 5], [12, 12], [6, 6]]))
    seen = []
    for version in range(2):
        examples, ptok, plen, out, metrics = sched.next_batch(PARAMS, version)
        assert len(examples) == 2 and out.tokens.shape[0] == 4
        np.testing.assert_array_equal(ptok[::2], ptok[1::2])  # prompt-major: the 2 samples together
        mask = np.arange(M)[None] < out.lengths[:, None]
        assert (out.lengths >= 1).all()
        if mode == "on_policy":
            assert (out.version[mask] == version).all()
            assert 0.0 <= metrics["sorted/discarded_token_fraction"] <= 1.0
        else:
            assert ((version - out.version[mask]) >= 0).all()
            assert ((version - out.version[mask]) < 2).all()
            # a token's version never decreases along a response
            assert all((np.diff(out.version[i, : out.lengths[i]]) >= 0).all() for i in range(4))
        seen.extend(examples)
    assert sorted(seen) == [0, 1, 2, 3] and sched.at_group_boundary


@pytest.mark.parametrize("resume", ["cache", "prefill"])
def test_partial_responses_resume_exactly_under_unchanged_weights(resume):
    """Partial mode with the same weights in every version: a response interrupted at a harvest
    and resumed, in its slot with its cache or after re-prefilling prompt + partial response, is
    the uninterrupted one (dense cache), so its tokens, log-probs and versions were joined
    correctly."""
    # forced lengths so that prompt 2's responses are mid-way at the first harvest (Q = 3,
    # segments of 4 steps: prompts 0 and 1 complete after 3 segments, prompt 2 then has 8 tokens)
    sched = _scheduler("partial", limits=np.array([[2, 3], [4, 5], [12, 12], [6, 6]]), resume=resume)
    eng = sched.engine
    outs = []
    for version in range(2):
        _, ptok, plen, out, _ = sched.next_batch(PARAMS, version)
        outs.append((ptok, plen, out))
    resumed = 0
    for ptok, plen, out in outs:
        uids = _uids(sched, ptok)
        ref = smp.generate_jit(
            PARAMS,
            CFG,
            jnp.asarray(ptok),
            jnp.asarray(plen),
            sched.key,
            eng.cfg,
            jnp.asarray(uids),
            jnp.asarray(sched.limits.reshape(-1)[uids]),
        )
        np.testing.assert_array_equal(out.tokens, np.asarray(ref.tokens))
        np.testing.assert_allclose(out.logprobs, np.asarray(ref.logprobs), rtol=1e-4, atol=1e-5)
        resumed += int(sum(len(set(v[:n])) > 1 for v, n in zip(out.version, out.lengths)))
    assert resumed > 0  # some response did span two versions


def _static_reference(sched, params, examples, ptok, plen, out):
    """The static sampler's generation of a harvest's rows: the same request ids and forced
    lengths (the rows are prompt-major, 2 samples each), the group's key."""
    rows_limits = sched.limits[np.repeat(examples, 2), np.tile([0, 1], len(examples))]
    return smp.generate_jit(
        params,
        CFG,
        jnp.asarray(ptok),
        jnp.asarray(plen),
        sched.key,
        sched.engine.cfg,
        jnp.asarray(out.request),
        jnp.asarray(rows_limits),
    )


@pytest.mark.parametrize("mode,resume", [("partial", "cache"), ("partial", "prefill"), ("on_policy", "cache")])
def test_records_stay_aligned_with_tokens_across_resumes_and_drops(mode, resume):
    """Records on (RECORDS), the same weights in both versions: a response resumed in its slot
    (cache), harvested and re-prefilled (prefill), or dropped and re-sampled afresh (on-policy)
    has the kept sets and top candidates of its uninterrupted generation at every position, as
    its tokens: the partial response's records travel with it and a slot's earlier records are
    not carried over."""
    sched = _scheduler(mode, limits=np.array([[2, 3], [4, 5], [12, 12], [6, 6]]), resume=resume, records=True)
    interrupted = 0
    for version in range(2):
        examples, ptok, plen, out, metrics = sched.next_batch(PARAMS, version)
        ref = _static_reference(sched, PARAMS, examples, ptok, plen, out)
        np.testing.assert_array_equal(out.tokens, np.asarray(ref.tokens))
        np.testing.assert_allclose(out.logprobs, np.asarray(ref.logprobs), rtol=1e-4, atol=1e-5)
        _assert_same_records(out, ref, rtol=1e-4, atol=1e-5)
        if mode == "partial":
            interrupted += int(sum(len(set(v[:n])) > 1 for v, n in zip(out.version, out.lengths)))
        else:
            interrupted += metrics["sorted/discarded_token_fraction"] > 0
    assert interrupted > 0  # some response was resumed (partial) or dropped and re-sampled


PARAMS_V1 = jax.tree.map(lambda x: x * 1.25 if x.ndim >= 2 else x, PARAMS)  # other weights


def test_a_token_carries_the_version_of_the_logits_it_was_sampled_from():
    """Partial mode, resume='cache', other weights for version 1: a response mid-way in its slot
    at the harvest (t_s tokens) decodes on under version 1. Its token t_s is sampled from logits
    the version-0 weights computed, so it is labelled 0 and equals version 0's own generation in
    token and log-prob; from token t_s + 1 on the logits are version 1's (label 1, and not
    version 0's log-prob). The staleness metric counts exactly the version-0 tokens."""
    limits = np.array([[2, 3], [4, 5], [12, 12], [6, 6]])
    sched = _scheduler("partial", limits=limits, resume="cache")
    sched.next_batch(PARAMS, 0)
    t_now = np.asarray(sched.state.t)
    t_s = {r.uid: int(t_now[q]) for q, r in sched.occupant.items()}
    assert t_s, "the example needs a response mid-way at the first harvest"
    examples, ptok, plen, out, metrics = sched.next_batch(PARAMS_V1, 1)
    ref = _static_reference(sched, PARAMS, examples, ptok, plen, out)
    ref_tokens, ref_logp = np.asarray(ref.tokens), np.asarray(ref.logprobs)
    resumed = 0
    for i, uid in enumerate(out.request):
        n, v = int(out.lengths[i]), out.version[i, : int(out.lengths[i])]
        if uid not in t_s:  # sampled under one version throughout
            assert len(set(v)) == 1
            continue
        s = t_s[uid]
        assert s < n and (v[: s + 1] == 0).all() and (v[s + 1 :] == 1).all(), (s, v)
        np.testing.assert_array_equal(out.tokens[i, : s + 1], ref_tokens[i, : s + 1])
        np.testing.assert_allclose(out.logprobs[i, : s + 1], ref_logp[i, : s + 1], rtol=1e-5, atol=1e-6)
        if s + 1 < n:  # version 1's logits: another distribution than version 0's
            assert (
                out.tokens[i, s + 1] != ref_tokens[i, s + 1] or abs(out.logprobs[i, s + 1] - ref_logp[i, s + 1]) > 1e-3
            )
        resumed += 1
    assert resumed > 0
    mask = np.arange(M)[None] < out.lengths[:, None]
    assert metrics["sorted/staleness_mean"] == pytest.approx(np.mean(1 - out.version[mask]))
    assert metrics["sorted/staleness_max"] == 1.0


def _six_prompt_group(requeue):
    """On-policy, 6 prompts in 3 harvests of 2 on Q = 3 slots, prompts 2-4 long (12 steps);
    counts each prompt's issued requests and, before every segment, the busy slots and the
    waiting requests."""
    eng = _engine("none")
    sched = SortedScheduler(
        eng,
        SortedConfig(mode="on_policy", slots=3, group_batches=3, requeue=requeue),
        prompts_per_batch=2,
        samples=2,
    )
    issued, occupancy = collections.Counter(), []
    fresh, segment_start = sched._fresh, eng.segment_start

    def counting(prompt, sample):
        issued[prompt] += 1
        return fresh(prompt, sample)

    def observed(*args, **kwargs):
        occupancy.append((len(sched.occupant), len(sched.queue)))
        return segment_start(*args, **kwargs)

    sched._fresh, eng.segment_start = counting, observed
    tok, ln = _prompts(6, seed=11)
    limits = np.array([[2, 3], [4, 4], [12, 12], [12, 12], [12, 12], [2, 2]])
    sched.load_group(list(range(6)), tok, ln, jax.random.key(4), limits)
    seen = []
    for version in range(3):
        examples, _, _, out, metrics = sched.next_batch(PARAMS, version)
        assert len(examples) == 2
        assert (out.version[np.arange(M)[None] < out.lengths[:, None]] == version).all()
        seen.extend(examples)
    assert sorted(seen) == list(range(6)) and sched.at_group_boundary
    return sched, issued, occupancy, metrics


def test_on_policy_hold_drops_a_prompt_at_most_once_per_group():
    """requeue 'hold': a prompt dropped at a harvest waits while the never-dropped prompts can
    fill the next harvest, so none is restarted and dropped again (each prompt's samples are
    issued at most twice); every harvest is 2 complete prompts of the current version and the
    group trains each prompt once. The price: a slot idles while a held prompt waits."""
    sched, issued, occupancy, _ = _six_prompt_group("hold")
    assert max(issued.values()) <= 2 * 2, dict(issued)  # first issue + at most one re-issue
    assert sum(sched.drops.values()) > 0 and max(sched.drops.values()) == 1
    assert any(busy < 3 for busy, _ in occupancy), occupancy


def test_on_policy_immediate_requeue_keeps_every_slot_busy():
    """requeue 'immediate' (the paper's rule, the default): a dropped prompt goes straight back
    into the queue, so no slot is ever idle while a request waits; the same group still trains
    each prompt once, on current-version tokens only, and here a long prompt is dropped twice."""
    assert SortedConfig().requeue == "immediate"
    sched, issued, occupancy, metrics = _six_prompt_group("immediate")
    assert all(busy == 3 or waiting == 0 for busy, waiting in occupancy), occupancy
    assert sched.held == [] and metrics["sorted/held_prompts"] == 0.0
    assert max(sched.drops.values()) == 2, dict(sched.drops)
    assert metrics["sorted/dropped_prompts"] == sum(sched.drops.values())
    assert sum(issued.values()) == 2 * (6 + sum(sched.drops.values()))  # every drop re-issues both samples


def test_on_policy_requeues_dropped_prompts_behind_unstarted_ones():
    """On-policy: prompt 2, mid-way at the first harvest (limits as above), is dropped and
    re-queued behind prompt 3, which had not started; its re-sampled responses get new request
    ids, and every prompt is still trained on once in the group."""
    sched = _scheduler("on_policy", limits=np.array([[2, 3], [4, 5], [12, 12], [6, 6]]))
    examples, _, _, _, metrics = sched.next_batch(PARAMS, 0)
    assert examples == [0, 1] and metrics["sorted/discarded_token_fraction"] > 0
    assert [r.prompt for r in sched.queue] == [3, 3, 2, 2]
    assert min(r.uid for r in sched.queue if r.prompt == 2) >= 8  # fresh ids: 8 were issued first
    examples, _, _, _, _ = sched.next_batch(PARAMS, 1)
    assert sorted(examples) == [2, 3] and sched.at_group_boundary


def test_the_next_segment_is_dispatched_before_a_harvest_is_read():
    """The device is not idle while the host books finished responses: after a segment whose
    slots finished, the scheduler refills them and dispatches the next segment before reading
    the harvested copy (engine.harvest_read with idle=False), and the results are unchanged."""
    sched = _scheduler("partial", limits=np.array([[2, 3], [4, 5], [12, 12], [6, 6]]))
    eng, events = sched.engine, []
    orig = {name: getattr(eng, name) for name in ("segment_start", "harvest_start", "harvest_read")}

    def spy(name):
        def call(*args, **kwargs):
            events.append((name, kwargs.get("idle")))
            return orig[name](*args, **kwargs)

        return call

    for name in orig:
        setattr(eng, name, spy(name))
    try:
        outs = [sched.next_batch(PARAMS, v)[3] for v in range(2)]
    finally:
        for name in orig:
            delattr(eng, name)
    overlapped = 0
    for i, (name, idle) in enumerate(events):
        if name == "harvest_read" and idle is False:
            before = [e for e, _ in events[:i]]
            last_copy = len(before) - 1 - before[::-1].index("harvest_start")
            assert "segment_start" in before[last_copy:]  # a segment went out after the copy
            overlapped += 1
    assert overlapped >= 2
    assert all((o.lengths >= 1).all() for o in outs)


def _uids(sched, ptok):
    """Request ids of the rows (uids are 2 * prompt + sample in a fresh partial-mode group)."""
    prompts = [int(np.flatnonzero((sched.prompt_tokens == row).all(axis=1))[0]) for row in ptok[::2]]
    return np.array([2 * p + s for p in prompts for s in range(2)], np.int32)


# ----------------------------------------------------------------------------- mesh


def test_engine_on_an_8_device_mesh_equals_one_device():
    """tests/engine_sharded_worker.py: slots over data 2 x fsdp 2 (tensor 2), params by the
    partition rules, Q = 4 < N = 7 requests with staggered refills: the same tokens and log-probs
    (1e-5) as the engine on one device, dense and SnapKV; the slots' KV cache is split per device."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=8"])
    env["JAX_PLATFORMS"] = "cpu"
    worker = pathlib.Path(__file__).parent / "engine_sharded_worker.py"
    proc = subprocess.run([sys.executable, str(worker)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ENGINE SHARDED OK" in proc.stdout


# ----------------------------------------------------------------------------- bad settings


def test_bad_settings_name_the_setting():
    cfg = smp.SamplerConfig(max_new_tokens=4, kv=_kv("none"))
    mesh = types.SimpleNamespace(size=8, shape={"data": 4, "fsdp": 2})
    with pytest.raises(ValueError, match=r"sorted\.slots=6 must be a multiple of mesh data x fsdp = 8"):
        SlotEngine(CFG, cfg, 6, P, mesh=mesh)
    with pytest.raises(ValueError, match=r"sorted\.group_batches=0"):
        SortedConfig(group_batches=0)
    with pytest.raises(ValueError, match=r"sorted\.mode='lazy'"):
        SortedConfig(mode="lazy")
    with pytest.raises(ValueError, match=r"sorted\.resume='keep'.*\('cache', 'prefill'\)"):
        SortedConfig(resume="keep")
    with pytest.raises(ValueError, match=r"sorted\.requeue='later'.*\('immediate', 'hold'\)"):
        SortedConfig(requeue="later")
    with pytest.raises(ValueError, match=r"record_kept"):
        SlotEngine(CFG, dataclasses.replace(cfg, record_kept=True), 2, P)
    from sparserl_jax.config import load_config

    with pytest.raises(ValueError, match=r"rollout\.scheduler='fifo'"):
        load_config([], ["rollout.scheduler=fifo"])
