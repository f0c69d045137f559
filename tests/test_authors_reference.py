"""Fidelity to the authors' code, not to our reading of it: NumPy (float64) transcriptions of the
original algorithms, compared with the jitted code at default settings on random inputs (heavy
mismatch with vetoes, large |log pi_ref - log pi_theta|, near-duplicate keys).

Sources, each transcribed function names its file:
  lsjia/Sparse-RL (the authors' slime fork): slime/examples/train_infer_mismatch_helper/mis.py
    + mis.yaml, slime/slime/backends/megatron_utils/loss.py, slime/slime/utils/ppo_utils.py,
    slime/slime/backends/megatron_utils/cp_utils.py, slime/slime/ray/rollout.py;
    sglang-kvc/python/sglang/compress/r1kv_utils.py (KVCluster as tp_worker.py builds it);
  Zefan-Cai/R-KV: rkv/utils.py, rkv/compression/r1_kv.py.
The transcriptions keep the originals' structure (per-sequence lists, torch ops as NumPy ops), so
they can be read side by side with the source; they import nothing from sparserl_jax.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float_tol import sum_tol
from fresh_rng import keys_with_near_duplicates, rng_from

from sparserl_jax import kvcache as kv
from sparserl_jax.kvcache import cache as kvc
from sparserl_jax.kvcache.policies import POLICIES
from sparserl_jax.rl import advantages as adv_lib
from sparserl_jax.rl import config as C
from sparserl_jax.rl import loss
from sparserl_jax.rl.corrections import compose

pytestmark = pytest.mark.xdist_group("authors_reference")


# ============================================================================ corrections + loss

# --- slime/examples/train_infer_mismatch_helper/mis.py ----------------------------------------


def mis_masked_sum(x, loss_mask):  # mis.py masked_sum
    return (x * loss_mask).sum()


def mis_masked_mean(x, loss_mask):  # mis.py masked_mean
    return mis_masked_sum(x, loss_mask) / max(loss_mask.sum(), 1)


def mis_truncate(weights, loss_mask, upper_bound):  # mis.py truncate
    return np.clip(weights, 0, upper_bound) * loss_mask


def mis_clip(weights, loss_mask, lower_bound, upper_bound):  # mis.py clip
    return np.clip(weights, lower_bound, upper_bound) * loss_mask


def mis_mask(weights, loss_mask, lower_bound, upper_bound):  # mis.py mask
    in_range = (weights >= lower_bound) & (weights <= upper_bound)
    modified_mask = loss_mask * in_range.astype(float)
    weights = weights * loss_mask
    return weights, modified_mask


def mis_calculate_veto_mask(log_ratio, loss_mask, veto_threshold):  # mis.py calculate_veto_mask
    if veto_threshold is None:
        return np.ones_like(log_ratio)
    catastrophic_tokens = (log_ratio < np.log(veto_threshold)) & loss_mask.astype(bool)
    has_catastrophic = catastrophic_tokens.any()
    return np.full_like(log_ratio, float(not has_catastrophic))


def mis_compute_mis_weights(args, train_log_probs, rollout_log_probs, loss_masks):
    """mis.py compute_mis_weights, for tis_level = rs_level = "token" (mis.yaml); the metrics
    and the wandb veto count are left out."""
    tis_lower_bound = args["tis_lower_bound"] if args["tis_lower_bound"] is not None else 1.0 / args["tis_upper_bound"]
    rs_lower_bound = args["rs_lower_bound"] if args["rs_lower_bound"] is not None else tis_lower_bound
    rs_upper_bound = args["rs_upper_bound"] if args["rs_upper_bound"] is not None else args["tis_upper_bound"]
    SAFETY_BOUND = 20.0
    if not args["use_tis"]:
        return None, loss_masks
    all_weights, all_modified_masks = [], []
    for train_log_prob, rollout_log_prob, loss_mask in zip(train_log_probs, rollout_log_probs, loss_masks):
        loss_mask = loss_mask.astype(float)
        raw_log_ratio_diff = train_log_prob - rollout_log_prob
        modified_mask = loss_mask.copy()
        log_ratio_tis = raw_log_ratio_diff  # compute_log_ratio(..., "token")
        weights = np.exp(np.clip(log_ratio_tis, -SAFETY_BOUND, SAFETY_BOUND))
        if args["tis_mode"] == "truncate":
            weights = mis_truncate(weights, loss_mask, args["tis_upper_bound"])
        elif args["tis_mode"] == "clip":
            weights = mis_clip(weights, loss_mask, tis_lower_bound, args["tis_upper_bound"])
        elif args["tis_mode"] == "mask":
            weights, modified_mask = mis_mask(weights, loss_mask, tis_lower_bound, args["tis_upper_bound"])
        if args["use_rs"]:
            log_ratio_rs = log_ratio_tis
            rs_weights = np.exp(np.clip(log_ratio_rs, -SAFETY_BOUND, SAFETY_BOUND))
            _, modified_mask = mis_mask(rs_weights, modified_mask, rs_lower_bound, rs_upper_bound)
            if args["rs_veto_threshold"] is not None:
                veto_mask = mis_calculate_veto_mask(raw_log_ratio_diff, loss_mask, args["rs_veto_threshold"])
                modified_mask = modified_mask * veto_mask
        all_weights.append(weights)
        all_modified_masks.append(modified_mask)
    if args["tis_batch_normalize"]:  # tis_level == "token"
        total_weights_sum = sum(mis_masked_sum(w, m) for w, m in zip(all_weights, loss_masks))
        total_mask_count = sum(m.sum() for m in loss_masks)
        weights_mean = total_weights_sum / max(total_mask_count, 1)
        if weights_mean > 1e-8:
            all_weights = [w / weights_mean for w in all_weights]
    return all_weights, all_modified_masks


# mis.yaml, with the run script's --use-tis (slime/scripts/run-qwen2.5-3b-rkv.sh)
MIS_YAML = dict(
    use_tis=True,
    use_rs=True,
    tis_mode="truncate",
    tis_lower_bound=0.5,
    tis_upper_bound=1.5,
    rs_lower_bound=None,
    rs_upper_bound=None,
    rs_veto_threshold=1e-4,
    tis_batch_normalize=True,
)


# --- slime/slime/utils/ppo_utils.py and megatron_utils/loss.py ---------------------------------


def ppo_compute_approx_kl_low_var(log_probs, log_probs_base):
    """ppo_utils.py compute_approx_kl, kl_loss_type "low_var_kl"."""
    log_ratio = -(log_probs - log_probs_base)
    return np.clip(np.exp(log_ratio) - 1 - log_ratio, -10, 10)


def ppo_compute_policy_loss(ppo_kl, advantages, eps_clip, eps_clip_high):
    """ppo_utils.py compute_policy_loss (no dual clip)."""
    ratio = np.exp(-ppo_kl)
    pg_losses1 = -ratio * advantages
    pg_losses2 = -np.clip(ratio, 1 - eps_clip, 1 + eps_clip_high) * advantages
    return np.maximum(pg_losses1, pg_losses2)


def slime_policy_loss(args, learner, old, rollout, ref, adv, loss_masks, entropy):
    """megatron_utils/loss.py policy_loss_function with a custom TIS function (mis.py) and
    --use-kl-loss, context parallel 1, calculate_per_token_loss False (cp_utils.py
    get_sum_of_sample_mean: per-sample mean over the mask, summed). Lists of 1-D arrays, one
    per response. The trainer divides the sum over samples by the number of samples (the global
    batch); done here. Returns (loss, weights or None, modified masks)."""
    old_log_probs = rollout if args["use_rollout_logprobs"] else old
    advantages = np.concatenate([np.full(len(m), a) for a, m in zip(adv, loss_masks)])
    ppo_kl = np.concatenate(old_log_probs) - np.concatenate(learner)
    pg_loss = ppo_compute_policy_loss(ppo_kl, advantages, args["eps_clip"], args["eps_clip_high"])
    masks, weights = loss_masks, None
    if args["use_tis"]:
        weights, masks = mis_compute_mis_weights(args, old, rollout, loss_masks)
        pg_loss = pg_loss * np.concatenate(weights)
    lengths = [len(m) for m in masks]

    def sum_of_sample_mean(x):
        parts = np.split(x, np.cumsum(lengths)[:-1])
        return sum((x_i * m).sum() / max(m.sum(), 1) for x_i, m in zip(parts, masks))

    total = sum_of_sample_mean(pg_loss) - args["entropy_coef"] * sum_of_sample_mean(np.concatenate(entropy))
    kl = ppo_compute_approx_kl_low_var(np.concatenate(learner), np.concatenate(ref))
    total = total + args["kl_loss_coef"] * sum_of_sample_mean(kl)
    return total / len(masks), weights, masks


# --- slime/slime/ray/rollout.py ----------------------------------------------------------------


def rollout_post_process_rewards(raw_rewards, n_samples_per_prompt):
    """rollout.py _post_process_rewards (grpo, rewards_normalization, grpo_std_normalization):
    torch's std is the unbiased one (ddof=1)."""
    rewards = np.asarray(raw_rewards, np.float64).reshape(-1, n_samples_per_prompt)
    rewards = rewards - rewards.mean(axis=-1, keepdims=True)
    std = rewards.std(axis=-1, ddof=1, keepdims=True)
    return (rewards / (std + 1e-6)).reshape(-1)


