"""Full-sequence attention on a mesh, run as a script by tests/test_attention.py with 8 fake CPU
devices (XLA_FLAGS=--xla_force_host_platform_device_count=8), data 2 x fsdp 2 x tensor 2. Prints
ATTENTION_MESH_WORKER_OK when every check passed.

splash (sparserl_jax/model/attention.py splash_on_mesh), lowered for a TPU: the Mosaic call takes
each device's rows (B / 4) and heads (N / 2 query, K / 2 KV), in the attention alone and inside
transformer.forward(mesh=...); without the mesh the call refuses to be partitioned. blockwise,
compiled for these CPU devices: per-device shapes, no all-gather, and one device's numbers.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparserl_jax.model import attention as attn
from sparserl_jax.model import sharding as shd
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig

B, T, N, K, H = 8, 300, 4, 2, 128


def mosaic_operands(text: str) -> list[str]:
    """The operand types of every Mosaic custom call in a lowered module's text."""
    calls = [line for line in text.splitlines() if "tpu_custom_call" in line]
    assert calls, "no Mosaic call"
    return [re.findall(r"\(([^()]*)\) -> ", line)[-1] for line in calls]


def mosaic_calls(text: str) -> int:
    """How many times the module's main function runs a Mosaic kernel: the custom calls in its body
    and, through every `call @f`, in the functions it calls (StableHLO outlines a jitted function
    called twice, e.g. one kernel per layer, as one private function)."""
    bodies = {}
    for part in re.split(r"\n\s*func\.func ", text)[1:]:
        name = re.match(r"(?:public |private )?@([\w.$-]+)", part).group(1)
        bodies[name] = part

    @functools.cache
    def runs(name: str) -> int:
        body = bodies[name]
        return body.count("@tpu_custom_call(") + sum(
            runs(f) for f in re.findall(r"(?<!custom_)call @([\w.$-]+)\(", body)
        )

    return runs("main")


def check_splash(mesh) -> None:
    heads = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor"))
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16, sharding=heads)
    kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16, sharding=heads)
    for m in (mesh, None):
        loss = lambda q, k, v, m=m: attn.causal_attention(q, k, v, implementation="splash", mesh=m).sum()
        traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv)
        if m is None:
            try:
                traced.lower(lowering_platforms=("tpu",))
            except NotImplementedError as e:
                assert "cannot be automatically partitioned" in str(e), e
                continue
            raise AssertionError("splash on sharded inputs without the mesh lowered")
        operands = mosaic_operands(traced.lower(lowering_platforms=("tpu",)).as_text())
        assert len(operands) == 3, operands  # forward, the backward's dK/dV and dQ kernels
        for types in operands:  # T padded to 384 (3 x 128); per device: B / 4 rows, N / 2 and K / 2 heads
            assert "tensor<2x2x384x128xbf16>" in types and "tensor<2x1x384x128xbf16>" in types, types
            rows = {int(d) for d in re.findall(r"tensor<(\d+)x\d+x\d+x\d+xbf16>", types)}
            assert rows == {B // 4}, types  # every q, k, v, o and dO block: 2 rows
    print("splash: per-device operands", operands[0][:160])


def check_splash_in_forward(mesh) -> None:
    cfg = ModelConfig.tiny("qwen2", d_model=256, n_heads=N, n_kv_heads=K, head_dim=H, dtype="bfloat16")
    cfg = ModelConfig(**{**cfg.__dict__, "attention": "splash"})
    shapes = jax.eval_shape(lambda: tf.init_params(cfg, jax.random.key(0)))
    shardings = shd.param_shardings(shapes, mesh)
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
    tokens = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=shd.data_sharding(mesh))
    loss = lambda p, t: tf.forward(p, cfg, t, mesh=mesh, remat=True).astype(jnp.float32).sum()
    text = jax.jit(jax.grad(loss)).trace(params, tokens).lower(lowering_platforms=("tpu",)).as_text()
    calls = mosaic_calls(text)
    assert calls == 4 * cfg.n_layers, calls  # per layer: the forward, its remat, the backward's dK/dV and dQ
    assert all("tensor<2x2x384x128xbf16>" in types for types in mosaic_operands(text))
    print("splash in forward(mesh=...):", calls, "Mosaic calls, on per-device operands")


def check_blockwise(mesh) -> None:
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, T, N, 16))
    k, v = (jax.random.normal(key, (B, T, K, 16)) for key in ks[1:])
    heads = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor"))
    loss = lambda q, k, v: jnp.sum(attn.blockwise_attention(q, k, v, 64, materialised_up_to=0) ** 2)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    placed = [jax.device_put(x, heads) for x in (q, k, v)]
    text = grad.lower(*placed).compile().as_text()
    assert "all-gather" not in text and "all-to-all" not in text, "blockwise gathers"
    entry = text[text.index("ENTRY") :].split("\n", 1)[0]
    assert "f32[2,300,2,16]" in entry and "f32[2,300,1,16]" in entry, entry  # B / 4, N / 2, K / 2
    got = grad(*placed)
    want = grad(q, k, v)
    for g, w in zip(got, want):
        # per device the same program on fewer rows: float32 noise of its 300-term sums at most
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5 * float(jnp.abs(w).max()))
    print("blockwise: per-device shapes, no all-gather, equal to one device")


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    mesh = shd.make_mesh(shd.MeshConfig(data=2, fsdp=2, tensor=2))
    check_splash(mesh)
    check_splash_in_forward(mesh)
    check_blockwise(mesh)
    print("ATTENTION_MESH_WORKER_OK")
