"""The rollout sources and the sampler, built or called from Python (what an ablation script
does) with a bad argument: each fails at once, when built or traced, with one line that names the
argument or setting; never later (after a warm start) or with an unrelated error."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparserl_jax.config import load_config
from sparserl_jax.kvcache.config import KVConfig
from sparserl_jax.model import sharding, transformer
from sparserl_jax.rollout import sampler as S
from sparserl_jax.rollout import source
from sparserl_jax.rollout.sampling import SamplingConfig

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
    cfg = load_config([SMOKE], [f"rollout.scheduler={scheduler}"])
    r = cfg.rollout
    sampler_cfg = S.SamplerConfig(max_new_tokens=r.max_new_tokens,
                                  sampling=SamplingConfig(r.temperature, r.top_p, r.top_k), kv=cfg.kv)
    return dict(cfg=cfg, prompts=Prompts(), model_cfg=cfg.model.arch, sampler_cfg=sampler_cfg,
                mesh=sharding.make_mesh(cfg.mesh), pad_token_id=0)


def _replace_sampler(**changes):
    return lambda a: dict(a, sampler_cfg=dataclasses.replace(a["sampler_cfg"], **changes))


BAD_SOURCE_ARGS = [  # (a change to good arguments, the start of the one-line message)
    (lambda a: dict(a, cfg=a["cfg"].rollout), "cfg: expected a TrainConfig"),
    (lambda a: dict(a, prompts=[]), "prompts: a list has no next_batch, state_dict, load_state_dict"),
    (lambda a: dict(a, model_cfg=dataclasses.asdict(a["model_cfg"])), "model_cfg: expected a ModelConfig"),
    (lambda a: dict(a, sampler_cfg=None), "sampler_cfg: expected a SamplerConfig"),
    (_replace_sampler(kv=KVConfig()), "sampler_cfg.kv=KVConfig(policy='none'"),
    (_replace_sampler(max_new_tokens=8), "sampler_cfg.max_new_tokens=8 differs from rollout.max_new_tokens=16"),
    (_replace_sampler(sampling=SamplingConfig(temperature=0.5)), "sampler_cfg.sampling=SamplingConfig(temperature=0.5"),
    (lambda a: dict(a, mesh=None), "mesh: expected a jax Mesh with axes 'data' and 'fsdp'"),
    (lambda a: dict(a, pad_token_id=-1), "pad_token_id=-1 must be >= 0"),
    (lambda a: dict(a, pad_token_id=128), "pad_token_id=128 is not a token of the model (model.vocab_size=128)"),
    (lambda a: dict(a, pad_token_id=0.0), "pad_token_id=0.0 must be an integer"),
]


@pytest.mark.parametrize("scheduler", ["batch", "sorted"])
@pytest.mark.parametrize("change, message", BAD_SOURCE_ARGS, ids=[m.split(":")[0].split("=")[0]
                                                                  for _, m in BAD_SOURCE_ARGS])
def test_a_source_refuses_a_bad_argument_when_built(scheduler, change, message):
    with pytest.raises(ValueError) as e:
        source.make_source(**change(_args(scheduler)))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_sorted_source_checks_its_engine_when_built():
    """The slot engine and scheduler are built with the source, so their checks run then."""
    args = _args("sorted")
    args["cfg"] = dataclasses.replace(args["cfg"], kv=dataclasses.replace(args["cfg"].kv, trigger="interval"))
    args["sampler_cfg"] = dataclasses.replace(args["sampler_cfg"], kv=args["cfg"].kv, record_kept=True)
    with pytest.raises(ValueError, match=r"^sampler\.record_kept .*rollout\.scheduler='batch'"):
        source.make_source(**args)


def test_good_arguments_build_both_sources():
    batch = source.make_source(**_args("batch"))
    assert type(batch) is source.BatchSource and batch.scheduler is None
    built = source.make_source(**_args("sorted"))
    assert type(built) is source.SortedSource and built.at_group_boundary
    assert built.scheduler.engine.Q == 16 and built.state_dict()["sorted_group"] == -1


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


@pytest.mark.parametrize("change, message", BAD_BATCHES, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD_BATCHES)])
def test_generate_refuses_a_bad_batch_when_traced(change, message):
    """Checked in the jitted sampler's Python body, so before anything is compiled or run."""
    mc = load_config([SMOKE]).model.arch
    params = jax.eval_shape(lambda: transformer.init_params(mc, jax.random.key(0)))
    args = {**GOOD, **change}
    with pytest.raises(ValueError) as e:
        jax.eval_shape(lambda p: S.generate(p, mc, args["prompts"], args["prompt_lengths"], jax.random.key(0),
                                            S.SamplerConfig(max_new_tokens=4), args.get("request_ids"),
                                            args.get("max_lengths")), params)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    assert S.check_batch(GOOD["prompts"], GOOD["prompt_lengths"], jnp.arange(B), None) is None