# --- the comparison ----------------------------------------------------------------------------

B, T = 8, 14
# (our config, the authors' args): each row is one reading of slime's flags
LOSS_COEFS = dict(eps_clip=0.2, eps_clip_high=0.2, entropy_coef=0.0, kl_loss_coef=1e-4)
BIG_COEFS = dict(eps_clip=0.2, eps_clip_high=0.28, entropy_coef=0.01, kl_loss_coef=0.5)
BIG_LOSS = C.LossConfig(eps_high=0.28, beta=0.5, entropy_coef=0.01)
PAIRS = (
    ("sparse_rl (defaults)", C.RLConfig(), dict(MIS_YAML, use_rollout_logprobs=False, **LOSS_COEFS)),
    (
        "sparse_rl, large KL and entropy coefficients",
        C.RLConfig(loss=BIG_LOSS),
        dict(MIS_YAML, use_rollout_logprobs=False, **BIG_COEFS),
    ),
    (
        "ibr_only (--use-tis without RS)",
        C.RLConfig(mode="ibr_only"),
        dict(MIS_YAML, use_rs=False, use_rollout_logprobs=False, **LOSS_COEFS),
    ),
    (
        "ibr_only, mask mode",
        C.RLConfig(mode="ibr_only", ibr=C.IbrConfig(mode="mask"), loss=BIG_LOSS),
        dict(MIS_YAML, use_rs=False, tis_mode="mask", use_rollout_logprobs=False, **BIG_COEFS),
    ),
    (
        "naive_sparse (no --use-tis)",
        C.RLConfig(mode="naive_sparse", loss=BIG_LOSS),
        dict(MIS_YAML, use_tis=False, use_rollout_logprobs=False, **BIG_COEFS),
    ),
    (
        "naive_sparse, --use-rollout-logprobs",
        C.RLConfig(mode="naive_sparse", ratio_against="sampler", loss=BIG_LOSS),
        dict(MIS_YAML, use_tis=False, use_rollout_logprobs=True, **BIG_COEFS),
    ),
)


