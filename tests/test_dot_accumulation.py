"""model.dot_accumulation (quant.core.float32_accumulated): a bfloat16 projection asked for a
float32 result and rounded after gives the plain bfloat16 product's value and gradients (both
round one float32 accumulation of exact bfloat16 products to bfloat16; only the summation order
may differ), reaches XLA with bfloat16 operands in its forward and both gradients, and leaves
float32 compute's program as it was."""

from __future__ import annotations

import functools

import float_tol
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparserl_jax.model import precision, transformer
from sparserl_jax.model.config import DOT_ACCUMULATIONS, ModelConfig
from sparserl_jax.quant import core

# the model's projection specs (model/transformer.py, model/layers.py) at small shapes
SPECS = {
    "btd,df->btf": ((2, 5, 24), (24, 40)),
    "btd,dnh->btnh": ((2, 5, 24), (24, 3, 8)),
    "btf,fd->btd": ((2, 5, 40), (40, 24)),
}


def _inputs(spec: str, seed: int):
    xs, ws = SPECS[spec]
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, xs, jnp.float32).astype(jnp.bfloat16)
    w = (0.2 * jax.random.normal(kw, ws, jnp.float32)).astype(jnp.bfloat16)
    return x, w, kg


def _terms(spec: str, a, b) -> int:
    """How many products each output element of einsum(spec, a, b) sums (the contracted sizes)."""
    (sa, sb), out = spec.split("->")[0].split(","), spec.split("->")[1]
    sizes = dict(zip(sa, a.shape)) | dict(zip(sb, b.shape))
    return int(np.prod([sizes[c] for c in set(sa) & set(sb) - set(out)]))


def _exact(spec, x, w):
    """The product in float64 from the bfloat16 values (what both paths round)."""
    return np.einsum(spec, np.asarray(x, np.float64), np.asarray(w, np.float64))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("seed", [0, 1])
def test_float32_accumulated_matches_the_plain_product_and_its_gradients(spec, seed):
    x, w, kg = _inputs(spec, seed)
    out = jax.jit(core.float32_accumulated, static_argnums=0)(spec, x, w)
    plain = jax.jit(functools.partial(jnp.einsum, spec))(x, w)
    assert out.dtype == plain.dtype == jnp.bfloat16 and out.shape == plain.shape
    # each is the float32 sum (K terms) rounded once to bfloat16: within one bfloat16 rounding
    # (U16 relative) plus the float32 sums' order of the exact value, so within 2 U16 + 2 K EPS32
    # of each other relative to sum |x w|
    K = _terms(spec, x, w)
    mag = np.einsum(spec, np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(w, np.float64)))
    exact = _exact(spec, x, w)
    tol = (float_tol.U16 + K * float_tol.EPS32) * mag
    np.testing.assert_array_less(np.abs(np.asarray(out, np.float64) - exact), tol + 1e-30)
    np.testing.assert_array_less(np.abs(np.asarray(out, np.float64) - np.asarray(plain, np.float64)), 2 * tol + 1e-30)

    g = jax.random.normal(kg, out.shape, jnp.float32).astype(jnp.bfloat16)

    def vjp(f):
        return jax.jit(lambda x, w, g: jax.vjp(f, x, w)[1](g))(x, w, g)

    dx, dw = vjp(functools.partial(core.float32_accumulated, spec))
    px, pw = vjp(functools.partial(jnp.einsum, spec))
    xs, ws, o = core._split_spec(spec)
    for got, ref, a, b, gspec in (
        (dx, px, g, w, f"{o},{ws}->{xs}"),
        (dw, pw, x, g, f"{xs},{o}->{ws}"),
    ):
        assert got.dtype == ref.dtype == jnp.bfloat16 and got.shape == ref.shape
        gtol = (float_tol.U16 + _terms(gspec, a, b) * float_tol.EPS32) * np.einsum(
            gspec, np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
        )
        exact = np.einsum(gspec, np.asarray(a, np.float64), np.asarray(b, np.float64))
        np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - exact), gtol + 1e-30)
        np.testing.assert_array_less(
            np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64)), 2 * gtol + 1e-30
        )


