"""The rollout sources and the sampler, built or called from Python (what an ablation script
does) with a bad argument: each fails at once, when built or traced, with one line that names the
argument or setting; never later (after a warm start) or with an unrelated error. A source reads
what it samples (KV cache, max_new_tokens) from its SamplerConfig alone."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparserl_jax import components
from sparserl_jax.config import load_config
from sparserl_jax.kvcache.config import KVConfig
from sparserl_jax.model import sharding, transformer
from sparserl_jax.rollout import sampler as S
from sparserl_jax.rollout import source
from sparserl_jax.rollout.config import SCHEDULERS
from sparserl_jax.rollout.sampling import SamplingConfig
from sparserl_jax.rollout.stats import rollout_metrics

SMOKE = str(Path(__file__).resolve().parent.parent / "experiments/configs/smoke.yaml")


class Prompts:
    """The prompt-source interface a source draws from (components.prompt_source gives one)."""

    def next_batch(self):
        return []

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _args(scheduler="batch"):
    """components.rollout_source's arguments for the smoke config."""
    cfg = load_config([SMOKE], [f"rollout.scheduler={scheduler}"])
    r = cfg.rollout
    sampler_cfg = S.SamplerConfig(
        max_new_tokens=r.max_new_tokens, sampling=SamplingConfig(r.temperature, r.top_p, r.top_k), kv=cfg.kv
    )
    return dict(
        cfg=cfg,
        prompts=Prompts(),
        model_cfg=cfg.model.arch,
        sampler_cfg=sampler_cfg,
        mesh=sharding.make_mesh(cfg.mesh),
        pad_token_id=0,
    )


def _source_args(scheduler="batch"):
    """The source class and its own (narrow) arguments, as components.rollout_source hands them."""
    a = _args(scheduler)
    cfg = a["cfg"]
    args = dict(
        rollout_cfg=cfg.rollout,
        sampler_cfg=a["sampler_cfg"],
        quant_cfg=cfg.quant,
        prompts=a["prompts"],
        model_cfg=a["model_cfg"],
        mesh=a["mesh"],
        max_prompt_len=cfg.data.max_prompt_len,
        pad_token_id=0,
    )
    if scheduler == "sorted":
        args.update(sorted_cfg=cfg.sorted, seed=cfg.train.seed)
    return source.SOURCES[scheduler], args


BAD_SOURCE_ARGS = [  # (a change to good arguments, the start of the one-line message)
    (lambda a: dict(a, rollout_cfg=load_config([SMOKE])), "rollout_cfg: expected a RolloutConfig"),
    (lambda a: dict(a, sampler_cfg=None), "sampler_cfg: expected a SamplerConfig"),
    (lambda a: dict(a, quant_cfg={"format": "int8"}), "quant_cfg: expected a QuantConfig, got dict"),
    (lambda a: dict(a, prompts=[]), "prompts: a list has no next_batch, state_dict, load_state_dict"),
    (lambda a: dict(a, model_cfg=dataclasses.asdict(a["model_cfg"])), "model_cfg: expected a ModelConfig"),
    (lambda a: dict(a, mesh=None), "mesh: expected a jax Mesh with axes 'data' and 'fsdp'"),
    (lambda a: dict(a, max_prompt_len=0), "data.max_prompt_len (max_prompt_len)=0 must be >= 1"),
    (lambda a: dict(a, pad_token_id=-1), "pad_token_id=-1 must be >= 0"),
    (lambda a: dict(a, pad_token_id=128), "pad_token_id=128 is not a token of the model (model.vocab_size=128)"),
    (lambda a: dict(a, pad_token_id=0.0), "pad_token_id=0.0 must be an integer"),
]
BAD_SORTED_ARGS = [  # SortedSource's own
    (lambda a: dict(a, sorted_cfg={"mode": "partial"}), "sorted_cfg: expected a SortedConfig"),
    (
        lambda a: dict(a, rollout_cfg=dataclasses.replace(a["rollout_cfg"], rows_per_call=4)),
        "rollout.rows_per_call=4 is for rollout.scheduler='batch'",
    ),
    (lambda a: dict(a, seed=0.5), "train.seed (seed)=0.5 must be an integer"),
]