def random_batch(seed: int) -> dict:
    """Ragged responses after a 2-token prompt; heavy mismatch (about a third of tokens outside
    the SARS band, a few catastrophic ones that veto their response) and large |q| on both
    sides of the KL clamp."""
    rng = rng_from(seed)
    old = -rng.uniform(0.05, 4.0, (B, T))
    sampler = old + 0.6 * rng.normal(size=(B, T))
    sampler += np.where(rng.uniform(size=(B, T)) < 0.04, 12.0, 0.0)
    sampler[1, 3] += 12.0
    learner = old + 0.3 * rng.normal(size=(B, T))
    ref = learner + 3.0 * rng.normal(size=(B, T))
    ref[2, 2:6] = learner[2, 2:6] - 15.0  # k3 = e^q - q - 1 > 10 with q < -11
    lengths = rng.integers(3, T - 2, B)
    mask = (np.arange(T)[None] >= 2) & (np.arange(T)[None] < 2 + lengths[:, None])
    rewards = rng.integers(0, 2, B).astype(np.float64)
    rewards[:4] = [1.0, 0.0, 0.0, 0.0]
    return dict(
        learner=learner,
        old=old,
        ref=ref,
        sampler=sampler,
        mask=mask,
        adv=rollout_post_process_rewards(rewards, 4),
        entropy=rng.uniform(0.1, 3.0, (B, T)),
    )


