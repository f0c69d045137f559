"""Behaviour-policy corrections, one file each, and their registry (registry.py): name ->
Correction (docs/methods.md#how-they-compose). Adding one is a new file here (its settings class and
hooks, see base.py, and `register`), its name on the import line below, a field of that settings
class under the same name in RLConfig, and a mode naming it in rl/config.py RL_MODES (or
`rl.<name>.enabled`); tests/test_extend_correction.py walks through it.

  xi.py        xi = pi_old / pi_sparse, the mismatch every correction reads
  sars.py      Sparse-RL rejection sampling: token band and sequence veto on xi (accept mask)
  ibr.py       Sparse-RL importance reweighting w = min(xi, cap), normalised (weight)
  tis.py       QuRL's truncated importance sampling w = min(rho, C) (weight)
  acr.py       QuRL's adaptive clipping range r_acr = min(1, C / rho) (upper clip scale)
  rejection.py the rejection family verl and AReaL ship: a divergence statistic of xi, aggregated
               over the response, outside bounds (accept mask): rejection, geo_rs, seq_mask, k3_rs
  importance.py  the importance-weight family: xi per token, per sequence or geometric, truncated or
               IcePop-masked (weight): importance, seq_tis, icepop
  divergence.py  the statistics (ratio, k1, k2, k3), aggregations and bounds those two read
  registry.py  the registry, and the check of the corrections a run combines
  compose.py   a run's corrections (its RLConfig's) combined: the accept mask, the weight and its
               normalisation, the clip scale, the metrics. It stands above rl/config.py, which
               imports this package, so it is imported by its own name, not from here.
"""

# isort: off
from sparserl_jax.rl.corrections import sars, ibr, tis, acr, rejection, importance  # noqa: F401  (the registry's order)

# isort: on
from sparserl_jax.rl.corrections.base import Correction, Mismatch, masked_mean, masked_quantiles
from sparserl_jax.rl.corrections.registry import CORRECTIONS, check_combination, register
from sparserl_jax.rl.corrections.xi import level_ratio, log_xi_raw

__all__ = [
    "CORRECTIONS",
    "Correction",
    "Mismatch",
    "check_combination",
    "level_ratio",
    "log_xi_raw",
    "masked_mean",
    "masked_quantiles",
    "register",
]
