"""Eviction policies against a brute-force NumPy reference (plain loops, float64), written from
docs/methods.md#kv-compression without reusing the JAX code: which slots each policy keeps, per
head and shared, ragged fills, inactive and short sequences, and the observers that feed H2O and
SnapKV/R-KV."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float_tol import sum_tol
from fresh_rng import keys_with_near_duplicates, rng_from

from sparserl_jax import kernels
from sparserl_jax import kvcache as kv
from sparserl_jax.kvcache import cache as kvc
from sparserl_jax.kvcache import observe
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig

L, B, K, N, H, C = 2, 4, 2, 4, 8, 24
G = N // K
BUDGET, WINDOW = 10, 3
FILLS = [24, 17, 10, 7]  # full, ragged, exactly the budget (no-op), below (no-op)
LENGTHS = [40, 30, 25, 7]

compress = jax.jit(kv.compress, static_argnums=0)  # eager dispatch of every op is far slower


def random_cache(seed: int, fills=FILLS, lengths=LENGTHS, window=WINDOW) -> dict:
    """Random slot contents as float64 NumPy arrays [L, ...]. Slots are in position order, the
    last `window` filled slots hold the latest positions, and heads differ (earlier per-head
    evictions). Empty slots hold garbage (never -1 free) in k, v and mass to catch masking bugs;
    about a third of keys are noisy copies of an earlier key, so R-KV finds near-duplicates."""
    rng = rng_from(seed)
    k = keys_with_near_duplicates(rng, (L, B, K, C, H), p=0.3, noise=0.5)
    pos = -np.ones((L, B, K, C), np.int64)
    for l, b, h in np.ndindex(L, B, K):
        f, n = fills[b], lengths[b]
        if f <= window:
            pos[l, b, h, :f] = np.arange(n - f, n)
        else:
            older = np.sort(rng.choice(n - window, f - window, replace=False))
            pos[l, b, h, :f] = np.concatenate([older, np.arange(n - window, n)])
    return dict(
        k=k,
        v=rng.normal(size=(L, B, K, C, H)),
        pos=pos,
        mass=rng.uniform(0.0, 5.0, size=(L, B, K, C)),
        window_q=rng.normal(size=(L, B, N, window, H)),
        fill=np.array(fills),
        length=np.array(lengths),
    )


def to_cache(d: dict, mass=True, window_q=True) -> kvc.KVCache:
    f32 = lambda x: tuple(jnp.asarray(a, jnp.float32) for a in x)  # noqa: E731
    return kvc.KVCache(
        k=f32(d["k"]),
        v=f32(d["v"]),
        pos=tuple(jnp.asarray(p, jnp.int32) for p in d["pos"]),
        fill=jnp.asarray(d["fill"], jnp.int32),
        length=jnp.asarray(d["length"], jnp.int32),
        mass=f32(d["mass"]) if mass else None,
        window_q=f32(d["window_q"]) if window_q else None,
    )


# ----------------------------------------------------------------------------- reference


def softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    s = sum(e)
    return [x / s for x in e]


def ref_snapkv(d, cfg, l, b, h) -> dict:
    """I_j over the non-window keys, per window query: the scaled logits of the query heads of
    KV head h, their max ("max_logits") then one softmax, or one softmax per query head
    ("max_probs"); mean over queries (then, for "max_probs", the max over the heads); then
    max-pool (kernel, stride 1, same padding) over those keys."""
    keys = list(range(d["fill"][b] - cfg.window))
    per_head = []
    for g in range(G):
        n = h * G + g
        per_head.append(
            [
                [float(d["window_q"][l, b, n, w] @ d["k"][l, b, h, j]) / math.sqrt(H) for j in keys]
                for w in range(cfg.window)
            ]
        )
    if cfg.gqa_reduce == "max_logits":
        rows = [
            softmax([max(per_head[g][w][a] for g in range(G)) for a in range(len(keys))]) for w in range(cfg.window)
        ]
        raw = [sum(row[a] for row in rows) / cfg.window for a in range(len(keys))]
    else:
        avg = [
            [sum(softmax(per_head[g][w])[a] for w in range(cfg.window)) / cfg.window for a in range(len(keys))]
            for g in range(G)
        ]
        raw = [max(avg[g][a] for g in range(G)) for a in range(len(keys))]
    half = cfg.pool_kernel // 2
    return {j: max(raw[a2] for a2 in range(max(0, a - half), min(len(keys), a + half + 1))) for a, j in enumerate(keys)}


def ref_redundancy(d, cfg, l, b, h) -> dict:
    """Over every filled key ("all_keys": a row with no near-duplicate zeroes its column 0) or
    over the non-window keys ("candidates"); read on the non-window keys."""
    f = d["fill"][b]
    cand = list(range(f - cfg.window))
    keys = list(range(f)) if cfg.rkv_redundancy == "all_keys" else cand
    unit = {j: d["k"][l, b, h, j] / (np.linalg.norm(d["k"][l, b, h, j]) + 1e-8) for j in keys}
    S = {(i, j): (float(unit[i] @ unit[j]) if i != j else 0.0) for i in keys for j in keys}
    for i in keys:
        similar = [j for j in keys if j != i and S[i, j] > cfg.redundancy_threshold]
        if similar:
            S[i, max(similar)] = 0.0  # the most recent near-duplicate of i
        elif cfg.rkv_redundancy == "all_keys":
            S[i, 0] = 0.0
    r = [sum(S[i, j] for i in keys) / len(keys) for j in keys]
    sm = dict(zip(keys, softmax(r)))
    return {j: sm[j] for j in cand}


def ref_rkv(d, cfg, l, b, h) -> dict:
    imp, red = ref_snapkv(d, cfg, l, b, h), ref_redundancy(d, cfg, l, b, h)
    lam = cfg.rkv_lambda
    return {j: lam * imp[j] - (1 - lam) * red[j] for j in imp}


def ref_h2o(d, cfg, l, b, h) -> dict:
    return {j: float(d["mass"][l, b, h, j]) for j in range(d["fill"][b] - cfg.window)}


def ref_streaming(d, cfg, l, b, h) -> dict:
    return {j: float(d["pos"][l, b, h, j]) for j in range(d["fill"][b] - cfg.window)}


REF_SCORES = {"snapkv": ref_snapkv, "rkv": ref_rkv, "h2o": ref_h2o, "streaming": ref_streaming}


def ref_forced(d, cfg, l, b, h) -> set:
    f = d["fill"][b]
    forced = set(range(f - cfg.window, f))
    if cfg.policy == "streaming":  # the n_sinks smallest original positions
        by_pos = sorted(range(f), key=lambda j: d["pos"][l, b, h, j])
        forced |= set(by_pos[: cfg.n_sinks])
    return forced


def ref_choose(scores: dict, forced: set, budget: int) -> list:
    rest = sorted((j for j in scores if j not in forced), key=lambda j: (-scores[j], j))
    return sorted(list(forced) + rest[: budget - len(forced)])


def ref_compress(d, cfg, active=None) -> dict:
    out = {name: np.array(x, copy=True) for name, x in d.items()}
    score_fn = REF_SCORES[cfg.policy]
    for b in range(B):
        if d["fill"][b] <= cfg.budget or (active is not None and not active[b]):
            continue
        if cfg.selection == "shared":  # layer 0's scores summed over KV heads, for everyone
            per_h = [score_fn(d, cfg, 0, b, h) for h in range(K)]
            total = {j: sum(s[j] for s in per_h) for j in per_h[0]}
            shared = ref_choose(total, ref_forced(d, cfg, 0, b, 0), cfg.budget)
        for l, h in np.ndindex(L, K):
            if cfg.selection == "shared":
                kept = shared
            else:
                kept = ref_choose(score_fn(d, cfg, l, b, h), ref_forced(d, cfg, l, b, h), cfg.budget)
            assert len(kept) == cfg.budget
            for name in ("k", "v", "pos", "mass"):
                out[name][l, b, h, : cfg.budget] = d[name][l, b, h, kept]
            out["pos"][l, b, h, cfg.budget :] = -1
            out["mass"][l, b, h, cfg.budget :] = 0.0
        out["fill"][b] = cfg.budget
    return out


def assert_matches(got: kvc.KVCache, want: dict, tracks_mass: bool):
    fill = np.asarray(got.fill)
    np.testing.assert_array_equal(fill, want["fill"])
    np.testing.assert_array_equal(np.asarray(got.length), want["length"])
    for l in range(L):
        np.testing.assert_array_equal(np.asarray(got.pos[l]), want["pos"][l], err_msg=f"layer {l}")
        # compress gathers slots: copies of the float32 casts of the float64 reference (one
        # rounding, <= 6e-8 relative), so rtol 1e-6 is exact up to that cast
        for b in range(B):
            f = fill[b]
            np.testing.assert_allclose(np.asarray(got.k[l])[b, :, :f], want["k"][l, b, :, :f], rtol=1e-6)
            np.testing.assert_allclose(np.asarray(got.v[l])[b, :, :f], want["v"][l, b, :, :f], rtol=1e-6)
        if tracks_mass:
            np.testing.assert_allclose(np.asarray(got.mass[l]), want["mass"][l], rtol=1e-6)


# ----------------------------------------------------------------------------- compress


@pytest.mark.parametrize(
    "policy, selection, seed, extra",
    [
        ("snapkv", "per_head", 1, {}),
        ("snapkv", "shared", 2, {"pool_kernel": 3}),
        ("rkv", "per_head", 3, {}),
        ("rkv", "shared", 4, {"rkv_lambda": 0.3, "redundancy_threshold": 0.4}),
        ("snapkv", "per_head", 9, {"gqa_reduce": "max_probs"}),
        ("rkv", "per_head", 10, {"gqa_reduce": "max_probs", "rkv_redundancy": "candidates"}),
        ("h2o", "per_head", 5, {}),
        ("h2o", "shared", 6, {}),
        ("streaming", "per_head", 7, {"n_sinks": 2}),
        ("streaming", "shared", 8, {}),
    ],
)
def test_compress_matches_reference(policy, selection, seed, extra):
    cfg = kv.KVConfig(policy=policy, budget=BUDGET, buffer=C - BUDGET, window=WINDOW, selection=selection, **extra)
    d = random_cache(seed)
    got = compress(cfg, to_cache(d))
    want = ref_compress(d, cfg)
    assert_matches(got, want, tracks_mass=True)
    # The window queries are untouched; the compressed rows really changed.
    np.testing.assert_array_equal(np.asarray(got.window_q[0]), np.float32(d["window_q"][0]))
    assert not np.array_equal(np.asarray(got.pos[0])[0], d["pos"][0, 0])


def test_rkv_redundancy_changes_the_choice():
    """The redundancy term matters: R-KV with lambda < 1 keeps a different set than SnapKV, and
    with lambda = 1 it is SnapKV."""
    d = random_cache(11)
    base = dict(budget=BUDGET, buffer=C - BUDGET, window=WINDOW)
    snap = compress(kv.KVConfig(policy="snapkv", **base), to_cache(d))
    rkv1 = compress(kv.KVConfig(policy="rkv", rkv_lambda=1.0, **base), to_cache(d))
    rkv = compress(kv.KVConfig(policy="rkv", **base), to_cache(d))
    for l in range(L):
        np.testing.assert_array_equal(np.asarray(rkv1.pos[l]), np.asarray(snap.pos[l]))
    assert any(not np.array_equal(np.asarray(rkv.pos[l]), np.asarray(snap.pos[l])) for l in range(L))


def test_compress_keeps_original_positions_in_order():
    cfg = kv.KVConfig(policy="rkv", budget=BUDGET, buffer=C - BUDGET, window=WINDOW)
    d = random_cache(12)
    jitted = compress(cfg, to_cache(d))
    for l in range(L):
        kept = np.asarray(kv.kept_positions(jitted)[l])
        for b, h in np.ndindex(B, K):
            f = int(jitted.fill[b])
            row = kept[b, h]
            assert (row[f:] == -1).all() and (row[:f] >= 0).all()
            assert (np.diff(row[:f]) > 0).all()  # original order
            assert set(row[:f]) <= set(d["pos"][l, b, h, : d["fill"][b]])  # original positions
            assert set(range(d["length"][b] - WINDOW, d["length"][b])) <= set(row[:f])  # window


def test_compress_noop_when_within_budget_and_for_inactive():
    cfg = kv.KVConfig(policy="snapkv", budget=BUDGET, buffer=C - BUDGET, window=WINDOW)
    d = random_cache(13, fills=[9, 10, 5, 4], lengths=[12, 10, 9, 4])
    cache = to_cache(d)
    same = compress(cfg, cache)
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(same)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    d = random_cache(14)
    active = np.array([True, False, True, True])
    got = compress(cfg, to_cache(d), active=jnp.asarray(active))
    assert_matches(got, ref_compress(d, cfg, active=active), tracks_mass=True)
    for l in range(L):  # sequence 1 (fill 17 > budget) untouched, garbage included
        np.testing.assert_array_equal(np.asarray(got.k[l])[1], np.float32(d["k"][l, 1]))
        np.testing.assert_array_equal(np.asarray(got.pos[l])[1], d["pos"][l, 1])
    assert int(got.fill[1]) == 17 and int(got.fill[0]) == BUDGET


def test_dense_policy_never_evicts():
    cfg = kv.KVConfig(policy="none", budget=BUDGET, window=WINDOW)
    cache = to_cache(random_cache(15), mass=False, window_q=False)
    assert kv.compress(cfg, cache) is cache
    assert kv.observe_decode(cfg) is None and kv.observe_prefill(cfg) is None


def test_random_policy_deterministic_per_key():
    cfg = kv.KVConfig(policy="random", budget=BUDGET, buffer=C - BUDGET, window=WINDOW)
    cache = to_cache(random_cache(16), mass=False, window_q=False)
    with pytest.raises(ValueError, match="random"):
        kv.compress(cfg, cache)
    a = compress(cfg, cache, key=jax.random.key(1))
    a2 = compress(cfg, cache, key=jax.random.key(1))
    b = compress(cfg, cache, key=jax.random.key(2))
    for l in range(L):
        np.testing.assert_array_equal(np.asarray(a.pos[l]), np.asarray(a2.pos[l]))
    assert any(not np.array_equal(np.asarray(a.pos[l]), np.asarray(b.pos[l])) for l in range(L))
    kept = np.asarray(a.pos[0])
    for b_, h in np.ndindex(2, K):  # window kept, budget entries, original order
        n = LENGTHS[b_]
        assert set(range(n - WINDOW, n)) <= set(kept[b_, h, :BUDGET])
        assert (np.diff(kept[b_, h, :BUDGET]) > 0).all() and (kept[b_, h, BUDGET:] == -1).all()


# ----------------------------------------------------------------------------- observers


def decode_like_the_model(hook):
    """One jitted decode step as the model runs it: write the token of every layer into slot
    `fill`, attend over [0, fill + 1), call the hook with q and lse, then advance."""

    @jax.jit
    def step(cache, q_LxBxNxH, knew_LxBxKxH, vnew_LxBxKxH):
        for l in range(L):
            cache = kvc.write_token(cache, l, knew_LxBxKxH[l], vnew_LxBxKxH[l])
            _, lse = kernels.decode_attention(q_LxBxNxH[l], cache.k[l], cache.v[l], cache.fill + 1)
            cache = hook(cache, l, q_LxBxNxH[l], lse)
        return kvc.advance(cache)

    return step


def test_h2o_mass_accumulates_over_decode_steps():
    """observe_decode adds each step's attention probs (summed over the G query heads) to the
    filled slots; the new token's slot starts from zero despite the garbage it held."""
    cfg = kv.KVConfig(policy="h2o", budget=BUDGET, buffer=C - BUDGET, window=WINDOW)
    fills, lengths = [20, 13, 5, 2], [30, 13, 9, 2]
    d = random_cache(21, fills=fills, lengths=lengths)
    cache = to_cache(d, window_q=False)
    step = decode_like_the_model(kv.observe_decode(cfg))
    mass = np.array(d["mass"], copy=True)
    k = np.array(d["k"], copy=True)
    rng = rng_from(22)
    for _ in range(3):
        q = rng.normal(size=(L, B, N, H))
        knew, vnew = rng.normal(size=(2, L, B, K, H))
        cache = step(cache, jnp.float32(q), jnp.float32(knew), jnp.float32(vnew))
        for l, b, h in np.ndindex(L, B, K):  # reference
            f = fills[b]
            k[l, b, h, f] = knew[l, b, h]
            mass[l, b, h, f] = 0.0
            for g in range(G):
                p = softmax([float(q[l, b, h * G + g] @ k[l, b, h, j]) / math.sqrt(H) for j in range(f + 1)])
                for j in range(f + 1):
                    mass[l, b, h, j] += p[j]
        fills = [f + 1 for f in fills]
    np.testing.assert_array_equal(np.asarray(cache.fill), fills)
    for l in range(L):
        for b in range(B):
            f = fills[b]
            np.testing.assert_allclose(np.asarray(cache.mass[l])[b, :, :f], mass[l, b, :, :f], rtol=1e-5)


