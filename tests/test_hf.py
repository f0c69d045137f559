"""HF checkpoint import/export (sparserl_jax.model.hf): parity with transformers, bit-exact round
trips, sharded loading, and errors that name the problem.

Relative error of logits a against reference b: max|a - b| / max|b| over the whole [B, T, V]
array (a scale-free bound that small logits cannot inflate).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from float_tol import forward_terms, logit_magnitude, sum_tol
from hf_fixtures import HF_FAMILIES, load_hf_model, make_tiny_hf_checkpoint

from sparserl_jax.kvcache import cache as kvc
from sparserl_jax.model import hf
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig, RopeScaling
from sparserl_jax.model.hf_config import config_from_hf, config_to_hf, generation_config_to_hf

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

B, T, N_NEW = 2, 12, 32
_logits = jax.jit(tf.logits, static_argnums=1)
_prefill = jax.jit(tf.prefill, static_argnums=1)
_decode = jax.jit(tf.decode_step, static_argnums=1)


def _tokens(seed: int, vocab: int) -> np.ndarray:
    return np.asarray(jax.random.randint(jax.random.key(seed), (B, T), 0, vocab))


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def _assert_trees_bit_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        x, y = np.asarray(x), np.asarray(y)
        np.testing.assert_array_equal(x.view(f"u{x.itemsize}"), y.view(f"u{y.itemsize}"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """ckpt(family, **kw) -> directory of a tiny random HF checkpoint (built once per setting)."""
    root, made = tmp_path_factory.mktemp("hf"), {}

    def get(family, **kw):
        key = (family, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = make_tiny_hf_checkpoint(family, root, **kw)
        return made[key]

    return get


# ------------------------------------------------------------------ parity with transformers


@pytest.mark.parametrize("family,sharded", [("qwen2", False), ("llama", False), ("llama", True), ("qwen3", False)])
def test_logits_match_transformers(ckpt, family, sharded):
    directory = ckpt(family, sharded=sharded)
    if sharded:
        assert (directory / "model.safetensors.index.json").is_file()
        assert len(list(directory.glob("*.safetensors"))) > 3
    cfg, params = hf.load_params(directory)
    tokens = _tokens(1, cfg.vocab_size)
    ref = _hf_logits(load_hf_model(directory), tokens)
    assert _rel_err(_logits(params, cfg, jnp.asarray(tokens)), ref) <= 1e-4
    expected = {
        "qwen2": dict(qkv_bias=True, tie_embeddings=True, head_dim=16, rope_theta=1e6, eos_token_ids=(2,)),
        "llama": dict(
            tie_embeddings=False,
            rope_theta=5e5,
            eos_token_ids=(2, 3),
            norm_eps=1e-5,
            rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64),
        ),
        "qwen3": dict(qk_norm=True, tie_embeddings=True, head_dim=24, eos_token_ids=(5,), pad_token_id=0),
    }[family]
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert ("lm_head" in params) == (family == "llama")


def _greedy(params, cfg: ModelConfig, prompt: np.ndarray, n_new: int) -> tuple[np.ndarray, float]:
    """Greedy decoding with our prefill + decode_step over a dense cache; also the smallest
    gap between the top two logits over the steps."""
    b, t = prompt.shape
    cache = kvc.init_cache(b, cfg.n_layers, cfg.n_kv_heads, t + n_new, cfg.head_dim, jnp.dtype(cfg.dtype))
    logits, cache = _prefill(params, cfg, jnp.asarray(prompt), jnp.full((b,), t, jnp.int32), cache)
    out, gap = [], np.inf
    for i in range(n_new):
        top2 = np.sort(np.asarray(logits), axis=-1)[:, -2:]
        gap = min(gap, float((top2[:, 1] - top2[:, 0]).min()))
        token = jnp.argmax(logits, axis=-1)
        out.append(token)
        if i + 1 < n_new:
            logits, cache = _decode(params, cfg, cache, token)
    return np.stack(out, axis=1), gap


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_greedy_generation_matches_transformers(ckpt, family):
    directory = ckpt(family)
    cfg, params = hf.load_params(directory)
    prompt = _tokens(2, cfg.vocab_size)
    model = load_hf_model(directory)
    model.generation_config.eos_token_id = None  # always 32 new tokens, like our loop
    with torch.no_grad():
        ref = model.generate(torch.tensor(prompt), do_sample=False, max_new_tokens=N_NEW)[:, T:].numpy()
    ours, gap = _greedy(params, cfg, prompt, N_NEW)
    assert ref.shape == (B, N_NEW)
    # argmaxes of two frameworks' float32 logits are equal on any CPU while every step's top-2
    # gap exceeds twice their float noise (float_tol; ~1.5e-3, the gaps here are >= 0.01)
    assert gap > 2 * sum_tol(forward_terms(cfg, T + N_NEW), logit_magnitude(params)), gap
    np.testing.assert_array_equal(ours, ref)


# ----------------------------------------------------------------------------- export


@pytest.mark.parametrize("family", HF_FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_then_import_is_bit_exact(ckpt, tmp_path, family, dtype):
    cfg, params = hf.load_params(ckpt(family), dtype=dtype)
    assert cfg.dtype == dtype and params["embed"].dtype == jnp.dtype(dtype)
    shard_bytes = 30_000 if family == "llama" else hf.DEFAULT_MAX_SHARD_BYTES
    hf.save_params(tmp_path / "out", cfg, params, max_shard_bytes=shard_bytes)
    if family == "llama":
        index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 2
        assert not (tmp_path / "out" / "model.safetensors").exists()
    cfg2, params2 = hf.load_params(tmp_path / "out")
    assert cfg2 == cfg
    _assert_trees_bit_equal(params2, params)
    if family == "llama":  # saving again unsharded into the same directory drops the old shards
        hf.save_params(tmp_path / "out", cfg, params)
        assert [p.name for p in (tmp_path / "out").glob("*.safetensors")] == ["model.safetensors"]
        assert not (tmp_path / "out" / "model.safetensors.index.json").exists()
        _assert_trees_bit_equal(hf.load_params(tmp_path / "out")[1], params)


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_transformers_loads_export(ckpt, tmp_path, family):
    """from_pretrained on our export gives the original model's logits; tokenizer files follow."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = ckpt(family)
    cfg, params = hf.load_params(directory)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    vocab = {f"w{i}": i for i in range(cfg.vocab_size - 1)} | {"<unk>": cfg.vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (tok_dir / "config.json").write_text("{}")  # not a tokenizer file: must not be copied over ours
    out = tmp_path / "out"
    hf.save_params(out, cfg, params, tokenizer_dir=tok_dir)

    tokens = _tokens(3, cfg.vocab_size)
    ref = _hf_logits(load_hf_model(directory), tokens)
    # the same torch program on bit-identical weights (export is exact): equal bits
    np.testing.assert_array_equal(_hf_logits(load_hf_model(out), tokens), ref)
    from transformers import PreTrainedTokenizerFast

    assert json.loads((out / "config.json").read_text())["architectures"] == [hf_arch(family)]
    ids = PreTrainedTokenizerFast.from_pretrained(out)("w7 w11 zz", add_special_tokens=False)["input_ids"]
    assert ids == [7, 11, cfg.vocab_size - 1]


def hf_arch(family: str) -> str:
    return {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]


def test_bf16_checkpoint_loads_exactly(ckpt):
    """A bfloat16 checkpoint (raw BF16 tensors) loads bit-exactly in bfloat16 and float32, and
    equals the float32 checkpoint rounded to bfloat16 (round-to-nearest-even on both sides)."""
    cfg16, p16 = hf.load_params(ckpt("qwen3", dtype="bfloat16"))
    assert cfg16.dtype == "bfloat16"
    _, p32 = hf.load_params(ckpt("qwen3"))
    _assert_trees_bit_equal(p16, jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16), p32))
    _, p16_as32 = hf.load_params(ckpt("qwen3", dtype="bfloat16"), dtype="float32")
    _assert_trees_bit_equal(p16_as32, jax.tree.map(lambda x: np.asarray(x).astype(np.float32), p16))


