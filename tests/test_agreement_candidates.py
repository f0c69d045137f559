"""The agreement's top candidates as a per-run choice (rollout.agreement_k, rollout.agreement_topk):
"auto" records them only where the run reads them (components.agreement_candidates: sparse or
quantized rollouts), so the default run's decode program has no top-k over the vocabulary at all;
a run that reads them records them; "auto" finds them with TPU's approximate top-k in a program
lowered for TPU and exactly elsewhere, and either set keeps the agreement's bounds valid."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparserl_jax import components
from sparserl_jax.config import TrainConfig, load_config
from sparserl_jax.kvcache import KVConfig
from sparserl_jax.model import sharding as shd
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rl.diagnostics import agreement
from sparserl_jax.rollout import sampler as smp
from sparserl_jax.rollout.sampling import AGREEMENT_K, kept_set, top_candidates
from sparserl_jax.tokenizer import CharTokenizer
from sparserl_jax.train import Trainer

SMOKE = pathlib.Path(__file__).parent.parent / "experiments/configs/smoke.yaml"
DENSE = ("kv.policy=none", "rl.mode=dense")
TOP_K = "chlo.top_k"  # lax.top_k in the lowered text
APPROX = "@ApproxTopK"  # lax.approx_max_k's custom call


def _cfg(*overrides: str) -> TrainConfig:
    return load_config([str(SMOKE)], list(overrides))


def test_auto_records_the_candidates_where_the_run_reads_them():
    assert TrainConfig().rollout.agreement_k == "auto" and TrainConfig().kv.is_dense
    assert components.agreement_candidates(TrainConfig()) == 0  # the default run: dense, full precision
    assert components.agreement_candidates(_cfg()) == AGREEMENT_K == 20  # sparse rollouts (snapkv)
    assert components.agreement_candidates(_cfg(*DENSE)) == 0
    assert components.agreement_candidates(_cfg(*DENSE, "quant.format=int8")) == AGREEMENT_K  # QuRL's rollouts
    assert components.agreement_candidates(_cfg(*DENSE, "rollout.agreement_k=8")) == 8  # asked for
    assert components.agreement_candidates(_cfg("rollout.agreement_k=0")) == 0  # turned off
    for bad in ("many", "-1", "true"):
        with pytest.raises(ValueError, match=r'rollout.agreement_k=.*expected "auto" or an integer >= 0'):
            _cfg(f"rollout.agreement_k={bad}")
    with pytest.raises(ValueError, match=r"rollout.agreement_topk='fast'.*'auto', 'exact', 'approx'"):
        _cfg("rollout.agreement_topk=fast")
    with pytest.raises(ValueError, match=r"sampler.agreement_topk='fast'"):
        smp.SamplerConfig(agreement_topk="fast")


def _generate(sampler_cfg: smp.SamplerConfig, model_cfg: ModelConfig, params):
    """A 4-row rollout and the StableHLO text of its program."""
    prompts = jnp.asarray(np.arange(1, 25).reshape(4, 6) % (model_cfg.vocab_size - 1) + 1, jnp.int32)
    lengths, key = jnp.full((4,), 6, jnp.int32), jax.random.key(0)
    gen = jax.jit(smp.generate, static_argnames=("model_cfg", "cfg"))
    text = gen.lower(params, model_cfg, prompts, lengths, key, sampler_cfg).as_text()
    return gen(params, model_cfg, prompts, lengths, key, sampler_cfg), text


def test_the_default_run_records_none_and_a_run_that_reads_them_records_them(tmp_path):
    # the trainer of a dense run: neither its sampler nor its learner asks for candidates
    trainer = Trainer(_cfg(*DENSE, f"train.out_dir={tmp_path}", "train.progress=false"))
    assert trainer.sampler_cfg.agreement_k == 0 and trainer.learner.update.top_k == 0
    model_cfg, params = trainer.model_cfg, trainer.params
    tok = CharTokenizer()
    cfgs = {
        "dense": _cfg(*DENSE, "rollout.max_new_tokens=8"),
        "dense, asked for": _cfg(*DENSE, "rollout.max_new_tokens=8", "rollout.agreement_k=20"),
        "sparse": _cfg("rollout.max_new_tokens=8", "kv.policy=streaming", "kv.budget=8", "kv.buffer=4", "kv.window=2"),
    }
    out = {}
    for name, cfg in cfgs.items():
        sampler_cfg = components.sampler_config(cfg, tok, agreement_k=components.agreement_candidates(cfg))
        assert sampler_cfg.agreement_topk == "auto"
        out[name] = _generate(sampler_cfg, model_cfg, params)
    (dense, dense_text), (asked, asked_text), (sparse, sparse_text) = out.values()
    # the default run: no record and no top-k over the vocabulary anywhere in its program
    assert dense.top_ids is None and dense.top_logp is None
    assert TOP_K not in dense_text and APPROX not in dense_text
    # the same run asking for them: the top-k is there (exact on CPU), the same tokens sampled
    assert TOP_K in asked_text and APPROX not in asked_text
    np.testing.assert_array_equal(asked.tokens, dense.tokens)
    np.testing.assert_array_equal(asked.logprobs, dense.logprobs)
    for rollout in (asked, sparse):  # a run whose agreement reads them records them
        ids, logp, mask = np.asarray(rollout.top_ids), np.asarray(rollout.top_logp), np.asarray(rollout.mask)
        assert ids.shape == (*mask.shape, AGREEMENT_K)
        assert (ids[mask] >= 0).all() and (ids[~mask] == -1).all()
        assert (np.diff(logp[mask], axis=-1) <= 0).all()  # the most probable first
        # the sampled token is among them whenever its log-prob reaches the 20th candidate's
        sampled = np.asarray(rollout.tokens)[mask]
        reach = np.asarray(rollout.logprobs)[mask] >= logp[mask][:, -1]
        assert all(t in row for t, row, r in zip(sampled, ids[mask], reach) if r)


def test_candidates_are_exact_on_cpu_and_approximate_when_lowered_for_tpu():
    logp_BxV = jax.nn.log_softmax(3.0 * jax.random.normal(jax.random.key(1), (3, 1000)))
    exact = kept_set(logp_BxV, 20)
    for got in (top_candidates(logp_BxV, 20, "auto"), top_candidates(logp_BxV, 20, "exact")):
        for x, y in zip(got, exact, strict=True):
            np.testing.assert_array_equal(x, y)
    # approx on CPU: XLA's fallback for approx_max_k is an exact search, the same tokens
    vals, ids = top_candidates(logp_BxV, 20, "approx")
    np.testing.assert_array_equal(np.sort(ids, axis=-1), np.sort(exact[1], axis=-1))

    # the sampler's decode loop lowered for TPU: "auto" picks TPU's own approximate top-k (not
    # the fallback XLA uses elsewhere), "exact" keeps lax.top_k
    model_cfg = ModelConfig.tiny("qwen2")
    params = shd.abstract_params(model_cfg)
    prompts, lengths = jax.ShapeDtypeStruct((2, 6), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32)
    key = jax.eval_shape(jax.random.key, 0)
    texts = {}
    for method in ("auto", "exact"):
        cfg = smp.SamplerConfig(
            max_new_tokens=4,
            kv=KVConfig(policy="none", buffer=4),
            agreement_k=AGREEMENT_K,
            agreement_topk=method,
            attn_impl="xla",
            attn_platform="tpu",  # the platform the program is built for (a TPU's own default)
        )
        gen = jax.jit(lambda p, x, n, k, cfg=cfg: smp.generate(p, model_cfg, x, n, k, cfg))
        texts[method] = gen.trace(params, prompts, lengths, key).lower(lowering_platforms=("tpu",)).as_text()
    auto = [line for line in texts["auto"].splitlines() if APPROX in line]
    assert auto and all("is_fallback" not in line and "top_k = 20" in line for line in auto), auto
    assert APPROX not in texts["exact"] and TOP_K in texts["exact"]


def test_an_approximate_candidate_set_keeps_the_agreement_bounds():
    """rl/diagnostics.py agreement over any set of candidates (an approximate top-k's) stays a
    lower and an upper bound of the exact sum_v min(p, q): float64, so only rounding separates
    the equal cases."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(50, 0.3), size=(2, 8))
    q = rng.dirichlet(np.full(50, 0.3), size=(2, 8))
    exact = np.minimum(p, q).sum(-1)
    for sets in range(20):
        ids = np.stack([rng.permutation(50)[:5] for _ in range(16)]).reshape(2, 8, 5)
        ids[0, 0, -1] = -1  # a filtered-out slot
        take = np.where(ids >= 0, ids, 0)
        s_logp = np.log(np.take_along_axis(p, take, -1))
        o_logp = np.log(np.take_along_axis(q, take, -1))
        lower, upper = agreement(ids, s_logp, o_logp)
        assert (lower <= exact + 1e-12).all() and (exact <= upper + 1e-12).all(), sets
    full = np.broadcast_to(np.arange(50), (2, 8, 50))  # every token a candidate: both bounds exact
    lower, upper = agreement(full, np.log(p), np.log(q))
    np.testing.assert_allclose(lower, exact, rtol=1e-12)
    np.testing.assert_allclose(upper, exact, rtol=1e-12)


def test_the_dry_run_counts_the_resolved_candidates():
    from sparserl_jax.dryrun import token_record_bytes

    assert token_record_bytes(TrainConfig())[1] == 0  # auto, dense: no candidates recorded
    assert token_record_bytes(_cfg())[1] == 8 * AGREEMENT_K  # auto, sparse: Sparrow's top 20
    assert token_record_bytes(_cfg("rollout.agreement_k=3"))[1] == 24
