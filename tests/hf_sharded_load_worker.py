"""Sharded checkpoint loading measured per device, run as a script by tests/test_hf_sharded_load.py
with 8 fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8). Prints one JSON line
per mesh (the peaks it measured) and HF_SHARDED_LOAD_OK when every check passed.

The CPU client reports no memory_stats (None), so the bytes a device holds are counted from
jax.live_arrays(): every addressable block of every live array, on its device. `jax.device_put`
and `jax.make_array_from_callback` (the two calls hf.load_params places tensors with) are wrapped
to take that count after every call and inside every block read, so a device's peak is measured
at every placement; `HFTensor.read` is wrapped to count the bytes read from the files (the host
staging: each distinct block read once)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from sparserl_jax import components
from sparserl_jax.config import TrainConfig
from sparserl_jax.model import hf
from sparserl_jax.model import sharding as shd
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.tokenizer import CharTokenizer

MESHES = ((1, 8, 1), (2, 2, 2))  # (data, fsdp, tensor): the FSDP run's layout; replication + tensor


def block_bytes(shape, index, itemsize: int) -> int:
    return itemsize * math.prod(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))


def device_bytes() -> dict:
    """Bytes each device holds in live jax arrays (each array's addressable blocks)."""
    held = dict.fromkeys(jax.devices(), 0)
    for x in jax.live_arrays():
        for device, index in x.sharding.addressable_devices_indices_map(x.shape).items():
            held[device] += block_bytes(x.shape, index, x.dtype.itemsize)
    return held


class Meter:
    """Peak per-device bytes over every placement, the blocks the reader was asked for, and the
    bytes read from the files."""

    def __init__(self):
        self.peak = dict.fromkeys(jax.devices(), 0)
        self.asked: list[tuple[tuple, tuple, tuple]] = []  # (leaf shape, block shape, shard shape)
        self.read_bytes = 0

    def sample(self) -> None:
        for device, n in device_bytes().items():
            self.peak[device] = max(self.peak[device], n)

    def __enter__(self):
        real_put, real_from_callback, real_read = jax.device_put, jax.make_array_from_callback, hf.HFTensor.read

        def put(*args, **kwargs):
            out = real_put(*args, **kwargs)
            self.sample()
            return out

        def from_callback(shape, sharding, callback, *args, **kwargs):
            def block(index):
                out = callback(index)
                self.asked.append((tuple(shape), out.shape, sharding.shard_shape(tuple(shape))))
                self.sample()
                return out

            out = real_from_callback(shape, sharding, block, *args, **kwargs)
            self.sample()
            return out

        def read(spec, tensor, index=()):
            out = real_read(spec, tensor, index)
            self.read_bytes += out.nbytes
            return out

        self._restore = (real_put, real_from_callback, real_read)
        jax.device_put, jax.make_array_from_callback, hf.HFTensor.read = put, from_callback, read
        return self

    def __exit__(self, *exc):
        jax.device_put, jax.make_array_from_callback, hf.HFTensor.read = self._restore


def checkpoint(directory: Path) -> int:
    """A tiny untied Qwen2 (lm_head included) written in bfloat16 over several files, with the char
    tokenizer; returns its bytes as float32 masters."""
    cfg = dataclasses.replace(ModelConfig.tiny("qwen2"), tie_embeddings=False)
    params = tf.init_params(cfg, jax.random.key(0))
    params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(x.size), x.shape), params)
    hf.save_params(directory, cfg, params, dtype="bfloat16", max_shard_bytes=64 * 1024)
    CharTokenizer().save(directory)
    assert len(list(directory.glob("model-*.safetensors"))) > 2
    return sum(4 * x.size for x in jax.tree.leaves(params))


