"""sparserl_jax.model.sharding: mesh config, partition rules, and sharded == single-device numerics.

The 8-device checks run in one subprocess (tests/sharding_worker.py) with fake CPU devices; the
rest plans layouts from jax.eval_shape in-process, allocating nothing.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparserl_jax.kvcache import cache as kvc
from sparserl_jax.model import sharding as shd
from sparserl_jax.model.config import ModelConfig

TESTS = pathlib.Path(__file__).parent
QWEN25_7B = ModelConfig(
    family="qwen2",
    vocab_size=152064,
    d_model=3584,
    n_layers=28,
    n_heads=28,
    n_kv_heads=4,
    head_dim=128,
    d_ff=18944,
    tie_embeddings=False,
    qkv_bias=True,
    rope_theta=1e6,
)


def fake_device_env(n: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_on_fake_devices(script: str, ok: str, *args: str, n: int = 8, timeout: int = 600) -> str:
    """Run tests/<script> on `n` fake CPU devices; assert it exited 0 and printed `ok`; its stdout."""
    proc = subprocess.run(
        [sys.executable, str(TESTS / script), *args],
        env=fake_device_env(n),
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert ok in proc.stdout, proc.stdout[-6000:]
    return proc.stdout


def test_sharded_forward_prefill_decode_match_single_device_on_8_devices():
    """Mesh data 2 x fsdp 2 x tensor 2: params split as the rules say, logits, prefill and decode
    steps (and the final cache) equal one device's to 1e-5; GQA with one KV head and an odd vocab
    fall back to replication and still match; bad mesh and batch sizes raise."""
    proc = subprocess.run(
        [sys.executable, str(TESTS / "sharding_worker.py")],
        env=fake_device_env(8),
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "SHARDING_WORKER_OK" in proc.stdout


def test_mesh_config_resolves_the_rest_and_names_bad_settings():
    assert shd.MeshConfig().resolve(8) == (8, 1, 1)
    assert shd.MeshConfig(data=-1, fsdp=2, tensor=2).resolve(8) == (2, 2, 2)
    assert shd.MeshConfig(data=1, fsdp=-1, tensor=4).resolve(16) == (1, 4, 4)
    assert shd.MeshConfig(data=2, fsdp=2, tensor=2).resolve(8) == (2, 2, 2)
    with pytest.raises(ValueError, match=r"mesh\.data=3 x mesh\.fsdp=2 x mesh\.tensor=2 = 12"):
        shd.MeshConfig(data=3, fsdp=2, tensor=2).resolve(8)
    with pytest.raises(ValueError, match=r"mesh\.fsdp=3.*must divide the 8 devices"):
        shd.MeshConfig(data=-1, fsdp=3).resolve(8)
    with pytest.raises(ValueError, match=r"mesh\.tensor=0"):
        shd.MeshConfig(tensor=0)
    with pytest.raises(ValueError, match=r"mesh\.data and mesh\.fsdp are both -1"):
        shd.MeshConfig(data=-1, fsdp=-1)
    mesh = shd.make_mesh(shd.MeshConfig())  # this process: 1 device
    assert mesh.axis_names == shd.AXES and mesh.devices.size == jax.device_count()


def test_fit_spec_drops_axes_that_do_not_divide():
    sizes = {"data": 2, "fsdp": 2, "tensor": 4}
    assert shd.fit_spec(P(("data", "fsdp"), "tensor"), (8, 12), sizes) == P(("data", "fsdp"), "tensor")
    assert shd.fit_spec(P(("data", "fsdp"), "tensor"), (6, 6), sizes) == P("data", None)
    assert shd.fit_spec(P(("data", "fsdp")), (3, 5), sizes) == P(None)
    with pytest.raises(ValueError, match="more entries"):
        shd.fit_spec(P("fsdp", "tensor"), (8,), sizes)


def test_qwen25_7b_layout_planned_from_eval_shape():
    """The rules lay out a 7B model from shapes alone; heads that tensor=8 does not divide
    (28 query, 4 KV heads) are replicated, everything else stays split."""
    shapes = shd.abstract_params(QWEN25_7B)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(shapes))
    specs = shd.param_specs(shapes, {"data": 2, "fsdp": 4, "tensor": 8})
    layer = specs["layers"][27]
    assert specs["embed"] == P("tensor", "fsdp") and specs["lm_head"] == P("fsdp", "tensor")
    assert layer["q"] == P("fsdp", None, None) and layer["k"] == P("fsdp", None, None)
    assert layer["o"] == P(None, None, "fsdp") and layer["q_bias"] == P(None, None)
    assert layer["gate"] == P("fsdp", "tensor") and layer["down"] == P("tensor", "fsdp")
    assert layer["mlp_norm"] == P() and specs["final_norm"] == P()
    specs4 = shd.param_specs(shapes, {"data": 1, "fsdp": 8, "tensor": 4})
    assert specs4["layers"][0]["q"] == P("fsdp", "tensor", None)
    assert specs4["layers"][0]["v"] == P("fsdp", "tensor", None)
    assert specs4["layers"][0]["k_bias"] == P("tensor", None)

    mesh = shd.make_mesh(shd.MeshConfig())
    shardings = shd.param_shardings(shapes, mesh)
    leaves = jax.tree_util.tree_leaves(shardings)
    assert len(leaves) == len(jax.tree_util.tree_leaves(shapes)) == 3 + 28 * 12
    assert all(isinstance(s, NamedSharding) and s.mesh == mesh for s in leaves)


def test_unknown_param_and_cache_specs():
    with pytest.raises(ValueError, match="no partition rule matches param 'value_head'"):
        shd.param_specs({"value_head": jax.ShapeDtypeStruct((4, 1), "float32")}, {"tensor": 1})
    cache = jax.eval_shape(lambda: kvc.init_cache(8, 2, 2, 16, 8, n_heads=4, track_mass=True, window=4))
    specs = shd.cache_specs(cache, {"data": 2, "fsdp": 2, "tensor": 2})
    batch_tensor = P(("data", "fsdp"), "tensor")
    assert specs.k[1] == specs.v[0] == specs.pos[0] == specs.mass[1] == batch_tensor
    assert specs.window_q[0] == batch_tensor  # [B, N, W, H]: query heads over tensor
    assert specs.fill == specs.length == P(("data", "fsdp"))
    # batch 8 over data x fsdp = 16 keeps data (4); 2 KV heads on tensor 4 are replicated.
    few = shd.cache_specs(cache, {"data": 4, "fsdp": 4, "tensor": 4})
    assert few.k[0] == P("data", None) and few.window_q[0] == P("data", "tensor")


@pytest.mark.slow
def test_sharded_decode_attention_and_sampler_match_one_device_without_gathering_the_cache():
    """tests/sampler_sharded_worker.py: decode attention under shard_map (data, fsdp, tensor
    layouts; XLA reference and interpreted kernel), a sharded decode step and the sparse sampler
    equal one device; no compiled HLO all-gathers the K/V cache (and without shard_map the
    interpreted kernel's does); 8-way batch sharding leaves ~1/8 of the cache per device."""
    proc = subprocess.run(
        [sys.executable, str(TESTS / "sampler_sharded_worker.py")],
        env=fake_device_env(8),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SAMPLER SHARDED OK" in proc.stdout


@pytest.mark.slow
def test_trainer_runs_on_an_8_device_mesh(tmp_path):
    """Two Sparse-RL iterations with params and batches sharded over data 2 x fsdp 2 x tensor 2."""
    code = (
        "import jax, json, sys\n"
        "from sparserl_jax.config import load_config\n"
        "from sparserl_jax.train import Trainer\n"
        f"cfg = load_config(['{TESTS.parent}/experiments/configs/smoke.yaml'], ['train.out_dir={tmp_path}',"
        " 'train.progress=false', 'train.iterations=2', 'sft.steps=3', 'mesh.data=2', 'mesh.fsdp=2',"
        " 'mesh.tensor=2'])\n"
        "t = Trainer(cfg)\n"
        "hist = t.run()\n"
        "assert len(t.params['layers'][0]['gate'].sharding.device_set) == 8\n"
        "assert all(jax.numpy.isfinite(h['update/loss']) for h in hist)\n"
        "print('TRAINER SHARDED OK', json.dumps(hist[-1]['reward/mean']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=fake_device_env(8), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TRAINER SHARDED OK" in proc.stdout
