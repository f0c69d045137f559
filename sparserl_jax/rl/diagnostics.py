"""Per-iteration rollout diagnostics for Sparse-RL (docs/methods.md#sars and
#what-sparse-rl-reports), on the host in NumPy.

What the update's own metrics (mismatch/kl_k1|k3, sars/veto_rate, sars/token_reject_rate,
response/length_mean) do not show: whom SARS rejects (responses with positive or negative
advantage A), where in a response the rejected tokens sit, how often the sampler pi_sparse
falls into repetition loops (the paper's collapse symptom), and the low tail of the per-token
sparse-dense agreement (Sparrow's statistic: `agreement`). The accept mask (SARS's, with any
other correction's of the mode) comes from corrections/compose.py behaviour_terms, the
`behaviour` the update step computes, so it is the update's own.

Inputs follow sparserl_jax/rl/batch.py: [B, T] arrays where position t scores tokens[t + 1] and
the response mask marks the response tokens (a contiguous run per row).
"""

from __future__ import annotations

import jax
import numpy as np

from sparserl_jax.rl.config import RLConfig
from sparserl_jax.rl.corrections.compose import behaviour_terms

N_BINS = 10
DIAGNOSTIC_KEYS = (
    "diag/reject_rate_pos_adv",
    "diag/reject_rate_neg_adv",
    *(f"diag/reject_pos_{i}" for i in range(N_BINS)),
    "diag/loop_fraction",
)

_behaviour_terms = jax.jit(behaviour_terms, static_argnames="cfg")


# ----------------------------------------------------------------------------- repetition loops


def _has_run(eq: np.ndarray, k: int) -> bool:
    """Does the boolean vector hold k consecutive Trues?"""
    if k <= 0:
        return True
    c = np.concatenate([[0], np.cumsum(eq)])
    return bool(np.any(c[k:] - c[:-k] == k))