def test_window_queries_ring_over_decode_steps():
    cfg = kv.KVConfig(policy="snapkv", budget=BUDGET, buffer=C - BUDGET, window=WINDOW)
    d = random_cache(23, fills=[20, 13, 5, 2], lengths=[30, 13, 9, 2])
    cache = to_cache(d, mass=False)
    step = decode_like_the_model(kv.observe_decode(cfg))
    rng = rng_from(24)
    want = np.array(d["window_q"], copy=True)
    for s in range(WINDOW + 2):
        q = rng.normal(size=(L, B, N, H))
        knew, vnew = rng.normal(size=(2, L, B, K, H))
        cache = step(cache, jnp.float32(q), jnp.float32(knew), jnp.float32(vnew))
        for l, b in np.ndindex(L, B):
            want[l, b, :, (d["length"][b] + s) % WINDOW] = q[l, b]
    for l in range(L):  # a ring of copies (of float32 casts: rtol 1e-6 is exact up to the cast)
        np.testing.assert_allclose(np.asarray(cache.window_q[l]), want[l], rtol=1e-6)


def ref_prompt_mass(q, k, n):
    """Causal column sums over the n real queries, summed over the query heads of each KV head."""
    T = q.shape[0]
    out = np.zeros((K, T))
    for h, g, i in np.ndindex(K, G, n):
        p = softmax([float(q[i, h * G + g] @ k[j, h]) / math.sqrt(H) for j in range(i + 1)])
        for j in range(i + 1):
            out[h, j] += p[j]
    return out


