"""Sampling distributions: temperature, top-k, top-p, and the log-prob of the distribution sampled.

The recorded log-prob is that of the processed distribution (after temperature and filtering),
so a learner that recomputes with the same temperature and filters sees the same numbers.
`sample_kept` also returns the kept set (the tokens processed_logprobs keeps: the top_k
candidates, every token tied with the k-th included as vLLM's top-k keeps them, that survive
top-p) as token ids: a learner renormalises its log-probs over them
(model.transformer.chunked_logprobs kept_ids), the sampling-mask replay that lets a run train with
top-p / top-k (docs/implementation.md). The record is kept_width(top_k) = top_k + TIE_SLOTS ids
wide. `top_candidates` finds the sampled distribution's most probable tokens for the sparse-dense
agreement (rl/diagnostics.py agreement), exactly or with TPU's approximate top-k.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from sparserl_jax import kernels

# Record slots beyond top_k for the tokens tied with the k-th largest logit, which the top-k rule
# keeps (processed_logprobs, as vLLM's): a kept set has at most top_k + TIE_SLOTS ids. Beyond that
# (more than TIE_SLOTS tokens tied at the k-th value: flat or duplicated logits) it is cut to the
# top_k + TIE_SLOTS first in lax.top_k's order (the tied tokens of lowest id), and the token is
# drawn from the cut set, so the record is always the set sampled from.
TIE_SLOTS = 8


# The agreement's candidates (rollout.agreement_k): each token's AGREEMENT_K most probable tokens
# under the sampled distribution when a run records them (Sparrow's top 20), found by one of
# TOPK_METHODS (rollout.agreement_topk, top_candidates).
AGREEMENT_K = 20
TOPK_METHODS = ("auto", "exact", "approx")

# How a token is drawn from its row's distribution (rollout.draw; draw_categorical): "gumbel" is
# jax.random.categorical (the argmax of the log-probs plus one Gumbel variate per vocabulary entry);
# "inverse_cdf" reads one uniform per row against the distribution's cumulative sum, found in two
# levels (blocks of INVERSE_CDF_BLOCK entries, then one block). The same distribution, another
# random stream: a run's samples change with it. On XLA:CPU the Gumbel draw is most of a small
# model's sampling time (the threefry bits and two logarithms per vocabulary entry).
DRAWS = ("gumbel", "inverse_cdf")
INVERSE_CDF_BLOCK = 256


def kept_width(top_k: int) -> int:
    """The width of a kept-set record (sample_kept's ids, the learner's kept_ids) at top_k."""
    return top_k + TIE_SLOTS


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    draw: str = "gumbel"  # DRAWS

    def __post_init__(self):
        if self.draw not in DRAWS:
            raise ValueError(f"rollout.draw={self.draw!r}: expected one of {DRAWS}")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k={self.top_k} must be >= 0 (0 disables it)")


def processed_logprobs(logits: Float[Array, "B V"], cfg: SamplingConfig) -> Float[Array, "B V"]:
    """Float32 log-probs of the distribution actually sampled from (-inf outside the filters).

    Greedy (temperature 0) reports the plain softmax at temperature 1, unfiltered."""
    logits = logits.astype(jnp.float32)
    if cfg.temperature == 0:
        return jax.nn.log_softmax(logits, axis=-1)
    logits = logits / cfg.temperature
    if cfg.top_k:
        kth_B = jax.lax.top_k(logits, cfg.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth_B, -jnp.inf, logits)
    if cfg.top_p < 1.0:
        sorted_BxV = jnp.sort(logits, axis=-1)[:, ::-1]
        probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
        n_keep_B = jnp.sum(mass_before_BxV < cfg.top_p, axis=-1)
        cutoff_B = jnp.take_along_axis(sorted_BxV, (n_keep_B - 1)[:, None], axis=-1)
        logits = jnp.where(logits < cutoff_B, -jnp.inf, logits)
    return jax.nn.log_softmax(logits, axis=-1)


def _snap(i_B: Int[Array, " B"], valid_BxN) -> Int[Array, " B"]:
    """i, or where entry i is not valid (or i == N) the nearest valid entry below it, else above:
    a cumulative sum's rounding can put a threshold on an entry of probability 0."""
    n = valid_BxN.shape[-1]
    at = jnp.arange(n)
    below_B = jnp.max(jnp.where(valid_BxN & (at <= i_B[:, None]), at, -1), axis=-1)
    above_B = jnp.min(jnp.where(valid_BxN & (at > i_B[:, None]), at, n - 1), axis=-1)
    return jnp.where(below_B >= 0, below_B, above_B)