def reference(inp, args, learner=None):
    rows = lambda x: [x[i][inp["mask"][i]] for i in range(B)]  # noqa: E731
    learner = inp["learner"] if learner is None else learner
    return slime_policy_loss(
        args,
        rows(learner),
        rows(inp["old"]),
        rows(inp["sampler"]),
        rows(inp["ref"]),
        inp["adv"],
        [m[m] for m in inp["mask"]],
        rows(inp["entropy"]),
    )


def reference_grad(inp, args, h=1e-6):
    """d loss / d learner log-probs by central differences on the float64 transcription."""
    g = np.zeros((B, T))
    for i, t in zip(*np.nonzero(inp["mask"])):
        up, down = inp["learner"].copy(), inp["learner"].copy()
        up[i, t] += h
        down[i, t] -= h
        g[i, t] = (reference(inp, args, up)[0] - reference(inp, args, down)[0]) / (2 * h)
    return g


def ours(inp, cfg):
    f32 = lambda k: jnp.asarray(inp[k], jnp.float32)  # noqa: E731
    mask = jnp.asarray(inp["mask"])

    def loss_of(learner):
        corr = compose.compute_corrections(
            learner, f32("old"), f32("ref"), f32("sampler"), mask, cfg, with_metrics=False
        )
        adv = adv_lib.token_advantages(f32("adv"), mask)
        value, _ = loss.policy_loss(corr, adv, f32("entropy"), cfg.loss)
        return value, corr

    (value, corr), grad = jax.value_and_grad(loss_of, has_aux=True)(f32("learner"))
    kl = loss.k3_kl(corr.kl_q, cfg.loss.kl_clamp)
    return value, grad, corr.weight, corr.accept, kl


def value_tol(inp, args) -> float:
    """Float noise of our float32 loss against the float64 transcription: a mean over B responses
    of means over <= T token terms, each mean moving by n EPS32 times its terms' magnitude in
    another summation order (float_tol.sum_tol), (B + T) EPS32 max |l_t| in all, with |l_t| <=
    w |r A| + entropy_coef entropy + kl_coef |kl| (w <= 1.5 / its mean, which is >= 0.5)."""
    behaviour = inp["sampler"] if args["use_rollout_logprobs"] else inp["old"]
    r = np.exp(np.clip(inp["learner"] - behaviour, -20, 20))
    mag = 3.0 * np.maximum(r, 1.28) * np.abs(inp["adv"])[:, None] + 0.01 * inp["entropy"] + args["kl_loss_coef"] * 10.0
    return sum_tol(B + T, mag[inp["mask"]].max())


@functools.cache
def _ours_all(seed: int):
    cfgs = tuple(c for _, c, _ in PAIRS)
    f = jax.jit(lambda inp: [ours(inp, c) for c in cfgs])
    inp = random_batch(seed)
    return inp, [tuple(np.asarray(x, bool if x.dtype == bool else np.float64) for x in out) for out in f(inp)]