@pytest.mark.parametrize(
    "spec, shapes",
    [
        ("btnh,dnh->btd", ((2, 5, 3, 8), (24, 3, 8))),  # a q projection's input gradient: (n, h) summed
        ("btd,btnh->dnh", ((2, 5, 24), (2, 5, 3, 8))),  # its weight gradient: (b, t) summed
        ("tpd,tpv->vd", ((4, 2, 24), (4, 2, 40))),  # the head's split weight gradient: operands swapped
    ],
)
def test_projection_product_is_the_float32_einsum(spec, shapes):
    """projection_product sums the same exact products as einsum, in float32: within a float32
    summation order (K EPS32 of sum |a b|, K the summed terms) of the float64 product."""
    ka, kb = jax.random.split(jax.random.key(3))
    a = jax.random.normal(ka, shapes[0], jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(kb, shapes[1], jnp.float32).astype(jnp.bfloat16)
    got = jax.jit(core.projection_product, static_argnums=0)(spec, a, b)
    a64, b64 = (np.asarray(x, np.float64) for x in (a, b))
    exact = np.einsum(spec, a64, b64)
    assert got.dtype == jnp.float32 and got.shape == exact.shape
    tol = _terms(spec, a, b) * float_tol.EPS32 * np.einsum(spec, np.abs(a64), np.abs(b64))
    np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - exact), tol + 1e-30)


def test_projection_product_names_a_product_it_does_not_take():
    a, b = jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5))
    with pytest.raises(ValueError, match="no batch axis"):
        core.projection_product("bij,bjk->bik", a, b)
    with pytest.raises(ValueError, match="one operand's free axes"):
        core.projection_product("btd,dv->bvt", a, b[0])


def _transposes(f, *args) -> int:
    """Transposes in the compiled program (XLA:CPU here): the layout copies XLA inserted."""
    return jax.jit(f).lower(*args).compile().as_text().count(" transpose(")


def test_a_head_split_projections_backward_copies_no_more_than_a_plain_ones():
    """A q / k / v projection ("btd,dnh->btnh": heads split from the output) differentiated under
    float32 accumulation compiles to the layout copies of the 2-D projection of the same sizes
    (the input's transpose for the weight gradient): with the input gradient summed over (h, n),
    as jnp.einsum ordered it, XLA:CPU also copied the kernel and the cotangent on every call (3
    against 1)."""

    def grads(spec, w):
        x = jnp.zeros((4, 16, 48), jnp.bfloat16)

        def loss(x, w):
            return jnp.sum(core.float32_accumulated(spec, x, w).astype(jnp.float32) ** 2)

        return _transposes(jax.grad(loss, (0, 1)), x, w)

    split = grads("btd,dnh->btnh", jnp.zeros((48, 6, 8), jnp.bfloat16))
    plain = grads("btd,df->btf", jnp.zeros((48, 48), jnp.bfloat16))
    assert split == plain, (split, plain)


def _lowered(f, *args) -> str:
    return jax.jit(f).lower(*args).as_text()


def _dot_types(text: str) -> list[str]:
    """The (operand, operand) -> result element types of every stablehlo.dot_general."""
    out = []
    for line in text.splitlines():
        if "stablehlo.dot_general" in line:
            sig = line.rsplit(":", 1)[-1]
            out.append(
                " ".join(t.rsplit("x", 1)[-1].rstrip(">,) ") for t in sig.replace("->", ",").split("tensor<")[1:])
            )
    return out


def test_the_float32_path_gives_xla_bfloat16_operands_forward_and_backward():
    """What XLA receives, on any CPU: the forward and both gradients as bfloat16 x bfloat16 ->
    float32 products; the plain path's as bfloat16 -> bfloat16 (XLA:CPU widens those)."""
    spec = "btd,df->btf"
    x, w, _ = _inputs(spec, 0)

    def loss(f, x, w):
        return jnp.sum(f(spec, x, w).astype(jnp.float32) ** 2)

    acc = _dot_types(_lowered(jax.grad(functools.partial(loss, core.float32_accumulated), (0, 1)), x, w))
    plain = _dot_types(_lowered(jax.grad(functools.partial(loss, jnp.einsum), (0, 1)), x, w))
    assert acc == ["bf16 bf16 f32"] * 3, acc
    assert plain == ["bf16 bf16 bf16"] * 3, plain