def has_loop(token_ids, min_span: int = 10, min_repeats: int = 2) -> bool:
    """Is there a repetition loop: a span x[i : i + L] with L >= min_span followed back to back by
    min_repeats - 1 exact copies of itself (x[i : i + min_repeats * L] has period L)?

    A shorter unit repeated often enough counts (its multiples are such spans: 4 copies of a
    9-token unit hold 2 copies of an 18-token span); a copy with one token changed does not.
    Candidate L are the distances between equal min_span-grams (rounded up to a multiple >=
    min_span when shorter); each candidate is checked exactly, so this costs O(n) per distinct
    candidate and stops at the first loop found."""
    x = np.asarray(token_ids).ravel().astype(np.int64)
    n, s, m = x.size, min_span, min_repeats
    if s < 1 or m < 2:
        raise ValueError(f"has_loop needs min_span >= 1 and min_repeats >= 2, got {s}, {m}")
    if n < s * m:
        return False
    # hash of every s-gram (collisions only add candidates: the check below is exact)
    h = np.zeros(n - s + 1, np.uint64)
    for k in range(s):
        h = h * np.uint64(1_000_003) + x[k : n - s + 1 + k].astype(np.uint64)
    order = np.argsort(h, kind="stable")  # equal s-grams together, positions ascending
    h_sorted = h[order]
    tried = set()
    for lag in range(1, h.size):
        same = h_sorted[lag:] == h_sorted[:-lag]
        if not same.any():
            return False
        d = order[lag:][same] - order[:-lag][same]
        for L in np.unique(-(-np.maximum(s, d) // d) * d):  # smallest multiple of d >= s
            L = int(L)
            if L > n // m or L in tried:
                continue
            tried.add(L)
            if _has_run(x[:-L] == x[L:], (m - 1) * L):
                return True
    return False


def loop_fraction(tokens, lengths, min_span: int = 10, min_repeats: int = 2) -> float:
    """Fraction of responses (tokens [B, M] left-aligned, the first lengths[b] valid) that loop."""
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    if tokens.shape[0] == 0:
        return 0.0
    return float(np.mean([has_loop(tokens[b, : lengths[b]], min_span, min_repeats) for b in range(tokens.shape[0])]))


def response_tokens(tokens, response_mask) -> tuple[np.ndarray, np.ndarray]:
    """(responses [B, T] left-aligned, lengths [B]) from a batch's tokens and response mask."""
    tokens, mask = np.asarray(tokens), np.asarray(response_mask, bool)
    B, T = tokens.shape
    start = np.argmax(mask, axis=1) + 1  # mask at t means tokens[t + 1] is a response token
    idx = np.minimum(start[:, None] + np.arange(T)[None], T - 1)
    return np.take_along_axis(tokens, idx, axis=1), mask.sum(axis=1)


# ----------------------------------------------------------------------------- SARS rejections


def rejection_diagnostics(accept, response_mask, advantages, n_bins: int = N_BINS) -> dict:
    """Who SARS rejects and where (vetoed responses count with all their tokens).

    diag/reject_rate_pos_adv, _neg_adv: fraction of response tokens not accepted among responses
    with A > 0 (A < 0); 0 when there are none. diag/reject_pos_i: rejected tokens by relative position j / M in
    their response (token j of M, n_bins equal bins), as fractions of all rejected tokens
    (all 0 when none is rejected)."""
    mask = np.asarray(response_mask, bool)
    reject = mask & ~np.asarray(accept, bool)
    adv = np.asarray(advantages, np.float32)
    out = {}
    for name, rows in (("pos", adv > 0), ("neg", adv < 0)):
        n = mask[rows].sum()
        out[f"diag/reject_rate_{name}_adv"] = float(reject[rows].sum() / n) if n else 0.0

    lengths = mask.sum(axis=1)
    j = np.arange(mask.shape[1])[None] - np.argmax(mask, axis=1)[:, None]  # index in the response
    rows, cols = np.nonzero(reject)
    bins = (j[rows, cols] * n_bins) // lengths[rows]
    hist = np.bincount(bins, minlength=n_bins).astype(np.float64)
    hist = hist / hist.sum() if hist.sum() else hist
    out.update({f"diag/reject_pos_{i}": float(v) for i, v in enumerate(hist)})
    return out


# ----------------------------------------------------------------------------- agreement

AGREEMENT_QUANTILES = (0.01, 0.05, 0.5)


def agreement(top_ids, sampler_top_logp, old_top_logp) -> tuple[np.ndarray, np.ndarray]:
    """Per-token agreement of the sampler with pi_old, Sparrow's acceptance rate (Zhou et al. 2026,
    Eq. 2: sum_v min(p_sparse(v), p_dense(v)) = 1 - total variation, the speculative-decoding
    acceptance rate), from the sampler's top candidates ([B, T, A] in; id -1: none): (lower,
    upper) bounds, each [B, T]. lower sums over the candidates (Sparrow sums over the tokens in
    both sides' top 20, so ours is >= theirs by the dense mass on the sampler's candidates outside
    the dense top 20); upper adds the most the rest of the vocabulary can hold,
    min(1 - sum p_sparse, 1 - sum p_dense) over the candidates. A sharp distribution has both close
    (Sparrow's LLMs); a flat one leaves its truncation between them (a dense sampler: upper = 1)."""
    ids = np.asarray(top_ids)
    s = np.exp(np.where(ids >= 0, np.asarray(sampler_top_logp, np.float64), -np.inf))
    o = np.exp(np.where(ids >= 0, np.asarray(old_top_logp, np.float64), -np.inf))
    lower = np.minimum(s, o).sum(axis=-1)
    rest = np.minimum(1.0 - s.sum(axis=-1), 1.0 - o.sum(axis=-1))
    return lower, np.minimum(lower + np.maximum(rest, 0.0), 1.0)


def agreement_metrics(top_ids, sampler_top_logp, old_top_logp, response_mask) -> dict[str, float]:
    """agreement/mean and its quantiles over the batch's response tokens (agreement/p5: Sparrow's
    tail, stable above ~0.86 for Qwen3 in their study; agreement/p1, agreement/p50), and the upper
    bound's agreement/upper_mean and agreement/upper_p5 (see `agreement`)."""
    mask = np.asarray(response_mask, bool)
    lower, upper = (a[mask] for a in agreement(top_ids, sampler_top_logp, old_top_logp))
    if lower.size == 0:
        return {}
    out = {"agreement/mean": float(lower.mean())}
    for q, v in zip(AGREEMENT_QUANTILES, np.quantile(lower, AGREEMENT_QUANTILES)):
        out[f"agreement/p{round(100 * q)}"] = float(v)
    out["agreement/upper_mean"] = float(upper.mean())
    out["agreement/upper_p5"] = float(np.quantile(upper, 0.05))
    return out


# ----------------------------------------------------------------------------- all of them


def rollout_diagnostics(
    tokens,
    response_mask,
    sampler_logp,
    old_logp,
    advantages,
    cfg: RLConfig,
    *,
    min_span: int = 10,
    min_repeats: int = 2,
    n_bins: int = N_BINS,
) -> dict[str, float]:
    """Every diagnostic of one rollout batch (DIAGNOSTIC_KEYS at the default n_bins).

    SARS acceptance as the update computes it (behaviour_terms with cfg; dense modes accept
    every token)."""
    mask = np.asarray(response_mask, bool)
    old = np.asarray(old_logp, np.float32)
    sampler = np.asarray(sampler_logp, np.float32)
    _, accept, _, _ = jax.device_get(_behaviour_terms(old, sampler, mask, cfg=cfg))
    out = rejection_diagnostics(accept, mask, advantages, n_bins)
    out["diag/loop_fraction"] = loop_fraction(*response_tokens(tokens, mask), min_span, min_repeats)
    return out