@pytest.mark.parametrize("seed", (0, 1))
def test_loss_gradient_weights_masks_and_kl_equal_the_authors_code(seed):
    inp, outs = _ours_all(seed)
    mask = inp["mask"]
    for (name, _cfg, args), (value, grad, weight, accept, kl) in zip(PAIRS, outs):
        want, w_ref, m_ref = reference(inp, args)
        np.testing.assert_allclose(value, want, atol=value_tol(inp, args), err_msg=name)
        # per token (no sums in d loss / d log pi): a few float32 roundings, against central
        # differences of the float64 loss with h = 1e-6 (their error ~ 1e-16 / h = 1e-10)
        np.testing.assert_allclose(grad, reference_grad(inp, args), rtol=1e-4, atol=1e-5, err_msg=name)
        m_pad = np.zeros((B, T))
        m_pad[mask] = np.concatenate(m_ref)
        np.testing.assert_array_equal(accept, m_pad > 0, err_msg=name)
        w_pad = np.ones((B, T)) if w_ref is None else np.zeros((B, T))
        if w_ref is not None:
            w_pad[mask] = np.concatenate(w_ref)
        # our weights are the authors' on the tokens that enter the loss: xi / (a mean over
        # <= B T = 112 tokens), 112 EPS32 = 1.3e-5 relative in another summation order
        np.testing.assert_allclose(weight[accept], w_pad[accept], rtol=sum_tol(B * T, 1.0), err_msg=name)
        q = inp["ref"] - inp["learner"]
        # per token e^q - q - 1 (|q| <= 20 clamped, k3 <= 10): a few roundings of values <= 20
        np.testing.assert_allclose(
            kl[mask],
            ppo_compute_approx_kl_low_var(inp["learner"], inp["ref"])[mask],
            rtol=1e-5,
            atol=1e-5,
            err_msg=name,
        )
    # the inputs exercise what differs from a paraphrase: vetoes, rejections, both KL clamps
    _, _, sparse_masks = reference(inp, PAIRS[0][2])
    assert sum(m.sum() == 0 for m in sparse_masks) >= 1
    assert 0.1 < 1 - sum(m.sum() for m in sparse_masks) / mask.sum() < 0.9
    assert (q[mask] > 2.7).any() and (q[mask] < -11.5).any()


def test_grpo_advantages_equal_the_authors_code():
    rng = rng_from(5)
    rewards = rng.integers(0, 2, 24).astype(np.float32)
    rewards[8:16] = 1.0  # a group with one reward: A = 0
    got = np.asarray(jax.jit(adv_lib.grpo_advantages, static_argnums=1)(jnp.asarray(rewards), 8))
    # an 8-term mean and std of 0/1 rewards, one division: a few roundings of |A| <= 2.5
    np.testing.assert_allclose(got, rollout_post_process_rewards(rewards, 8), rtol=1e-5, atol=1e-6)


# ============================================================================ SnapKV / R-KV

# --- Zefan-Cai/R-KV rkv/utils.py ---------------------------------------------------------------


def rkv_compute_attention_scores(query_states, key_states, pooling="max"):
    """rkv/utils.py compute_attention_scores (also r1kv_utils.py, attn_pooling="max" in the
    fork's tp_worker.py): [1, N, q, H] x [1, K, s, H] -> [1, K, q, s], pooled over the group."""
    batch_size, q_heads, q_len, head_dim = query_states.shape
    kv_heads = key_states.shape[1]
    group = q_heads // kv_heads
    query_states = query_states.reshape(batch_size, kv_heads, group, q_len, head_dim)
    attn = np.einsum("bkgqh,bksh->bkgqs", query_states, key_states) / math.sqrt(head_dim)
    return attn.max(axis=2) if pooling == "max" else attn.mean(axis=2)


def rkv_cal_similarity(key_states, threshold=0.5, retain_direction="last"):
    """rkv/utils.py cal_similarity (retain_direction "last"); the fork's r1kv_utils.py copy with
    its KVCluster defaults (aggregation "mean", normalization True) is the same function."""
    k = key_states[0]
    num_heads = k.shape[0]
    k_norm = k / (np.linalg.norm(k, axis=-1, keepdims=True) + 1e-8)
    similarity_cos = k_norm @ np.swapaxes(k_norm, -1, -2)
    for h in range(num_heads):
        np.fill_diagonal(similarity_cos[h], 0.0)
    similarity_mask = similarity_cos > threshold
    seq_len = similarity_mask.shape[-1]
    indices = np.where(similarity_mask, np.arange(seq_len), 0)
    similarity_retain = indices.max(axis=-1)  # "last"
    batch_idx = np.repeat(np.arange(num_heads)[:, None], seq_len, axis=1)
    seq_idx = np.repeat(np.arange(seq_len)[None, :], num_heads, axis=0)
    similarity_cos[batch_idx, seq_idx, similarity_retain] = 0
    r = similarity_cos.mean(axis=1)
    e = np.exp(r - r.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def torch_softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def torch_max_pool1d(x, kernel_size):
    """F.max_pool1d(x, kernel_size, padding=kernel_size // 2, stride=1) (-inf padding)."""
    half = kernel_size // 2
    pad = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(half, half)], constant_values=-np.inf)
    return np.stack([pad[..., j : j + kernel_size].max(axis=-1) for j in range(x.shape[-1])], -1)


