"""Float tolerances derived from the computation, not from one machine's last bits: two CPUs
(or two programs on one CPU: jit and eager, another batch shape, a decode step and a full
forward) may compile the same jnp code to another summation order or blocking.

A float32 sum or dot of n terms whose magnitudes add up to A is within (n - 1) u A of the exact
value, u = 2^-24 the unit roundoff (Higham, Accuracy and Stability of Numerical Algorithms, 2nd
ed., eq. 4.4), so two summation orders differ by at most about n EPS32 A with EPS32 = 2u = 2^-23.
One rounding (an exp, a division, a cast of a float64 reference to float32) moves a value by at
most u relative. Each test's comment names n and A; tolerances that are exact by construction
(the same compiled program on the same inputs, a copy, an integer count) say so instead.
"""

import numpy as np

EPS32 = 2.0**-23  # float32 machine epsilon, 1.19e-7; 2u


def sum_tol(n: int, magnitude: float) -> float:
    """Two float32 summation orders of n terms whose |terms| add up to `magnitude`."""
    return n * EPS32 * magnitude


def forward_terms(cfg, keys: int) -> int:
    """Terms summed along the path from the embeddings to one logit of the transformer `cfg`
    attending over `keys` positions: per layer the q, k and v projections (D each), the scores
    (H), the softmax sum and p.v (keys each), the o projection (N H), gate and up (D each) and
    down (F); then the logit dot (D). Each adds its n EPS32 relative to the logit's magnitude."""
    D, H, N, F = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.d_ff
    return cfg.n_layers * (3 * D + H + 2 * keys + N * H + 2 * D + F) + D


def logit_magnitude(params) -> float:
    """A bound on sum_i |h_i w_iv| for every logit z_v = h . w_v: ||h|| ||w_v|| (Cauchy-Schwarz)
    with h the RMS-normed final hidden state (||h|| <= sqrt(D) max |final norm weight|)."""
    head = np.asarray(params["lm_head"] if "lm_head" in params else np.asarray(params["embed"]).T, np.float64)
    gain = np.abs(np.asarray(params["final_norm"], np.float64)).max()
    return float(np.sqrt(head.shape[0]) * gain * np.linalg.norm(head, axis=0).max())


def logprob_tol(cfg, params, keys: int) -> float:
    """How far one token's log-prob log p = z_o - logsumexp(z) may move between two float32
    programs of the same model (worst case): twice the logits' error (forward_terms at the
    logit_magnitude), plus the order of the V-term sum of exps (A = sum p = 1 after the max
    shift, relative to lse)."""
    return 2 * sum_tol(forward_terms(cfg, keys), logit_magnitude(params)) + sum_tol(cfg.vocab_size, 1.0)


# bfloat16 compute (model.dtype=bfloat16 over float32 master weights, model/precision.py): every
# weight is rounded once to bfloat16 and every op's output once more, each a relative error of at
# most U16; the dots accumulate in float32 (their n-term sums are as above, far below U16).
U16 = 2.0**-8  # bfloat16 unit roundoff, half its machine epsilon 2^-7 (8 significant bits)


def bf16_roundings(cfg) -> int:
    """bfloat16 roundings on the path from the embeddings to one logit, each a relative error of
    at most U16 of the value it rounds: per layer the attention branch (the normed input and its
    scale 2, the q/k/v kernel and output 2, bias 1, RoPE 1, the attention's probabilities and
    output 2, the o kernel and output 2, the residual sum 1) and the MLP branch (the normed input
    and its scale 2, the gate/up kernels and outputs 2, silu and the product 2, the down kernel
    and output 2, the residual sum 1); then the embedding, the final norm (2) and the head."""
    return cfg.n_layers * (11 + 9) + 4


def bf16_logprob_tol(cfg, params) -> float:
    """How far one token's log-prob may move between a bfloat16-compute forward and a float32 one
    of the same float32 weights (worst case, errors adding): twice the logits' error (every
    rounding at the logit_magnitude), plus the float32 V-term sum of exps."""
    return 2 * bf16_roundings(cfg) * U16 * logit_magnitude(params) + sum_tol(cfg.vocab_size, 1.0)