def attention_rtol(q_BxTxNxH, k_BxTxKxH) -> float:
    """Relative float noise of float32 attention probabilities and of their sums over queries
    against the float64 reference: logits q.k / sqrt(H) are H-term dots of magnitude <= Lq
    (float_tol.sum_tol, twice in a probability), the normaliser a sum over <= T keys, and the
    mass a sum over <= G T probabilities (1.6e-5 here)."""
    k_per_query = np.repeat(np.abs(k_BxTxKxH), G, axis=2)
    Lq = np.einsum("bqnh,bknh->bnqk", np.abs(q_BxTxNxH), k_per_query).max() / math.sqrt(H)
    T = q_BxTxNxH.shape[1]
    return 2 * sum_tol(H, Lq) + sum_tol(T, 1.0) + sum_tol(G * T, 1.0)


def test_observe_prefill_mass_and_window():
    T = 11
    lengths = np.array([11, 6, 2, 9])
    rng = rng_from(31)
    qs = [rng.normal(size=(B, T, N, H)) for _ in range(L)]
    ks = [rng.normal(size=(B, T, K, H)) for _ in range(L)]
    mcfg = ModelConfig.tiny(n_layers=L, n_heads=N, n_kv_heads=K, head_dim=H)
    for policy in ("h2o", "rkv"):
        cfg = kv.KVConfig(policy=policy, budget=BUDGET, buffer=8, window=WINDOW)
        cache = kv.cache_for(cfg, mcfg, B, T)
        cache = cache.replace(fill=jnp.asarray(lengths, jnp.int32), length=jnp.asarray(lengths, jnp.int32))
        cache = jax.jit(kv.observe_prefill(cfg))(
            cache, [jnp.float32(x) for x in qs], [jnp.float32(x) for x in ks], jnp.asarray(lengths, jnp.int32)
        )
        for l, b in np.ndindex(L, B):
            n = lengths[b]
            if policy == "h2o":
                want = ref_prompt_mass(qs[l][b], ks[l][b], n)
                got = np.asarray(cache.mass[l])[b]
                np.testing.assert_allclose(got[:, :T], want, rtol=attention_rtol(qs[l], ks[l]))
                assert (got[:, n:] == 0).all()
                # each query's probabilities sum to 1 up to its T-term normaliser; G n of them
                np.testing.assert_allclose(got.sum(-1), G * n, rtol=sum_tol(T + G * T, 1.0))
            else:
                got = np.asarray(cache.window_q[l])[b]
                want = np.zeros((N, WINDOW, H))
                for p in range(max(0, n - WINDOW), n):
                    want[:, p % WINDOW] = qs[l][b, p]
                np.testing.assert_allclose(got, want, rtol=1e-6)  # copies of float32 casts
    # Chunking over queries (chunk does not divide T) gives the same column sums (another
    # program: the same float noise bound as against the reference).
    full = observe.prompt_mass(jnp.float32(qs[0]), jnp.float32(ks[0]), jnp.asarray(lengths))
    chunked = observe.prompt_mass(jnp.float32(qs[0]), jnp.float32(ks[0]), jnp.asarray(lengths), chunk=4)
    rtol = attention_rtol(qs[0], ks[0])
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(full), rtol=rtol)
    np.testing.assert_allclose(np.asarray(full)[1], ref_prompt_mass(qs[0][1], ks[0][1], 6), rtol=rtol)