def _model(dtype: str, acc: str) -> ModelConfig:
    return ModelConfig.tiny("llama", dtype=dtype, param_dtype="float32", dot_accumulation=acc)


def test_the_model_under_each_setting():
    """bfloat16 compute: float32 accumulation's logits and gradients beside the plain products'
    (both the same roundings, float_tol's bfloat16 budget); float32 compute: one program (the
    setting changes nothing), bit for bit."""
    params = transformer.init_params(_model("float32", "output"), jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 256)

    def loss(cfg, params):
        logits = transformer.logits(params, cfg, tokens)
        return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0]), logits

    def run(dtype, acc):
        cfg = _model(dtype, acc)
        (value, logits), grads = jax.jit(jax.value_and_grad(functools.partial(loss, cfg), has_aux=True))(params)
        return value, logits, grads

    v32a, l32a, g32a = run("float32", "output")
    v32b, l32b, g32b = run("float32", "float32")
    assert float(v32a) == float(v32b) and np.array_equal(np.asarray(l32a), np.asarray(l32b))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(g32a), jax.tree.leaves(g32b)))

    vo, lo, go = run("bfloat16", "output")
    vf, lf, gf = run("bfloat16", "float32")
    cfg = _model("bfloat16", "float32")
    # logits: each path within the bfloat16 budget of the float32 model, so within twice of each other
    tol = float_tol.bf16_logprob_tol(cfg, params)
    assert np.max(np.abs(np.asarray(lo, np.float64) - np.asarray(l32a, np.float64))) <= tol
    assert np.max(np.abs(np.asarray(lf, np.float64) - np.asarray(l32a, np.float64))) <= tol
    assert abs(float(vo) - float(vf)) <= 2 * tol
    # gradients: the same direction (cosine) and scale as the float32 model's, leaf by leaf
    for name, a, b, ref in zip(
        [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(g32a)],
        jax.tree.leaves(go),
        jax.tree.leaves(gf),
        jax.tree.leaves(g32a),
    ):
        r = np.asarray(ref, np.float64).ravel()
        if np.linalg.norm(r) == 0:
            continue
        for g in (a, b):
            g = np.asarray(g, np.float64).ravel()
            cos = g @ r / (np.linalg.norm(g) * np.linalg.norm(r))
            assert cos > 0.99 and 0.9 < np.linalg.norm(g) / np.linalg.norm(r) < 1.1, (name, cos)


def test_auto_resolves_by_backend_and_a_bad_setting_names_itself():
    assert DOT_ACCUMULATIONS == ("auto", *core.ACCUMULATIONS)
    expected = "float32" if jax.default_backend() == "cpu" else "output"
    assert precision.accumulation(_model("bfloat16", "auto")) == expected
    assert precision.accumulation(_model("bfloat16", "output")) == "output"
    # a program lowered here for another platform resolves auto for it first
    assert [precision.auto_accumulation(p) for p in ("cpu", "gpu", "cuda", "tpu")] == ["float32", *["output"] * 3]
    assert precision.for_platform(_model("bfloat16", "auto"), "tpu").dot_accumulation == "output"
    assert precision.for_platform(_model("bfloat16", "auto"), "cpu").dot_accumulation == "float32"
    assert precision.for_platform(_model("bfloat16", "float32"), "gpu").dot_accumulation == "float32"
    with pytest.raises(ValueError, match="model.dot_accumulation='fp32'"):
        _model("bfloat16", "fp32")
    x, w, _ = _inputs("btd,df->btf", 0)
    with pytest.raises(ValueError, match="needs a projection"):
        core.dot("...d,df->...f", x, w, accumulate="float32")
    with pytest.raises(ValueError, match="model.dot_accumulation='fp32'"):
        core.dot("btd,df->btf", x, w, accumulate="fp32")
