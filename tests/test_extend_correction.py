"""Adding a behaviour-policy correction, walked through once as docs/layout.md ("How to extend")
says, with a toy "length_mask" that rejects every response token after the first `max_tokens`:

1. its file's worth of code (sparserl_jax/rl/corrections/length_mask.py in the package; here in
   this test): a settings class and a Correction saying what it contributes (an accept mask),
   registered where it is defined: CORRECTION = register(Correction(...));
2. its name on the import line of sparserl_jax/rl/corrections/__init__.py, which runs that
   registration (here the fixture registers it);
3. its RLConfig section, a field `length_mask: LengthMaskConfig = LengthMaskConfig()` (here a
   subclass of RLConfig, so the package stays as it is);
4. a mode naming it in RL_MODES.

compute_corrections, its metrics and the loss then honour it. The fixture takes it out of the
registry and monkeypatch restores the modes after the test."""

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparserl_jax.config_io import from_dict
from sparserl_jax.rl import config as C
from sparserl_jax.rl import loss
from sparserl_jax.rl.corrections import (
    CORRECTIONS,
    Correction,
    Mismatch,
    compose,
    masked_mean,
    register,
)
from sparserl_jax.validate import check_at_least

B, T, MAX_TOKENS = 6, 12, 3


# ----------------------------------------------------------------------------- 1. the file


@dataclasses.dataclass(frozen=True)
class LengthMaskConfig:
    """Keep only the first `max_tokens` tokens of every response (rl.length_mask.*)."""

    max_tokens: int = 4

    def __post_init__(self):
        check_at_least("length_mask.max_tokens", self.max_tokens, 1)


def _index_in_response(mask):
    """0, 1, 2, ... along each response's tokens (a contiguous run per row)."""
    return jnp.cumsum(mask, axis=-1) - 1


def length_mask_accept(m: Mismatch, cfg: LengthMaskConfig):
    """Keep token j of a response iff j < max_tokens; no response is vetoed whole."""
    return _index_in_response(m.mask) < cfg.max_tokens, None


def length_mask_metrics(m: Mismatch, cfg: LengthMaskConfig):
    """length_mask/cut_frac: the response tokens it rejects."""
    cut = _index_in_response(m.mask) >= cfg.max_tokens
    return {"length_mask/cut_frac": masked_mean(cut.astype(jnp.float32), m.mask)}


CORRECTION = Correction(
    name="length_mask", settings=LengthMaskConfig, accept=length_mask_accept, metrics=length_mask_metrics
)


# ----------------------------------------------------------------------------- 3. the section


@dataclasses.dataclass(frozen=True)
class RLConfigWithLengthMask(C.RLConfig):
    length_mask: LengthMaskConfig = LengthMaskConfig()


# ----------------------------------------------------------------------------- the walk-through


@pytest.fixture
def registered(monkeypatch):
    register(CORRECTION)  # 1.-2. what importing length_mask.py from the package does
    monkeypatch.setitem(C.RL_MODES, "length_only", ("length_mask",))  # 4. modes naming it
    monkeypatch.setitem(C.RL_MODES, "sparse_rl_short", ("sars", "ibr", "length_mask"))
    yield
    del CORRECTIONS["length_mask"]
    monkeypatch.undo()
    assert "length_only" not in C.RL_MODES


def _inputs(seed):
    rng = np.random.default_rng(seed)
    old = -rng.uniform(0.05, 4.0, (B, T)).astype(np.float32)
    sampler = (old + 0.5 * rng.standard_normal((B, T))).astype(np.float32)
    learner = (old + 0.3 * rng.standard_normal((B, T))).astype(np.float32)
    ref = (old + 0.2 * rng.standard_normal((B, T))).astype(np.float32)
    start, length = rng.integers(0, 4, B), rng.integers(1, T - 4, B)
    length[0] = T - 4  # one response longer than MAX_TOKENS for sure
    t = np.arange(T)[None]
    mask = (t >= start[:, None]) & (t < (start + length)[:, None])
    adv = np.repeat(rng.standard_normal((B, 1)), T, axis=1).astype(np.float32)
    return dict(learner=learner, old=old, ref=ref, sampler=sampler, mask=mask, adv=adv)


