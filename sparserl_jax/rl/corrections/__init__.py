"""Registry of behaviour-policy corrections: name -> Correction (methods.md 1.2, 1.3, 2, 4).
Adding one is a new file here (its settings class and hooks, see base.py), one line below, a
field of that settings class under the same name in RLConfig, and a mode naming it in
rl/config.py RL_MODES (or `rl.<name>.enabled`); tests/test_extend_correction.py walks through it.

  xi.py       xi = pi_old / pi_sparse, the mismatch every correction reads
  sars.py     Sparse-RL rejection sampling: token band and sequence veto on xi (accept mask)
  ibr.py      Sparse-RL importance reweighting w = min(xi, cap), normalised (weight)
  tis.py      QuRL's truncated importance sampling w = min(rho, C) (weight)
  acr.py      QuRL's adaptive clipping range r_acr = min(1, C / rho) (upper clip scale)
  compose.py  the corrections of a mode combined: Corrections, compute_corrections, metrics
"""

from sparserl_jax.rl.corrections import acr, ibr, sars, tis
from sparserl_jax.rl.corrections.base import Correction, Mismatch, masked_mean, masked_quantiles
from sparserl_jax.rl.corrections.compose import (
    XI_QUANTILES,
    Corrections,
    behaviour_terms,
    compute_corrections,
    ibr_normaliser,
    mismatch_metrics,
    row_ibr_normalisers,
    weight_normalisation,
)
from sparserl_jax.rl.corrections.xi import level_ratio, log_xi_raw

CORRECTIONS: dict[str, Correction] = {
    "sars": sars.CORRECTION,
    "ibr": ibr.CORRECTION,
    "tis": tis.CORRECTION,
    "acr": acr.CORRECTION,
}

__all__ = [
    "CORRECTIONS",
    "XI_QUANTILES",
    "Correction",
    "Corrections",
    "Mismatch",
    "behaviour_terms",
    "compute_corrections",
    "ibr_normaliser",
    "level_ratio",
    "log_xi_raw",
    "masked_mean",
    "masked_quantiles",
    "mismatch_metrics",
    "row_ibr_normalisers",
    "weight_normalisation",
]
