"""The rollout sampler: dense and sparse decoding, recorded log-probs, memory, distributions."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float_tol import forward_terms, logit_magnitude, logprob_tol, sum_tol

from sparserl_jax import kvcache as kv
from sparserl_jax.kvcache.policies import POLICIES
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rollout import sampler as smp
from sparserl_jax.rollout.sampling import SamplingConfig, processed_logprobs

CFG = ModelConfig.tiny("qwen2", vocab_size=64)
PARAMS = tf.init_params(CFG, jax.random.key(0))
# Sharper logits than the 0.02 init so sampled sequences are not uniform noise.
PARAMS = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, PARAMS)
# Float noise between two programs of this model over <= 28 keys (10 prompt + 18 new): a logit
# (float_tol.forward_terms at the logit_magnitude, 1.0e-3) and a log-prob (logprob_tol, 2e-3)
LOGIT_TOL = sum_tol(forward_terms(CFG, 28), logit_magnitude(PARAMS))
LOGP_TOL = logprob_tol(CFG, PARAMS, keys=28)


def _prompts(key, B=3, P=10, lengths=(6, 10, 8)):
    tokens = jax.random.randint(key, (B, P), 1, CFG.vocab_size)
    lengths = jnp.array(lengths)
    tokens = jnp.where(jnp.arange(P)[None] < lengths[:, None], tokens, 0)
    return tokens, lengths


def _run(cfg, key=1, prompts=None):
    tokens, lengths = prompts if prompts is not None else _prompts(jax.random.key(7))
    return smp.generate_jit(PARAMS, CFG, tokens, lengths, jax.random.key(key), cfg), tokens, lengths


def _joined(prompt_tokens, lengths, out):
    """Each row: its prompt, then its response, right-padded."""
    B = prompt_tokens.shape[0]
    M = out.tokens.shape[1]
    T = int(lengths.max()) + M
    seq = np.zeros((B, T), np.int32)
    for b in range(B):
        P = int(lengths[b])
        seq[b, :P] = prompt_tokens[b, :P]
        seq[b, P : P + M] = out.tokens[b]
    return jnp.asarray(seq)


def test_greedy_equals_full_recompute_argmax():
    cfg = smp.SamplerConfig(max_new_tokens=12, sampling=SamplingConfig(temperature=0.0), kv=kv.KVConfig(buffer=5))
    out, prompts, lengths = _run(cfg)
    # independent reference: one teacher-forced forward (no cache); causality makes position
    # P - 1 + i see exactly the prompt and the first i generated tokens
    logits = np.asarray(tf.logits(PARAMS, CFG, _joined(prompts, lengths, out)))
    for b in range(3):
        P = int(lengths[b])
        rows = logits[b, P - 1 : P - 1 + 12]
        chosen = np.take_along_axis(rows, np.asarray(out.tokens[b])[:, None], -1)[:, 0]
        # the argmax up to float noise between the two programs (a tie within 2 LOGIT_TOL could
        # go either way); any other token is >= 0.02 below the max at these steps
        np.testing.assert_array_less(rows.max(-1) - chosen, 2 * LOGIT_TOL)
    assert bool(out.mask.all())


def test_dense_logprobs_equal_teacher_forced_recompute():
    cfg = smp.SamplerConfig(max_new_tokens=9, sampling=SamplingConfig(temperature=0.8), kv=kv.KVConfig(buffer=4))
    out, prompts, lengths = _run(cfg, key=3)
    seq = _joined(prompts, lengths, out)
    lp, _ = tf.token_logprobs(PARAMS, CFG, seq, temperature=0.8)
    for b in range(3):
        P = int(lengths[b])
        np.testing.assert_allclose(out.logprobs[b], lp[b, P - 1 : P - 1 + 9], atol=2e-5)


def test_eos_stops_and_masks():
    cfg = smp.SamplerConfig(
        max_new_tokens=30,
        sampling=SamplingConfig(temperature=1.0),
        kv=kv.KVConfig(buffer=8),
        eos_token_ids=(5, 9),
        pad_token_id=0,
    )
    out, _, _ = _run(cfg, key=11)
    for b in range(3):
        n = int(out.lengths[b])
        assert out.mask[b, :n].all() and not out.mask[b, n:].any()
        gen = np.array(out.tokens[b, :n])
        assert not np.isin(gen[:-1], [5, 9]).any()
        if n < 30:
            assert gen[-1] in (5, 9)
        assert (np.array(out.tokens[b, n:]) == 0).all() and (np.array(out.logprobs[b, n:]) == 0).all()


def test_seed_fixes_the_rollout():
    cfg = smp.SamplerConfig(max_new_tokens=8, kv=kv.KVConfig(buffer=4))
    a, _, _ = _run(cfg, key=5)
    b, _, _ = _run(cfg, key=5)
    c, _, _ = _run(cfg, key=6)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_sparse_with_budget_covering_everything_equals_dense(policy):
    dense = smp.SamplerConfig(max_new_tokens=14, kv=kv.KVConfig(buffer=4))
    sparse = dataclasses.replace(dense, kv=kv.KVConfig(policy=policy, budget=32, buffer=4, window=2, n_sinks=1))
    a, _, _ = _run(dense, key=21)
    b, _, _ = _run(sparse, key=21)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert int(b.n_compressions.sum()) == 0


def _replay_masks(out, lengths, U, T):
    """Per-layer [B, N, T, T] masks: what each query saw in the sparse sampler (see sampler docs)."""
    kept = np.array(out.kept_positions)  # [R, L, B, K, C]
    R, L, B, K, C = kept.shape
    G = CFG.group_size
    masks = np.zeros((L, B, K, T, T), bool)
    for b in range(B):
        P = int(lengths[b])
        for q in range(T):
            if q < P:
                masks[:, b, :, q, : q + 1] = True
                continue
            r = (q - P) // U  # decode step q - P + 1 fed position q during chunk r
            if r >= R:
                continue
            start = P + r * U
            for l in range(L):
                for k in range(K):
                    vis = kept[r, l, b, k]
                    masks[l, b, k, q, vis[vis >= 0]] = True
                    masks[l, b, k, q, start : q + 1] = True
    return [jnp.asarray(np.repeat(m, G, axis=1)) for m in masks]


@pytest.mark.parametrize(
    "policy,selection", [("snapkv", "per_head"), ("h2o", "per_head"), ("rkv", "shared"), ("streaming", "per_head")]
)
def test_sparse_logprobs_equal_masked_teacher_forced_recompute(policy, selection):
    U = 4
    kv_cfg = kv.KVConfig(policy=policy, budget=8, buffer=U, window=2, n_sinks=1, selection=selection)
    cfg = smp.SamplerConfig(max_new_tokens=18, sampling=SamplingConfig(temperature=1.0), kv=kv_cfg, record_kept=True)
    out, prompts, lengths = _run(cfg, key=31)
    assert int(out.n_compressions.min()) >= 3
    seq = _joined(prompts, lengths, out)
    T = seq.shape[1]
    masks = _replay_masks(out, lengths, U, T)
    h = tf.forward(PARAMS, CFG, seq, attn_masks=masks)
    w, w_layout = tf.head(PARAMS)
    lp, _ = tf.chunked_logprobs(h, w, jnp.roll(seq, -1, 1), w_layout=w_layout)
    dense_lp, _ = tf.token_logprobs(PARAMS, CFG, seq)
    for b in range(3):
        P = int(lengths[b])
        np.testing.assert_allclose(out.logprobs[b], lp[b, P - 1 : P - 1 + 18], atol=3e-5)
    # eviction really changed something: the dense recompute differs somewhere
    diffs = [
        np.abs(np.array(out.logprobs[b]) - np.array(dense_lp[b, int(lengths[b]) - 1 :][:18])).max() for b in range(3)
    ]
    assert max(diffs) > 1e-3
    # entries behind each token: at most budget + buffer, or prompt + buffer before the first
    # compression (compress_prompt=false keeps a prompt longer than the budget whole until then)
    for b in range(3):
        assert int(out.kept[b].max()) <= max(8, int(lengths[b])) + U
        assert int(out.kept[b, U + 1 :].max()) <= 8 + U  # token U: the last logits of chunk 0


def test_compress_prompt_false_keeps_long_prompts_whole_until_step_buffer():
    """budget 6, buffer 4, prompts of 6/10/8 tokens: with compress_prompt=false (the authors')
    the first `buffer` tokens see the whole prompt, exactly as the dense sampler does; with true
    the 10- and 8-token prompts are squeezed to 6 entries before the first decode step."""
    base = kv.KVConfig(policy="snapkv", budget=6, buffer=4, window=2)
    outs = {}
    for cp in (False, True):
        cfg = smp.SamplerConfig(max_new_tokens=6, kv=dataclasses.replace(base, compress_prompt=cp))
        outs[cp], prompts, lengths = _run(cfg, key=41)
    assert smp.cache_capacity(base, 10, 6) == 14
    assert smp.cache_capacity(dataclasses.replace(base, compress_prompt=True), 10, 6) == 10
    keep, squeeze = outs[False], outs[True]
    # entries behind each token's logits (row 1: the 10-token prompt)
    np.testing.assert_array_equal(np.asarray(keep.kept[1]), [10, 11, 12, 13, 14, 7])
    np.testing.assert_array_equal(np.asarray(squeeze.kept[1]), [10, 7, 8, 9, 10, 7])
    np.testing.assert_array_equal(np.asarray(keep.kept[:, :4]), np.array([6, 10, 8])[:, None] + np.arange(4))
    # until the first decode-time compression the sparse sampler is the dense policy
    dense_lp, _ = tf.token_logprobs(PARAMS, CFG, _joined(prompts, lengths, keep))
    for b, P in enumerate((6, 10, 8)):
        np.testing.assert_allclose(keep.logprobs[b, :4], dense_lp[b, P - 1 : P + 3], atol=3e-5)
    np.testing.assert_array_equal(np.asarray(keep.n_compressions), [1, 1, 1])
    np.testing.assert_array_equal(np.asarray(squeeze.n_compressions), [1, 2, 2])
    assert np.abs(np.asarray(keep.logprobs[1:]) - np.asarray(squeeze.logprobs[1:])).max() > 1e-3
    assert bool(keep.mask.all()) and bool(squeeze.mask.all())


def test_newline_trigger_compresses_on_newline_tokens():
    kv_cfg = kv.KVConfig(
        policy="snapkv", budget=8, buffer=6, window=2, trigger="newline", newline_token_ids=tuple(range(1, 40))
    )
    cfg = smp.SamplerConfig(max_new_tokens=16, kv=kv_cfg)
    out, _, _ = _run(cfg, key=43)
    assert int(out.n_compressions.min()) >= 2
    assert int(out.kept.max()) <= 8 + 6


def test_sparse_sampler_memory_does_not_grow_with_max_new_tokens():
    kv_cfg = kv.KVConfig(policy="snapkv", budget=64, buffer=16, window=4)
    prompts = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    params = jax.eval_shape(lambda: PARAMS)

    def mem(M, kv_cfg):
        cfg = smp.SamplerConfig(max_new_tokens=M, kv=kv_cfg)
        lowered = smp.generate_jit.lower(params, CFG, prompts, lengths, jax.random.key(0), cfg)
        ma = lowered.compile().memory_analysis()
        return ma.temp_size_in_bytes

    out_bytes = lambda M: 2 * M * (4 + 4 + 1 + 4)  # noqa: E731  (the [B, M] outputs themselves)
    sparse_1k, sparse_8k = mem(1024, kv_cfg), mem(8192, kv_cfg)
    dense_1k, dense_8k = mem(1024, kv.KVConfig(buffer=16)), mem(8192, kv.KVConfig(buffer=16))
    assert sparse_8k - sparse_1k <= 2 * (out_bytes(8192) - out_bytes(1024))
    kv_growth = 2 * CFG.n_layers * 2 * CFG.n_kv_heads * (8192 - 1024) * CFG.head_dim * 4
    assert dense_8k - dense_1k >= kv_growth  # the dense cache grows with max new tokens


def test_top_k_top_p_processed_distribution_matches_numpy():
    logits = jax.random.normal(jax.random.key(50), (4, 20)) * 3
    cfg = SamplingConfig(temperature=0.7, top_k=8, top_p=0.6)
    got = np.array(processed_logprobs(logits, cfg))
    for row, g in zip(np.array(logits, np.float64) / 0.7, got):
        keep = np.zeros(20, bool)
        keep[np.argsort(-row)[:8]] = True
        p = np.exp(row - row[keep].max()) * keep
        p /= p.sum()
        order = np.argsort(-p)
        cum = np.cumsum(p[order])
        n = int(np.searchsorted(cum, 0.6) + 1)  # smallest prefix reaching 0.6
        final = np.zeros(20, bool)
        final[order[:n]] = True
        ref = np.where(final, np.exp(row) * final, 0)
        ref = ref / ref.sum()
        np.testing.assert_allclose(np.exp(g), ref, atol=1e-5)


def test_config_errors_name_the_setting():
    with pytest.raises(ValueError, match="max_new_tokens"):
        smp.SamplerConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)


@pytest.mark.parametrize("policy,trigger", [("none", "interval"), ("random", "interval"), ("snapkv", "newline")])
def test_a_request_depends_on_its_own_key_not_on_its_row_or_neighbours(policy, trigger):
    """Per-request keys: request r sampled alone (same id) or in another row of another batch gives
    the same tokens and log-probs (random eviction included)."""
    cfg = smp.SamplerConfig(
        max_new_tokens=14,
        eos_token_ids=(5,),
        kv=kv.KVConfig(policy=policy, budget=8, buffer=4, window=2, trigger=trigger, newline_token_ids=(3,)),
    )
    tokens, lengths = _prompts(jax.random.key(11))
    ids = jnp.array([40, 7, 123])
    batch = smp.generate_jit(PARAMS, CFG, tokens, lengths, jax.random.key(5), cfg, ids)
    perm = jnp.array([2, 0, 1])
    shuffled = smp.generate_jit(PARAMS, CFG, tokens[perm], lengths[perm], jax.random.key(5), cfg, ids[perm])
    for b in range(3):
        alone = smp.generate_jit(
            PARAMS, CFG, tokens[b : b + 1], lengths[b : b + 1], jax.random.key(5), cfg, ids[b : b + 1]
        )
        j = int(jnp.argmax(perm == b))
        for other in (alone, jax.tree.map(lambda x: x[j : j + 1], shuffled.replace(kept_positions=None))):  # noqa: B023 (called within the iteration)
            np.testing.assert_array_equal(other.tokens[0], batch.tokens[b])
            # another batch shape is another program: float noise (measured <= 9.5e-7), while
            # a request drawn with another key differs by ~1
            np.testing.assert_allclose(other.logprobs[0], batch.logprobs[b], atol=LOGP_TOL)
            np.testing.assert_array_equal(other.kept[0], batch.kept[b])
    # a different request id is a different draw
    other_id = smp.generate_jit(PARAMS, CFG, tokens, lengths, jax.random.key(5), cfg, ids + 1)
    assert not np.array_equal(np.asarray(other_id.tokens), np.asarray(batch.tokens))


def test_a_budget_schedule_keeps_its_entry_for_the_tokens_seen():
    """kv.budget_schedule: a schedule of the budget everywhere is the fixed budget, bit for bit; a
    growing schedule keeps its entry for the tokens each row has seen at every compression, and
    its first compression keeps what a fixed budget of that size keeps."""
    U = 4
    base = dict(policy="snapkv", buffer=U, window=2)
    fixed = smp.SamplerConfig(
        max_new_tokens=18, sampling=SamplingConfig(temperature=1.0), kv=kv.KVConfig(budget=12, **base), record_kept=True
    )
    flat = dataclasses.replace(fixed, kv=kv.KVConfig(budget=12, budget_schedule=(12, 12), schedule_every=16, **base))
    grow = dataclasses.replace(fixed, kv=kv.KVConfig(budget=12, budget_schedule=(6, 9, 12), schedule_every=16, **base))
    small = dataclasses.replace(fixed, kv=kv.KVConfig(budget=6, **base))
    (a, _, lengths), (b, _, _) = _run(fixed, key=5), _run(flat, key=5)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    g, _, _ = _run(grow, key=5)
    s, _, _ = _run(small, key=5)
    kept_g, kept_s = np.asarray(g.kept_positions), np.asarray(s.kept_positions)  # [R, L, B, K, C]
    seen = np.asarray(lengths)[None, :] + U * np.arange(kept_g.shape[0])[:, None]  # at chunk r's start
    for r in range(1, kept_g.shape[0]):  # chunk 0 starts before any compression
        for row in range(3):
            if r * U > int(g.lengths[row]):
                continue  # the row had ended
            held = (kept_g[r, :, row] >= 0).sum(-1)  # per layer and KV head
            want = (6, 9, 12)[min(seen[r, row] // 16, 2)]
            assert np.all(held == min(want, int(seen[r, row]))), (r, row, held, want)
    # the first compression: the same kept entries as the fixed budget of 6 (same cache state)
    C = kept_s.shape[-1]  # the fixed budget's smaller cache
    np.testing.assert_array_equal(kept_g[1][..., :C], kept_s[1])
    assert np.all(kept_g[1][..., C:] == -1)
    with pytest.raises(
        ValueError, match=r"kv\.budget_schedule=\[2, 12\]: every entry must lie in \[3, kv\.budget=12\]"
    ):
        kv.KVConfig(budget=12, budget_schedule=(2, 12), **base)


def test_record_prompt_kept_reads_the_question_left_at_each_rows_end():
    """record_prompt_kept changes no token; dense keeps every real prompt position (1); R-KV squeezing a 10-token prompt into 6 entries at prefill holds each
    position in a fraction of its (layer, KV head) entries, averaging exactly what the final
    cache holds of the prompt (recomputed here from the layers' slot positions)."""
    dense = smp.SamplerConfig(max_new_tokens=6, kv=kv.KVConfig(buffer=4))
    sparse = smp.SamplerConfig(
        max_new_tokens=6, kv=kv.KVConfig(policy="rkv", budget=6, buffer=4, window=2, compress_prompt=True)
    )
    for cfg in (dense, sparse):
        plain, prompts, lengths = _run(cfg, key=5)
        out, _, _ = _run(dataclasses.replace(cfg, record_prompt_kept=True), key=5)
        assert plain.prompt_kept is None
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
        np.testing.assert_array_equal(np.asarray(out.logprobs), np.asarray(plain.logprobs))
        kept = np.asarray(out.prompt_kept)
        real = np.arange(10)[None] < np.asarray(lengths)[:, None]
        assert kept.shape == (3, 10)  # past a row's prompt: its response's first tokens, not read
        if cfg is dense:
            assert np.all(kept[real] == 1)
        else:  # every row's prompt (6, 10, 8 tokens) was compressed below its length
            assert np.all((kept * real).sum(axis=1) < np.asarray(lengths))
            assert np.all((kept >= 0) & (kept <= 1)) and np.any((kept > 0) & (kept < 1))


def test_position_kept_counts_each_layers_and_heads_slots():
    """Two layers, two KV heads, hand-set slot positions: the fraction of the four entries of
    each position."""
    cache = kv.cache_for(kv.KVConfig(), CFG, 1, 3, capacity=3)
    pos = (jnp.array([[[0, 1, -1], [0, 2, 3]]]), jnp.array([[[1, 3, 0], [0, 1, 9]]]))
    cache = cache.replace(pos=pos)
    assert CFG.n_layers == 2 and CFG.n_kv_heads == 2
    np.testing.assert_allclose(np.asarray(kv.position_kept(cache, 5)), [[4 / 4, 3 / 4, 1 / 4, 2 / 4, 0]])