def r1kv_final_score(method, key_states, query_states, window_size, kernel_size=7, mix_lambda=0.1):
    """rkv/compression/r1_kv.py R1KV.update_kv up to the top-k (the fork's
    r1kv_utils.py KVCluster.get_compress_indices step 1-3, fix_obs_window True,
    pooling "maxpool"); "snapkv" stops at the pooled attention. [1, K, s - window]."""
    attn_weights = rkv_compute_attention_scores(query_states, key_states)
    attn_weights_sum = torch_softmax(attn_weights[:, :, -window_size:, :-window_size]).mean(-2)
    attn_cache = torch_max_pool1d(attn_weights_sum, kernel_size)
    if method == "snapkv":
        return attn_cache
    similarity_cos = rkv_cal_similarity(key_states)[:, :-window_size]
    return attn_cache * mix_lambda - similarity_cos * (1 - mix_lambda)


def kept_per_head(final_score, kv_cache_len, budget, window_size):
    """r1_kv.py: topk(budget - window) per KV head over the candidates, plus the window."""
    out = []
    for h in range(final_score.shape[1]):
        top = np.argsort(-final_score[0, h], kind="stable")[: budget - window_size]
        out.append(set(top.tolist()) | set(range(kv_cache_len - window_size, kv_cache_len)))
    return out


def kept_shared(final_score, kv_cache_len, budget, window_size):
    """r1kv_utils.py KVCluster.get_compress_indices step 4-5: scores summed over the heads."""
    aggregated_score = final_score.sum(axis=1)[0]
    top = np.argsort(-aggregated_score, kind="stable")[: budget - window_size]
    return set(top.tolist()) | set(range(kv_cache_len - window_size, kv_cache_len))


# --- the comparison ----------------------------------------------------------------------------

KL, KB, KK, KN, KH, KC = 2, 2, 2, 6, 8, 40
BUDGET, WINDOW = 16, 4
FILLS = (40, 29)


def random_kv(seed: int):
    """Keys with many near-duplicates (so R-KV's similarity search finds some and misses some),
    sharp queries, garbage in the empty slots."""
    rng = rng_from(seed)
    k = keys_with_near_duplicates(rng, (KL, KB, KK, KC, KH), p=0.35, noise=0.4)
    q = 2.0 * rng.normal(size=(KL, KB, KN, WINDOW, KH))
    return k, q


def to_cache(k, q) -> kvc.KVCache:
    pos = np.where(np.arange(KC)[None, :] < np.array(FILLS)[:, None], np.arange(KC), -1)
    return kvc.KVCache(
        k=tuple(jnp.asarray(x, jnp.float32) for x in k),
        v=tuple(jnp.asarray(x, jnp.float32) for x in k),
        pos=tuple(jnp.broadcast_to(jnp.asarray(pos, jnp.int32)[:, None], (KB, KK, KC)) for _ in range(KL)),
        fill=jnp.asarray(FILLS, jnp.int32),
        length=jnp.asarray(FILLS, jnp.int32),
        window_q=tuple(jnp.asarray(x, jnp.float32) for x in q),
    )


