"""`python -m sparserl_jax.export`: a training run's checkpoint as a Hugging Face directory.

The run is a tiny config on a tiny random HF checkpoint (tests/hf_fixtures.py, the char
tokenizer's files beside it) with two checkpoints written by the project's own writer: step 1 the
base weights, step 2 another draw (what training would have changed). The export holds the
chosen step's weights exactly (float32) or rounded (bfloat16), transformers loads it with its
tokenizer, and its greedy decoding equals our sampler's on 3 prompts. A model.arch run exports
with its task tokenizer's special tokens. Bad input is one line naming the setting."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from float_tol import forward_terms, logit_magnitude, sum_tol
from hf_fixtures import load_hf_model, make_tiny_hf_checkpoint

from sparserl_jax import cli, components, export
from sparserl_jax.checkpoint import Checkpointer
from sparserl_jax.config import dump_config, load_config
from sparserl_jax.model import hf
from sparserl_jax.model import transformer as tf
from sparserl_jax.rollout.sampler import SamplerConfig, generate_jit
from sparserl_jax.rollout.sampling import SamplingConfig
from sparserl_jax.tokenizer import CharTokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMOKE = os.path.join(os.path.dirname(__file__), "..", "experiments", "configs", "smoke.yaml")
PROMPTS = ["1+1=", "What is 12*3?", "Tell me a story"]
N_NEW = 12


def _write_run(run, cfg, steps: dict) -> None:
    """config.yaml and one checkpoint per step ({step: params}), as a training run leaves them."""
    run.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, str(run / "config.yaml"))
    ckpt = Checkpointer(str(run / "checkpoints"))
    for step, params in steps.items():
        ckpt.save(step, {"params": params}, {"iteration": step})
    ckpt.close()


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """(run directory, params of step 1, params of step 2) of a run on an HF checkpoint."""
    root = tmp_path_factory.mktemp("export")
    base = make_tiny_hf_checkpoint("qwen2", root, seed=0)
    CharTokenizer().save(base)
    run = root / "run"
    cfg = load_config([SMOKE], [f"train.out_dir={run}", f"model.checkpoint={base}", "train.progress=false"])
    params1 = hf.load_params(base)[1]
    params2 = hf.load_params(make_tiny_hf_checkpoint("qwen2", root, seed=1))[1]
    _write_run(run, cfg, {1: params1, 2: params2})
    return run, params1, params2


def _assert_bit_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _ours_greedy(params, model_cfg, prompts: list[list[int]]) -> tuple[np.ndarray, float]:
    """Our sampler's greedy tokens for right-padded prompts, and the smallest gap between the
    top two logits along them (tf.logits over each prompt + its response)."""
    P = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), P), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    cfg = SamplerConfig(max_new_tokens=N_NEW, sampling=SamplingConfig(0.0))  # no EOS: N_NEW tokens
    out = jax.device_get(
        generate_jit(params, model_cfg, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0), cfg)
    )
    gap = np.inf
    for i, p in enumerate(prompts):
        seq = np.array(p + out.tokens[i].tolist())[None]
        logits = np.asarray(tf.logits(params, model_cfg, jnp.asarray(seq)))[0, len(p) - 1 : -1]
        top2 = np.sort(logits, axis=-1)[:, -2:]
        gap = min(gap, float((top2[:, 1] - top2[:, 0]).min()))
    return np.asarray(out.tokens), gap


def test_export_round_trip_transformers_greedy_equals_ours(hf_run, tmp_path, capsys):
    run, _, params2 = hf_run
    out = tmp_path / "hf"
    assert export.main([str(run), "--out", str(out)]) == 2  # the newest step
    assert f"exported {run} step 2 to {out}" in capsys.readouterr().out
    for name in (
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (out / name).is_file(), name
    model_cfg, exported = hf.load_params(out)
    _assert_bit_equal(exported, params2)  # float32 master weights, exactly
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]

    # PreTrainedTokenizerFast, the class tokenizer_config.json names: transformers 5's AutoTokenizer
    # would pick Qwen2Tokenizer from config.json's model_type and split the char vocabulary its way
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    ids = [hf_tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    assert ids == [CharTokenizer().encode(p) for p in PROMPTS]  # the tokenizer files came along
    model = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    model.generation_config.eos_token_id = None  # always N_NEW tokens, like ours
    with torch.no_grad():
        theirs = [
            model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=N_NEW)[0, len(p) :].numpy() for p in ids
        ]
    _, parts, step = export.load_run(str(run))
    run_params = parts.params
    assert step == 2
    ours, gap = _ours_greedy(run_params, model_cfg, ids)
    # argmaxes of two frameworks' float32 logits agree while every step's top-2 gap exceeds twice
    # their float noise (tests/float_tol.py)
    assert gap > 2 * sum_tol(forward_terms(model_cfg, 32), logit_magnitude(run_params)), gap
    np.testing.assert_array_equal(ours, np.stack(theirs))


def test_export_step_and_bfloat16(hf_run, tmp_path):
    run, params1, _ = hf_run
    assert export.export(str(run), str(tmp_path / "one"), step=1) == 1
    _assert_bit_equal(hf.load_params(tmp_path / "one")[1], params1)

    out = tmp_path / "bf16"
    export.main([str(run), "--out", str(out), "--dtype", "bfloat16"])
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    cfg, exported = hf.load_params(out)
    assert cfg.dtype == "bfloat16" and exported["embed"].dtype == jnp.bfloat16
    rounded = jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16), hf_run[2])
    _assert_bit_equal(exported, rounded)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    weight = model.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(weight, np.asarray(rounded["embed"]).astype(np.float32))


def test_export_of_a_model_arch_run(tmp_path):
    """A randomly initialised architecture with the task's char tokenizer: config.json names the
    tokenizer's special tokens and transformers computes our logits."""
    run = tmp_path / "run"
    cfg = load_config([SMOKE], [f"train.out_dir={run}", "train.progress=false"])
    parts = components.build_model(cfg)
    _write_run(run, cfg, {3: parts.params})
    out = tmp_path / "hf"
    export.export(str(run), str(out))
    tok = CharTokenizer()
    hf_cfg = json.loads((out / "config.json").read_text())
    assert (hf_cfg["bos_token_id"], hf_cfg["eos_token_id"], hf_cfg["pad_token_id"]) == (
        tok.bos_token_id,
        tok.eos_token_ids[0],
        tok.pad_token_id,
    )
    assert transformers.PreTrainedTokenizerFast.from_pretrained(out)("2+3", add_special_tokens=False)[
        "input_ids"
    ] == tok.encode("2+3")
    tokens = np.array([tok.encode("12+34=46 and 5*6")])
    ours = np.asarray(tf.logits(parts.params, parts.model_cfg, jnp.asarray(tokens)), np.float64)
    with torch.no_grad():
        theirs = load_hf_model(out)(torch.tensor(tokens)).logits.numpy().astype(np.float64)
    assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()


@pytest.mark.parametrize(
    "args,message",
    [
        (["{tmp}/nowhere"], "RUN_DIR '{tmp}/nowhere': no such directory"),
        (["{tmp}"], "has no config.yaml: not a training run directory"),
        (["{run}", "--step", "9"], "--step 9: no such checkpoint"),
        (["{run}", "--dtype", "float16"], "--dtype='float16': accepted values are ('float32', 'bfloat16')"),
    ],
)
def test_bad_input_is_one_line_naming_the_setting(hf_run, tmp_path, capsys, args, message):
    fill = lambda s: s.format(tmp=tmp_path, run=hf_run[0])  # noqa: E731
    argv = [fill(a) for a in args] + ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as e:
        cli.run(lambda: export.main(argv))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and fill(message) in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_help():
    proc = subprocess.run(
        [sys.executable, "-m", "sparserl_jax.export", "--help"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "RUN_DIR" in proc.stdout and "--dtype" in proc.stdout