def _refuses(build, message):
    with pytest.raises(ValueError) as e:
        build()
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize(
    "change, message", BAD_SOURCE_ARGS, ids=[m.split(":")[0].split("=")[0] for _, m in BAD_SOURCE_ARGS]
)
def test_a_source_refuses_a_bad_argument_when_built(scheduler, change, message):
    cls, args = _source_args(scheduler)
    _refuses(lambda: cls(**change(args)), message)


@pytest.mark.parametrize("change, message", BAD_SORTED_ARGS, ids=["sorted_cfg", "rows_per_call", "seed"])
def test_the_sorted_source_refuses_a_bad_argument_when_built(change, message):
    cls, args = _source_args("sorted")
    _refuses(lambda: cls(**change(args)), message)


def test_rollout_source_wants_a_train_config():
    _refuses(
        lambda: components.rollout_source(**dict(_args(), cfg=_args()["cfg"].rollout)), "cfg: expected a TrainConfig"
    )


def test_sorted_source_checks_its_engine_when_built():
    """The slot engine and scheduler are built with the source, so their checks run then."""
    cls, args = _source_args("sorted")
    kv = dataclasses.replace(args["sampler_cfg"].kv, trigger="interval")
    args["sampler_cfg"] = dataclasses.replace(args["sampler_cfg"], kv=kv, record_kept=True)
    with pytest.raises(ValueError, match=r"^sampler\.record_kept .*rollout\.scheduler='batch'"):
        cls(**args)


def test_good_arguments_build_both_sources():
    assert set(source.SOURCES) == set(SCHEDULERS)
    batch = components.rollout_source(**_args("batch"))
    assert type(batch) is source.BatchSource and batch.scheduler is None
    built = components.rollout_source(**_args("sorted"))
    assert type(built) is source.SortedSource and built.at_group_boundary
    assert built.scheduler.engine.Q == 16 and built.state_dict()["sorted_group"] == -1
    cfg = _args("sorted")["cfg"]
    assert (built.rollout_cfg, built.quant_cfg, built.sorted_cfg) == (cfg.rollout, cfg.quant, cfg.sorted)
    assert (built.max_prompt_len, built.seed) == (cfg.data.max_prompt_len, cfg.train.seed)


def test_rollout_metrics_read_the_sampler_config():
    """One road for the KV settings: the kv/* and truncation metrics follow the SamplerConfig the
    rollout was sampled with (a dense one and a sparse one over the same rollout differ)."""
    B, M, P = 2, 8, 6
    out = S.Rollout(
        tokens=np.zeros((B, M), np.int32),
        logprobs=np.zeros((B, M), np.float32),
        mask=np.ones((B, M), bool),
        lengths=np.array([M, 3]),
        kept=np.full((B, M), 4),
        n_compressions=np.ones(B),
        evicted_fraction=np.zeros(B, np.float32),
    )
    model_cfg = load_config([SMOKE]).model.arch
    sparse = S.SamplerConfig(max_new_tokens=M, kv=KVConfig(policy="snapkv", budget=4, buffer=4, window=2))
    metrics = {
        name: rollout_metrics(out, np.zeros((B, P), np.int32), np.full(B, P), 1.0, cfg, model_cfg)
        for name, cfg in [("sparse", sparse), ("dense", S.SamplerConfig(max_new_tokens=2 * M)), ("same", sparse)]
    }
    assert metrics["sparse"] == metrics["same"]
    assert metrics["sparse"]["response/truncated_fraction"] == 0.5  # one row of two reached M
    assert metrics["dense"]["response/truncated_fraction"] == 0.0  # none reached 2M
    dense = S.SamplerConfig().kv
    slots = S.cache_capacity(dense, P, 2 * M), S.cache_capacity(sparse.kv, P, M)
    assert slots[0] > slots[1]
    ratio = metrics["dense"]["kv/cache_bytes"] / metrics["sparse"]["kv/cache_bytes"]
    assert ratio == slots[0] / slots[1], (ratio, slots)