def random_params(mcfg: ModelConfig, seed: int) -> dict:
    """Model params of the right structure from NumPy (init_params compiles many RNG ops)."""
    rng = rng_from(seed)
    shapes = jax.eval_shape(lambda key: tf.init_params(mcfg, key), jax.random.key(0))

    def draw(path, s):
        if "norm" in jax.tree_util.keystr(path):
            return jnp.ones(s.shape, s.dtype)
        return jnp.asarray(0.3 * rng.normal(size=s.shape), s.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def test_hooks_with_the_model_then_compress_and_decode():
    """End to end with the tiny model: the hooks see the model's own post-RoPE queries (window_q
    equals the teacher-forced queries at the last w positions, after ragged prompts and decode
    steps), and decoding continues after a compression. (H2O's use of the model's lse is covered
    above with the same attention kernel the model calls.)"""
    mcfg = ModelConfig.tiny(n_layers=1)  # the observers' per-layer indexing is tested above
    params = random_params(mcfg, 41)
    Bm, T, steps, W = 2, 9, 4, 3
    tokens = rng_from(42).integers(1, mcfg.vocab_size, size=(Bm, T + steps))
    lengths = np.array([T, 6])
    # Sequence b is tokens[b, :lengths[b] + steps]: its prompt, then the decoded tokens.
    _, qs, _, _ = jax.jit(tf.forward, static_argnums=1, static_argnames="return_qkv")(
        params, mcfg, jnp.asarray(tokens), return_qkv=True
    )
    seen = lengths + steps
    cfg = kv.KVConfig(policy="snapkv", budget=8, buffer=8, window=W)
    hook = kv.observe_decode(cfg)
    decode = jax.jit(tf.decode_step, static_argnums=1, static_argnames="observe")
    cache = kv.cache_for(cfg, mcfg, Bm, T)
    _, cache = jax.jit(tf.prefill, static_argnums=1, static_argnames="observe_prefill")(
        params,
        mcfg,
        jnp.asarray(tokens[:, :T]),
        jnp.asarray(lengths),
        cache,
        observe_prefill=kv.observe_prefill(cfg),
    )
    for s in range(steps):
        nxt = tokens[np.arange(Bm), lengths + s]
        _, cache = decode(params, mcfg, cache, jnp.asarray(nxt), observe=hook)
    for l, b in np.ndindex(mcfg.n_layers, Bm):
        for p in range(seen[b] - W, seen[b]):
            np.testing.assert_allclose(
                np.asarray(cache.window_q[l])[b, :, p % W],
                np.asarray(qs[l])[b, p],
                rtol=1e-4,
                atol=1e-4,
            )
    cache = compress(cfg, cache)
    assert np.asarray(cache.fill).tolist() == [8, 8]
    logits, cache = decode(params, mcfg, cache, jnp.asarray(tokens[:, 0]), observe=hook)
    assert np.isfinite(np.asarray(logits)).all() and np.asarray(cache.fill).tolist() == [9, 9]


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs, setting",
    [
        (dict(policy="lru"), "kv.policy"),
        (dict(budget=0), "kv.budget"),
        (dict(buffer=-1), "kv.buffer"),
        (dict(window=0), "kv.window"),
        (dict(window=512), "kv.window"),
        (dict(pool_kernel=6), "kv.pool_kernel"),
        (dict(rkv_lambda=1.5), "kv.rkv_lambda"),
        (dict(redundancy_threshold=2.0), "kv.redundancy_threshold"),
        (dict(n_sinks=-1), "kv.n_sinks"),
        (dict(policy="streaming", budget=10, window=8, n_sinks=4), "kv.n_sinks"),
        (dict(selection="global"), "kv.selection"),
        (dict(trigger="eos"), "kv.trigger"),
        (dict(trigger="newline"), "kv.trigger"),
        (dict(compress_prompt="yes"), "kv.compress_prompt"),
        (dict(gqa_reduce="mean"), "kv.gqa_reduce"),
        (dict(rkv_redundancy="window"), "kv.rkv_redundancy"),
    ],
)
def test_config_validation_names_the_setting(kwargs, setting):
    with pytest.raises(ValueError, match=setting.replace(".", r"\.")):
        kv.KVConfig(**kwargs)


def test_config_defaults_and_capacity():
    cfg = kv.KVConfig(newline_token_ids=[198, 271], trigger="newline", policy="rkv")
    assert cfg.newline_token_ids == (198, 271) and hash(cfg)
    assert (cfg.budget, cfg.buffer, cfg.window, cfg.pool_kernel, cfg.n_sinks) == (512, 128, 8, 7, 4)
    assert (cfg.rkv_lambda, cfg.redundancy_threshold, cfg.selection) == (0.1, 0.5, "per_head")
    assert (cfg.gqa_reduce, cfg.rkv_redundancy, cfg.compress_prompt) == ("max_logits", "all_keys", False)
    assert kv.KVConfig().is_dense and not cfg.is_dense
    assert cfg.capacity(100) == 640 and cfg.capacity(600) == 728
    assert kv.KVConfig(policy="rkv", compress_prompt=True).capacity(600) == 640
    assert set(kv.POLICIES) == {"none", "streaming", "h2o", "snapkv", "rkv", "random"}