def _corr(inp, cfg, mask=None):
    mask = inp["mask"] if mask is None else mask
    return compose.compute_corrections(inp["learner"], inp["old"], inp["ref"], inp["sampler"], mask, cfg)


def test_a_toy_correction_added_through_the_registry(registered):
    # its settings load as rl.length_mask.* and are checked; the mode validates
    cfg = from_dict(RLConfigWithLengthMask, {"mode": "length_only", "length_mask": {"max_tokens": MAX_TOKENS}}, "rl")
    assert cfg.corrections == ("length_mask",)
    assert typing.get_type_hints(RLConfigWithLengthMask)["length_mask"] is CORRECTION.settings
    with pytest.raises(ValueError, match=r"length_mask\.max_tokens=0 must be >= 1"):
        from_dict(RLConfigWithLengthMask, {"length_mask": {"max_tokens": 0}}, "rl")

    inp = _inputs(0)
    mask = inp["mask"]
    kept = mask & (np.cumsum(mask, axis=1) <= MAX_TOKENS)  # the first MAX_TOKENS of each response
    assert (kept != mask).any()

    # compute_corrections honours it: accept is the response mask cut after MAX_TOKENS tokens
    corr = _corr(inp, cfg)
    np.testing.assert_array_equal(np.asarray(corr.accept), kept)
    assert corr.metrics["length_mask/cut_frac"] == pytest.approx(1 - kept.sum() / mask.sum())
    assert corr.metrics["sars/token_reject_rate"] == pytest.approx(1 - kept.sum() / mask.sum())

    # and so does the loss: the length-masked run is the dense run on the cut responses. Exact:
    # every accepted token's terms are the same float32 operations on the same values, the others
    # are 0 in both, and both reductions run eagerly on identical arrays.
    dense = dataclasses.replace(cfg, mode="dense")
    for agg in C.AGGREGATIONS:
        lcfg = dataclasses.replace(cfg.loss, aggregation=agg)
        got, _ = loss.policy_loss(corr, inp["adv"], None, lcfg)
        want, _ = loss.policy_loss(_corr(inp, dense, mask=kept), inp["adv"], None, lcfg)
        assert float(got) == float(want), agg

    # its gradient reaches the kept tokens only
    def total(learner):
        c = compose.compute_corrections(learner, inp["old"], inp["ref"], inp["sampler"], mask, cfg, with_metrics=False)
        return loss.policy_loss(c, inp["adv"], None, cfg.loss)[0]

    g = np.asarray(jax.jit(jax.grad(total))(inp["learner"]))
    assert np.all(g[mask & ~kept] == 0) and np.any(g[kept] != 0)


def test_a_toy_correction_composes_with_the_others(registered):
    """In a mode with SARS and IBR, accept is the AND of the three masks and the kept weights
    are sparse_rl's (its normaliser is over the valid tokens, which the toy does not change)."""
    inp = _inputs(1)
    cfg = RLConfigWithLengthMask(mode="sparse_rl_short", length_mask=LengthMaskConfig(max_tokens=MAX_TOKENS))
    sparse_rl = RLConfigWithLengthMask(mode="sparse_rl")
    mine, theirs = _corr(inp, cfg), _corr(inp, sparse_rl)
    kept = inp["mask"] & (np.cumsum(inp["mask"], axis=1) <= MAX_TOKENS)
    accept = np.asarray(theirs.accept) & kept
    np.testing.assert_array_equal(np.asarray(mine.accept), accept)
    assert (accept != np.asarray(theirs.accept)).any()
    # the same division of the same raw weight by the same normaliser, then zeroed where rejected
    np.testing.assert_array_equal(np.asarray(mine.weight), np.where(accept, np.asarray(theirs.weight), 0.0))
    assert set(theirs.metrics) < set(mine.metrics)