# ----------------------------------------------------------------------------- the sampler

BAD_SAMPLER_SETTINGS = [
    (dict(max_new_tokens=0), "sampler.max_new_tokens=0 must be >= 1"),
    (dict(eos_token_ids=["eos"]), "sampler.eos_token_ids=['eos'] must be a list of token ids"),
    (dict(pad_token_id=-1), "sampler.pad_token_id=-1 must be >= 0"),
    (dict(attn_impl="flash"), "sampler.attn_impl='flash': accepted values are ('auto', 'xla', 'pallas', 'interpret')"),
    (dict(attn_platform="cuda"), "sampler.attn_platform='cuda': accepted values are (None, 'cpu', 'gpu', 'tpu')"),
    (dict(record_kept="yes"), "sampler.record_kept='yes' must be true or false"),
    (dict(sampling=None), "sampler.sampling=None: expected a SamplingConfig"),
    (dict(kv={"policy": "rkv"}), "sampler.kv={'policy': 'rkv'}: expected a KVConfig"),
]


@pytest.mark.parametrize("kwargs, message", BAD_SAMPLER_SETTINGS, ids=[next(iter(k)) for k, _ in BAD_SAMPLER_SETTINGS])
def test_sampler_config_names_the_setting(kwargs, message):
    with pytest.raises(ValueError) as e:
        S.SamplerConfig(**kwargs)
    assert str(e.value) == message


def test_sampler_config_stays_hashable():
    cfg = S.SamplerConfig(eos_token_ids=[3, np.int32(4)])
    assert cfg.eos_token_ids == (3, 4) and hash(cfg) == hash(S.SamplerConfig(eos_token_ids=(3, 4)))


B, P = 2, 4
GOOD = dict(prompts=np.ones((B, P), np.int32), prompt_lengths=np.full((B,), P, np.int32))
BAD_BATCHES = [
    (dict(prompts=np.ones((B * P,), np.int32)), "prompts: expected [B, P] token ids"),
    (dict(prompts=np.ones((B, P), np.float32)), "prompts: expected [B, P] token ids"),
    (dict(prompts=np.ones((B, 0), np.int32)), "prompts: expected [B, P] token ids"),
    (dict(prompt_lengths=np.full((B + 1,), P, np.int32)), "prompt_lengths: expected [B] = [2] integers"),
    (dict(prompt_lengths=np.full((B,), P, np.float32)), "prompt_lengths: expected [B] = [2] integers"),
    (dict(request_ids=np.arange(B + 1)), "request_ids: expected [B] = [2] integers"),
    (dict(max_lengths=np.ones((B, 1), np.int32)), "max_lengths: expected [B] = [2] integers"),
]


@pytest.mark.parametrize(
    "change, message", BAD_BATCHES, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD_BATCHES)]
)
def test_generate_refuses_a_bad_batch_when_traced(change, message):
    """Checked in the jitted sampler's Python body, so before anything is compiled or run."""
    mc = load_config([SMOKE]).model.arch
    params = jax.eval_shape(lambda: transformer.init_params(mc, jax.random.key(0)))
    args = {**GOOD, **change}
    with pytest.raises(ValueError) as e:
        jax.eval_shape(
            lambda p: S.generate(
                p,
                mc,
                args["prompts"],
                args["prompt_lengths"],
                jax.random.key(0),
                S.SamplerConfig(max_new_tokens=4),
                args.get("request_ids"),
                args.get("max_lengths"),
            ),
            params,
        )
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    assert S.check_batch(GOOD["prompts"], GOOD["prompt_lengths"], jnp.arange(B), None) is None