def inverse_cdf(u_B: Float[Array, " B"], logp_BxV: Float[Array, "B V"]) -> Int[Array, " B"]:
    """The token at quantile u (in [0, 1)) of each row's distribution: the first whose cumulative
    probability exceeds u times the row's total, searched per block of INVERSE_CDF_BLOCK entries
    and then within the block, so no [B, V] cumulative sum is formed. Never an entry whose
    probability is 0 (-inf log-prob: a filtered token), whatever the rounding (_snap)."""
    B, V = logp_BxV.shape
    nb = -(-V // INVERSE_CDF_BLOCK)
    p_BxV = jnp.exp(logp_BxV.astype(jnp.float32))
    p_BxNxC = jnp.pad(p_BxV, ((0, 0), (0, nb * INVERSE_CDF_BLOCK - V))).reshape(B, nb, INVERSE_CDF_BLOCK)
    block_BxN = p_BxNxC.sum(-1)
    cum_BxN = jnp.cumsum(block_BxN, axis=-1)
    t_B = u_B * cum_BxN[:, -1]
    j_B = _snap(jnp.sum(cum_BxN <= t_B[:, None], axis=-1), block_BxN > 0)
    base_B = jnp.where(j_B > 0, jnp.take_along_axis(cum_BxN, jnp.maximum(j_B - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    row_BxC = jnp.take_along_axis(p_BxNxC, j_B[:, None, None], axis=1)[:, 0]
    within_BxC = base_B[:, None] + jnp.cumsum(row_BxC, axis=-1)
    k_B = _snap(jnp.sum(within_BxC <= t_B[:, None], axis=-1), row_BxC > 0)
    return j_B * INVERSE_CDF_BLOCK + k_B


def draw_categorical(key: jax.Array, logp_BxV: Float[Array, "B V"], draw: str = "gumbel") -> Int[Array, " B"]:
    """One token per row of a (log-)distribution, by `draw` (DRAWS). `key` is one key for the
    batch or a [B] array of keys, one per row (a row's token then depends on its key and its
    row only)."""
    if draw == "gumbel":
        if key.ndim == 1:
            return jax.vmap(lambda k, lp: jax.random.categorical(k, lp))(key, logp_BxV)
        return jax.random.categorical(key, logp_BxV, axis=-1)
    if draw != "inverse_cdf":
        raise ValueError(f"rollout.draw={draw!r}: expected one of {DRAWS}")
    if key.ndim == 1:
        u_B = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(key)
    else:
        u_B = jax.random.uniform(key, logp_BxV.shape[:1], jnp.float32)
    return inverse_cdf(u_B, logp_BxV)


def sample(
    logits: Float[Array, "B V"], key: jax.Array, cfg: SamplingConfig, logp_BxV: Float[Array, "B V"] | None = None
) -> tuple[Int[Array, " B"], Float[Array, " B"]]:
    """Draw one token per row; return it with its log-prob under the processed distribution.

    `key` is one key for the whole batch, or a [B] array of keys, one per row (the sampler's
    per-request keys: a row's token then depends on its own key and logits only). `logp_BxV`: the
    processed log-probs when the caller has them (processed_logprobs(logits, cfg))."""
    if logp_BxV is None:
        logp_BxV = processed_logprobs(logits, cfg)
    if cfg.temperature == 0:
        token_B = jnp.argmax(logits, axis=-1)
    else:
        token_B = draw_categorical(key, logp_BxV, cfg.draw)
    token_B = token_B.astype(jnp.int32)
    return token_B, jnp.take_along_axis(logp_BxV, token_B[:, None], axis=-1)[:, 0]


def kept_set(logp_BxV: Float[Array, "B V"], k: int) -> tuple[Float[Array, "B K"], Int[Array, "B K"]]:
    """The k most probable tokens of a processed distribution: (their log-probs, their ids), the
    ids -1 where the filters removed the token (log-prob -inf)."""
    vals_BxK, ids_BxK = jax.lax.top_k(logp_BxV, k)
    return vals_BxK, jnp.where(vals_BxK > -jnp.inf, ids_BxK, -1).astype(jnp.int32)


def topk_method(method: str, platform: str | None = None) -> str:
    """The top-k that `method` (TOPK_METHODS) runs, "exact" or "approx", with "auto" resolved for
    `platform` (the one the program is built for; None: jax's default backend): approx on TPU,
    whose approximate top-k is a fast partial reduction, exact elsewhere (on CPU and GPU XLA runs
    approx_max_k as an exact sort, slower than lax.top_k)."""
    if method not in TOPK_METHODS:
        raise ValueError(f"sampler.agreement_topk={method!r}: expected one of {TOPK_METHODS}")
    if method != "auto":
        return method
    return "approx" if (platform or kernels.current_platform()) == "tpu" else "exact"


def top_candidates(
    logp_BxV: Float[Array, "B V"], k: int, method: str = "exact", platform: str | None = None
) -> tuple[Float[Array, "B K"], Int[Array, "B K"]]:
    """The k most probable tokens of a processed distribution for the agreement, as kept_set gives
    them (log-probs, ids; -1 where filtered out), found by topk_method(method, platform): "exact"
    is kept_set itself; "approx" is lax.approx_max_k at its recall target 0.95 (at least 95% of the
    true top k expected among the k returned, the others replaced by less probable tokens). Either
    set keeps the agreement's bounds valid (rl/diagnostics.py agreement: the lower bound sums over
    any set of candidates, the upper adds the most the mass outside it can hold); an approximate
    set only loosens them."""
    if topk_method(method, platform) == "exact":
        return kept_set(logp_BxV, k)
    vals_BxK, ids_BxK = jax.lax.approx_max_k(logp_BxV, k)
    return vals_BxK, jnp.where(vals_BxK > -jnp.inf, ids_BxK, -1).astype(jnp.int32)


def sample_kept(
    logits: Float[Array, "B V"], key: jax.Array, cfg: SamplingConfig, logp_BxV: Float[Array, "B V"] | None = None
) -> tuple[Int[Array, " B"], Float[Array, " B"], Int[Array, "B K"]]:
    """Draw one token per row from the kept set (the tokens processed_logprobs keeps: top_k
    candidates, those tied with the k-th included, after top-p) and return it, its log-prob under
    the distribution renormalised over that set, and the set's ids ([B, kept_width(top_k)], -1
    padded): exactly what the learner replays. The set, the draw and the log-prob are `sample`'s
    unless more than TIE_SLOTS tokens tie at the k-th logit; then the set is cut to the record's
    width and the token drawn from the cut set (TIE_SLOTS). Needs top_k > 0 (the set's bound) and
    temperature > 0."""
    if cfg.top_k < 1 or cfg.temperature == 0:
        raise ValueError(
            f"sample_kept needs sampling.top_k >= 1 (the kept set's size) and a temperature > 0, got "
            f"top_k={cfg.top_k}, temperature={cfg.temperature}"
        )
    if logp_BxV is None:
        logp_BxV = processed_logprobs(logits, cfg)
    vals_BxK, ids_BxK = kept_set(logp_BxV, kept_width(cfg.top_k))
    logp_BxK = vals_BxK - jax.nn.logsumexp(vals_BxK, axis=-1, keepdims=True)
    j_B = draw_categorical(key, logp_BxK, cfg.draw)
    token_B = jnp.take_along_axis(ids_BxK, j_B[:, None], axis=-1)[:, 0]
    return token_B, jnp.take_along_axis(logp_BxK, j_B[:, None], axis=-1)[:, 0], ids_BxK
