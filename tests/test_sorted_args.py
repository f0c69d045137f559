"""Bad arguments to the SortedRL classes an ablation script builds from Python (SlotEngine,
SortedScheduler and its load_group, SortedConfig) fail at once with a one-line ValueError that
names the setting and what is accepted: none hangs, none fails later with an unrelated error."""

import dataclasses
import signal
import types

import jax
import numpy as np
import pytest

from sparserl_jax import kvcache as kv
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rollout.config import SortedConfig
from sparserl_jax.rollout.engine import SlotEngine
from sparserl_jax.rollout.sampler import SamplerConfig
from sparserl_jax.rollout.scheduler import SortedScheduler

CFG = ModelConfig.tiny("qwen2", vocab_size=64, n_layers=1)
SAMPLER = SamplerConfig(max_new_tokens=8, kv=kv.KVConfig(policy="none", budget=8, buffer=4, window=2))
P = 6


@pytest.fixture(autouse=True)
def fail_fast():
    """Each case must raise within seconds: an alarm turns a hang into a failure."""

    def hung(*_):
        raise TimeoutError("did not fail fast")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _raises_one_line(make, match):
    with pytest.raises(ValueError, match=match) as err:
        make()
    assert "\n" not in str(err.value)


def _engine(**kw):
    args = dict(model_cfg=CFG, cfg=SAMPLER, slots=4, prompt_len=P, segment_chunks=1, mesh=None)
    args.update(kw)
    return SlotEngine(args.pop("model_cfg"), args.pop("cfg"), args.pop("slots"), args.pop("prompt_len"), **args)


MESH_8 = types.SimpleNamespace(size=8, shape={"data": 4, "fsdp": 2})
ENGINE_CASES = {
    "zero slots": (dict(slots=0), r"sorted\.slots=0 must be >= 1"),
    "negative slots": (dict(slots=-4), r"sorted\.slots=-4 must be >= 1"),
    "fractional slots": (dict(slots=2.5), r"sorted\.slots=2\.5 must be an integer"),
    "zero prompt width": (dict(prompt_len=0), r"prompt_len \(data\.max_prompt_len\)=0 must be >= 1"),
    "zero segment": (dict(segment_chunks=0), r"sorted\.segment_chunks=0 must be >= 1"),
    "slots vs mesh": (dict(slots=6, mesh=MESH_8), r"sorted\.slots=6 must be a multiple of mesh data x fsdp = 8"),
    "mesh axes": (dict(mesh=types.SimpleNamespace(size=4, shape={"x": 4})), r"mesh axes \('x',\)"),
    "model config": (dict(model_cfg={"d_model": 8}), r"model_cfg=dict: a ModelConfig"),
    "sampler config": (dict(cfg=None), r"cfg=NoneType: a SamplerConfig"),
    "record_kept": (dict(cfg=dataclasses.replace(SAMPLER, record_kept=True)), r"sampler\.record_kept"),
}


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_slot_engine_rejects(case):
    kw, match = ENGINE_CASES[case]
    _raises_one_line(lambda: _engine(**kw), match)


def test_sizes_the_engine_takes_from_its_configs_fail_in_them():
    """A zero response length or KV buffer (a segment of zero steps would never end) stops at
    the config the engine is built from."""
    _raises_one_line(lambda: SamplerConfig(max_new_tokens=0), r"sampler\.max_new_tokens=0")
    _raises_one_line(lambda: kv.KVConfig(policy="snapkv", buffer=0), r"kv\.buffer=0")