def score_tol(k, q) -> float:
    """Float noise of a float32 SnapKV / R-KV score against the float64 transcription: attention
    probabilities (<= 1) of logits q.k / sqrt(H), H-term dots of magnitude <= L (sum_tol(H, L),
    twice in a probability), normalised over <= KC keys (a KC-term sum), then averaged and
    pooled; R-KV adds a softmax (another KC-term sum) of means over <= KC cosines (H-term dots
    of unit vectors). About 3e-5 here, where the scores range over ~0.1."""
    k_per_query = np.repeat(np.abs(k), KN // KK, axis=2)
    L = np.einsum("lbnwh,lbnch->lbnwc", np.abs(q), k_per_query).max() / math.sqrt(KH)
    return 2 * sum_tol(KH, L) + 3 * sum_tol(KC, 1.0) + sum_tol(KH, 1.0)


def assert_top_set(got: set, want: set, score: np.ndarray, n_keep: int, what: str, tol: float) -> bool:
    """got is a top-n_keep set of the candidates under the reference score (ties within the
    float noise `tol` of both scores aside); returns whether the boundary was tie-free (then
    the sets must be equal)."""
    cand = set(range(len(score)))
    got_c = got & cand
    assert len(got_c) == n_keep, what
    assert min(score[list(got_c)]) >= max(score[list(cand - got_c)]) - 2 * tol, what
    order = np.sort(score)[::-1]
    tie_free = order[n_keep - 1] - order[n_keep] > 2 * tol
    if tie_free:
        assert got == want, what
    return tie_free


@functools.cache
def _compressed(seed: int):
    k, q = random_kv(seed)
    cache = to_cache(k, q)
    cfgs = {
        (p, s): kv.KVConfig(policy=p, budget=BUDGET, buffer=KC - BUDGET, window=WINDOW, selection=s)
        for p in ("snapkv", "rkv")
        for s in ("per_head", "shared")
    }

    @jax.jit
    def run(cache):
        kept = {key: kv.kept_positions(kv.compress(c, cache)) for key, c in cfgs.items()}
        scores = {
            p: [POLICIES[p].score(cfgs[(p, "per_head")], cache, layer) for layer in range(KL)]
            for p in ("snapkv", "rkv")
        }
        return kept, scores

    kept, scores = run(cache)
    return k, q, jax.tree.map(np.asarray, kept), jax.tree.map(np.asarray, scores)


# seeds whose R-KV top-set boundaries are all clear of the float noise (gap > 2 score_tol, a
# property of the inputs: the gaps come from the float64 transcription), so the sets must equal
@pytest.mark.parametrize("seed", (3, 6))
def test_snapkv_rkv_scores_and_kept_sets_equal_the_originals(seed):
    k, q, kept, scores = _compressed(seed)
    tol = score_tol(k, q)
    tie_free = {"snapkv": 0, "rkv": 0}
    n_keep = BUDGET - WINDOW
    for method in ("snapkv", "rkv"):
        for b, fill in enumerate(FILLS):
            finals = []
            for layer in range(KL):
                final = r1kv_final_score(method, k[layer, b : b + 1, :, :fill], q[layer, b : b + 1], WINDOW)
                finals.append(final)
                np.testing.assert_allclose(
                    scores[method][layer][b, :, : fill - WINDOW], final[0], atol=tol, err_msg=f"{method} scores"
                )
                want = kept_per_head(final, fill, BUDGET, WINDOW)
                for h in range(KK):
                    got = set(kept[(method, "per_head")][layer][b, h].tolist()) - {-1}
                    tie_free[method] += assert_top_set(
                        got, want[h], final[0, h], n_keep, f"{method} per head l{layer} b{b} h{h}", tol
                    )
            # the fork: layer 0's scores summed over heads decide for every layer and head
            want = kept_shared(finals[0], fill, BUDGET, WINDOW)
            for layer, h in np.ndindex(KL, KK):
                got = set(kept[(method, "shared")][layer][b, h].tolist()) - {-1}
                tie_free[method] += assert_top_set(
                    got, want, finals[0][0].sum(0), n_keep, f"{method} shared l{layer} b{b} h{h}", KK * tol
                )
    # SnapKV's max-pool spreads a value over its neighbours, so its boundary is usually tied
    # (the scores above still match); R-KV's redundancy term breaks the ties: equal sets
    assert tie_free["rkv"] == 2 * (KL * KK + KL * KK)