# ----------------------------------------------------------------------------- sharded loading


class _Recorder:
    """A safetensors slice stand-in over a numpy array that records what is read."""

    def __init__(self, array):
        self.array, self.reads = array, []

    def __getitem__(self, index):
        self.reads.append(index)
        return self.array[index]


def test_block_read_touches_only_covering_rows():
    """A device block of q [D, N, H] reads only its heads' rows and its D columns of
    q_proj.weight [N*H, D], also when H itself is split, and equals that block of the full read."""
    cfg = ModelConfig.tiny("qwen2")
    D, N, H = cfg.d_model, cfg.n_heads, cfg.head_dim
    spec = next(s for s in hf.hf_tensors(cfg) if s.path == ("layers", 0, "q"))
    weight = np.asarray(jax.random.normal(jax.random.key(4), (N * H, D)))
    full = spec.read(_Recorder(weight))
    assert full.shape == (D, N, H)
    np.testing.assert_array_equal(full, weight.reshape(N, H, D).transpose(2, 0, 1))
    for index, rows in [
        ((slice(0, D // 2), slice(1, 3), slice(None)), slice(H, 3 * H)),
        ((slice(D // 2, D), slice(2, 3), slice(H // 2, H)), slice(2 * H, 3 * H)),
    ]:
        recorder = _Recorder(weight)
        np.testing.assert_array_equal(spec.read(recorder, index), full[index])
        assert recorder.reads == [(rows, slice(index[0].start, index[0].stop))]


def test_sharded_load_on_one_device_is_identical(ckpt):
    directory = ckpt("llama", sharded=True)
    cfg, ref = hf.load_params(directory)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    row = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    shardings = jax.tree.map(lambda _: row, ref)
    _, params = hf.load_params(directory, shardings=shardings)
    _assert_trees_bit_equal(params, ref)
    assert all(x.sharding == row for x in jax.tree.leaves(params))
    _, params = hf.load_params(directory, shardings=row)  # one sharding for every array
    _assert_trees_bit_equal(params, ref)
    del shardings["lm_head"]
    with pytest.raises(ValueError, match="structure of the params"):
        hf.load_params(directory, shardings=shardings)


_WORKER = textwrap.dedent(
    """
    import sys
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from sparserl_jax.model import hf

    assert jax.device_count() == 8
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))

    def spec(x):  # first axis over "data", last axis over "model" where they divide
        axes = [None] * x.ndim
        if x.shape[0] % 2 == 0:
            axes[0] = "data"
        if x.ndim > 1 and x.shape[-1] % 4 == 0:
            axes[-1] = "model"
        return NamedSharding(mesh, P(*axes))

    n_split = 0
    cases = [(sys.argv[1], "float32"), (sys.argv[1], "bfloat16"), (sys.argv[2], None)]
    for directory, dtype in cases:
        cfg, ref = hf.load_params(directory, dtype=dtype)
        _, got = hf.load_params(directory, dtype=dtype, shardings=jax.tree.map(spec, ref))
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
            y = np.asarray(y)
            assert x.dtype == y.dtype and x.shape == y.shape
            assert x.sharding == spec(y)
            for shard in x.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), y[shard.index])
                n_split += np.asarray(shard.data).size < y.size
            np.testing.assert_array_equal(np.asarray(x), y)
    assert n_split > 100, n_split
    print("HF_SHARDED_OK")
    """
)


def test_sharded_load_on_8_devices(ckpt):
    """Each device's block (sharded on the HF tensors' split head axes too) equals its slice."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    dirs = [str(ckpt("qwen2")), str(ckpt("qwen3", sharded=True, dtype="bfloat16"))]
    result = subprocess.run(
        [sys.executable, "-c", _WORKER, *dirs], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "HF_SHARDED_OK" in result.stdout


# ----------------------------------------------------------------------------- config mapping


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_config_round_trip(family):
    # a checkpoint stores one dtype, read back as both the compute and the parameter dtype
    cfg = ModelConfig.tiny(
        family,
        bos_token_id=3,
        eos_token_ids=(4, 9),
        pad_token_id=1,
        dtype="bfloat16",
        param_dtype="bfloat16",
    )
    back = config_from_hf(config_to_hf(cfg), generation_config_to_hf(cfg))
    assert back == cfg


def test_config_reads_both_rope_spellings():
    """transformers 5 `rope_parameters` and the older `rope_theta` + `rope_scaling` with `type`."""
    base = config_to_hf(ModelConfig.tiny("llama"))
    new = {k: v for k, v in base.items() if k not in ("rope_scaling", "rope_theta")}
    old = {k: v for k, v in base.items() if k != "rope_parameters"}
    old["rope_scaling"] = dict(old["rope_scaling"])
    old["rope_scaling"]["type"] = old["rope_scaling"].pop("rope_type")
    assert config_from_hf(new) == config_from_hf(old) == config_from_hf(base)
    assert config_from_hf(old).rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)
    plain = dict(new, rope_parameters=None, rope_theta=123.0)
    assert config_from_hf(plain).rope_theta == 123.0 and config_from_hf(plain).rope_scaling is None


# ----------------------------------------------------------------------------- errors


def _random_params(cfg: ModelConfig, seed: int):
    """Random params of the right shapes, drawn with numpy (no per-shape XLA compiles)."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda key: tf.init_params(cfg, key), jax.random.key(0))
    return jax.tree.map(lambda s: jnp.asarray(0.1 * rng.standard_normal(s.shape), s.dtype), shapes)


@pytest.fixture
def own_ckpt(tmp_path):
    """A checkpoint written by save_params (no torch needed): tiny llama, untied."""
    cfg = ModelConfig.tiny("llama", tie_embeddings=False)
    params = _random_params(cfg, 7)
    hf.save_params(tmp_path / "ck", cfg, params)
    return tmp_path / "ck"


def _edit_config(directory: Path, **changes):
    hf_cfg = json.loads((directory / "config.json").read_text())
    hf_cfg.update(changes)
    (directory / "config.json").write_text(json.dumps(hf_cfg))


def test_error_missing_directory_and_files(own_ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf.load_params(tmp_path / "nope")
    (own_ckpt / "config.json").rename(own_ckpt / "config.bak")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf.load_params(own_ckpt)
    (own_ckpt / "config.bak").rename(own_ckpt / "config.json")
    (own_ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        hf.load_params(own_ckpt)


def test_error_unsupported_architecture(own_ckpt):
    _edit_config(own_ckpt, architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(ValueError, match="MistralForCausalLM") as err:
        hf.load_params(own_ckpt)
    for arch in ("Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(err.value)


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(attention_bias=True), "attention_bias"),
        (
            dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}, rope_scaling=None),
            "rope_type='yarn'",
        ),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(mlp_bias=True), "mlp_bias"),
    ],
)
def test_error_unsupported_settings(own_ckpt, changes, match):
    _edit_config(own_ckpt, **changes)
    with pytest.raises(ValueError, match=match):
        hf.load_params(own_ckpt)


def test_error_wrong_shape_missing_and_extra_tensors(own_ckpt):
    cfg = hf.load_config(own_ckpt)
    _edit_config(own_ckpt, intermediate_size=cfg.d_ff * 2)
    with pytest.raises(ValueError) as err:
        hf.load_params(own_ckpt)
    msg = str(err.value)
    assert "model.layers.0.mlp.gate_proj.weight" in msg
    assert f"({cfg.d_ff}, {cfg.d_model})" in msg and f"({2 * cfg.d_ff}, {cfg.d_model})" in msg
    _edit_config(own_ckpt, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layers + 1)
    with pytest.raises(ValueError, match=rf"'model.layers.{cfg.n_layers}.input_layernorm.weight' is missing"):
        hf.load_params(own_ckpt)
    _edit_config(own_ckpt, num_hidden_layers=cfg.n_layers - 1)
    with pytest.raises(ValueError, match=rf"unexpected tensors.*model.layers.{cfg.n_layers - 1}"):
        hf.load_params(own_ckpt)


def test_error_save_params_mismatch(tmp_path):
    cfg = ModelConfig.tiny("qwen2")
    params = _random_params(cfg, 8)
    with pytest.raises(ValueError, match="lm_head"):  # tied cfg, untied params
        hf.save_params(tmp_path, cfg, {**params, "lm_head": params["embed"].T})
    bad = jax.tree.map(lambda x: x, params)
    bad["layers"][1]["q"] = bad["layers"][1]["q"][:, :, :-2]
    with pytest.raises(ValueError, match="layers/1/q"):
        hf.save_params(tmp_path, cfg, bad)
    llama_bias = ModelConfig.tiny("llama", qkv_bias=True)  # Llama has no q/k/v-only bias
    with pytest.raises(ValueError, match="qkv_bias"):
        hf.save_params(tmp_path, llama_bias, _random_params(llama_bias, 9))
    with pytest.raises(FileNotFoundError, match="tokenizer_dir"):
        hf.save_params(tmp_path, cfg, params, tokenizer_dir=tmp_path / "missing")
    assert not any(tmp_path.iterdir())  # every check runs before anything is written