CONFIG_CASES = {
    "mode": (dict(mode="lazy"), r"sorted\.mode='lazy': accepted values are \('on_policy', 'partial'\)"),
    "resume": (dict(resume="keep"), r"sorted\.resume='keep': accepted values are \('cache', 'prefill'\)"),
    "negative slots": (dict(slots=-1), r"sorted\.slots=-1 must be >= 0"),
    "fractional slots": (dict(slots=1.5), r"sorted\.slots=1\.5 must be an integer"),
    "zero groups": (dict(group_batches=0), r"sorted\.group_batches=0 must be >= 1"),
    "boolean groups": (dict(group_batches=True), r"sorted\.group_batches=True must be an integer"),
    "zero segment": (dict(segment_chunks=0), r"sorted\.segment_chunks=0 must be >= 1"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_sorted_config_rejects(case):
    kw, match = CONFIG_CASES[case]
    _raises_one_line(lambda: SortedConfig(**kw), match)


def _scheduler(**kw):
    args = dict(engine=_engine(), cfg=SortedConfig(group_batches=2), prompts_per_batch=2, samples=2)
    args.update(kw)
    return SortedScheduler(args.pop("engine"), args.pop("cfg"), **args)


SCHEDULER_CASES = {
    "engine": (dict(engine="slots"), r"engine=str: a SlotEngine"),
    "config": (dict(cfg={"mode": "partial"}), r"cfg=dict: a SortedConfig"),
    "zero prompts": (dict(prompts_per_batch=0), r"rollout\.prompts \(prompts_per_batch\)=0 must be >= 1"),
    "zero samples": (dict(samples=0), r"rollout\.samples \(samples\)=0 must be >= 1"),
    "fractional samples": (dict(samples=1.5), r"rollout\.samples \(samples\)=1\.5 must be an integer"),
    "pad token": (dict(pad_token_id=-1), r"pad_token_id=-1 must be >= 0"),
    "slots vs engine": (dict(cfg=SortedConfig(slots=8)), r"sorted\.slots=8 but the engine has 4 slots"),
}


@pytest.mark.parametrize("case", list(SCHEDULER_CASES))
def test_sorted_scheduler_rejects(case):
    kw, match = SCHEDULER_CASES[case]
    _raises_one_line(lambda: _scheduler(**kw), match)


G = 4  # sorted.group_batches 2 x rollout.prompts 2
TOKENS = np.ones((G, P), np.int32)
LENGTHS = np.full((G,), 3, np.int32)
GROUP_CASES = {
    "too few prompts": (
        dict(examples=[0, 1, 2]),
        r"a group of 3 prompts: a group holds sorted\.group_batches x rollout\.prompts = 2 x 2 = 4",
    ),
    "too many prompts": (dict(examples=list(range(6))), r"a group of 6 prompts"),
    "prompt width": (
        dict(prompt_tokens=np.ones((G, P + 2), np.int32)),
        r"prompt_tokens of shape \(4, 8\): \[4 prompts, the engine's prompt width 6\]",
    ),
    "zero-length prompt": (
        dict(prompt_lengths=np.array([3, 0, 3, 3])),
        r"prompt_lengths \[3, 0, 3, 3\]: 4 lengths in \[1, 6\]",
    ),
    "prompt too long": (dict(prompt_lengths=np.array([3, 7, 3, 3])), r"prompt_lengths .*in \[1, 6\]"),
    "limits shape": (dict(limits=np.ones((G, 3), np.int32)), r"limits of shape \(4, 3\).*\[4 prompts, 2 samples\]"),
    "zero limit": (dict(limits=np.zeros((G, 2), np.int32)), r"limits of shape \(4, 2\) \(min 0\)"),
}


@pytest.mark.parametrize("case", list(GROUP_CASES))
def test_load_group_rejects(case):
    kw, match = GROUP_CASES[case]
    args = dict(examples=list(range(G)), prompt_tokens=TOKENS, prompt_lengths=LENGTHS, limits=None)
    args.update(kw)
    sched = _scheduler()
    _raises_one_line(
        lambda: sched.load_group(
            args["examples"], args["prompt_tokens"], args["prompt_lengths"], jax.random.key(0), args["limits"]
        ),
        match,
    )
    assert sched.at_group_boundary and sched.group == -1  # nothing was loaded