def check_mesh(cfg: TrainConfig, whole: list[np.ndarray], master_bytes: int, file_bytes: int) -> dict:
    """Load cfg's checkpoint the old way and through components.build_model on cfg.mesh; check the
    new way's peaks, reads, layout and values; return what was measured. (A function: its arrays
    die with it, so the next mesh's meter starts from empty devices.)"""
    directory = cfg.model.checkpoint
    mesh = shd.make_mesh(cfg.mesh)
    target = jax.tree.leaves(components.checkpoint_shardings(cfg, mesh))
    bound = dict.fromkeys(jax.devices(), 0)  # each device's blocks of the target layout
    for leaf, sharding in zip(whole, target, strict=True):
        for device, index in sharding.addressable_devices_indices_map(leaf.shape).items():
            bound[device] += block_bytes(leaf.shape, index, 4)
    assert max(bound.values()) < master_bytes / 2, (bound, master_bytes)  # the layout does split

    # Before: the whole params on one device (hf.load_params without shardings), then laid out
    # (Learner.place): what components.build_model and the trainer did. The meter must see it
    # exceed the bound.
    with Meter() as before:
        params = shd.shard_params(hf.load_params(directory, dtype="float32")[1], mesh)
    del params
    first = jax.devices()[0]
    assert before.peak[first] >= master_bytes > bound[first], (before.peak[first], bound[first])

    # After: components.build_model reads each device's block straight into the target layout.
    with Meter() as after:
        loaded = components.build_model(cfg, mesh).params
    over = {str(d): (after.peak[d], bound[d]) for d in jax.devices() if after.peak[d] > bound[d]}
    assert not over, f"devices held more than their blocks (peak, blocks): {over}"
    for leaf_shape, block_shape, shard_shape in after.asked:
        assert block_shape == shard_shape, (leaf_shape, block_shape, shard_shape)
    assert any(block != leaf for leaf, block, _ in after.asked)  # sharded tensors came in blocks
    # the host staging: each tensor's distinct blocks read once (replicas share one read)
    assert after.read_bytes == file_bytes, (after.read_bytes, file_bytes)

    for x, y, sharding in zip(jax.tree.leaves(loaded), whole, target, strict=True):
        assert x.dtype == jnp.float32 and x.sharding == sharding, (x.dtype, x.sharding, sharding)
        for shard in x.addressable_shards:  # per-device shapes: each device its block, no more
            assert shard.data.shape == sharding.shard_shape(x.shape)
            np.testing.assert_array_equal(np.asarray(shard.data), y[shard.index])
        np.testing.assert_array_equal(np.asarray(x), y)  # the values of the whole load, bit for bit
    placed = shd.shard_params(loaded, mesh)  # the trainer's Learner.place: nothing moves
    assert all(a is b for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(loaded), strict=True))
    return {
        "mesh": list(shd.make_mesh(cfg.mesh).devices.shape),
        "master_bytes": master_bytes,
        "before_peak": {str(d.id): before.peak[d] for d in jax.devices()},
        "after_peak": {str(d.id): after.peak[d] for d in jax.devices()},
        "blocks": {str(d.id): bound[d] for d in jax.devices()},
        "reads": len(after.asked),
        "read_bytes": after.read_bytes,
    }


def main(tmp: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    directory = Path(tmp) / "ckpt"
    master_bytes = checkpoint(directory)
    base = TrainConfig()
    model = dataclasses.replace(base.model, checkpoint=str(directory), param_dtype="float32", dtype="bfloat16")
    # the reference values, copied to the host (np.asarray would keep the device buffers alive)
    whole = [np.array(x, copy=True) for x in jax.tree.leaves(hf.load_params(directory, dtype="float32")[1])]
    file_bytes = sum(x.size * 2 for x in whole)  # bfloat16 in the files
    for data, fsdp, tensor in MESHES:
        cfg = dataclasses.replace(base, model=model, mesh=shd.MeshConfig(data=data, fsdp=fsdp, tensor=tensor))
        print(json.dumps(check_mesh(cfg, whole, master_bytes, file_bytes)))
    print("HF_SHARDED_LOAD_OK")


if __name__ == "__main__":
    main(sys.argv[1])
