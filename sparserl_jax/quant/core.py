"""The quantized weight type and the one matmul every projection of the model goes through.

Symmetric absmax quantization: weights per output channel (the scale reduces over the contracting
axes only), activations per token (over the contracting axes of the activation). int8 rounds to
[-127, 127]; fp8 (e4m3) clips to +-448 before the cast, since an overflowing float8 cast gives NaN,
not saturation. A channel (or token) of zeros gets scale 1 instead of 0/0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float

from sparserl_jax.quant.config import fp8_dtype

QMAX = {"int8": 127.0, "fp8": 448.0}


def storage_dtype(fmt: str):
    return jnp.int8 if fmt == "int8" else fp8_dtype()


def quantize(x: Array, fmt: str, axes: tuple[int, ...]) -> tuple[Array, Float[Array, ...]]:
    """(values, scale) with x ~ values * scale; `scale` is float32, reduced over `axes` (kept as
    size-1 axes)."""
    x32 = x.astype(jnp.float32)
    qmax = QMAX[fmt]
    scale = jnp.max(jnp.abs(x32), axis=axes, keepdims=True) / qmax
    scale = jnp.where(scale >= jnp.finfo(jnp.float32).tiny, scale, 1.0)  # zero channels
    y = x32 / scale
    if fmt == "int8":
        y = jnp.round(y)
    return jnp.clip(y, -qmax, qmax).astype(storage_dtype(fmt)), scale


@struct.dataclass
class QWeight:
    """A quantized kernel: `values` (int8 or float8_e4m3fn, the kernel's shape) and float32
    `scale` (the kernel's shape with the contracting axes of size 1). `act` is the activation
    format of the dot (None: weight-only W8A16); `impl` "native" or "fake"."""

    values: Array
    scale: Float[Array, ...]
    fmt: str = struct.field(pytree_node=False, default="int8")
    act: str | None = struct.field(pytree_node=False, default="int8")
    impl: str = struct.field(pytree_node=False, default="native")

    @property
    def shape(self):
        return self.values.shape

    def dequantize(self) -> Float[Array, ...]:
        return self.values.astype(jnp.float32) * self.scale

    @property
    def nbytes(self) -> int:
        return self.values.size * self.values.dtype.itemsize + self.scale.size * 4


def merge_leading_axes(w, n: int):
    """The kernel with its first n axes merged into one (a free reshape), for a plain array or a
    QWeight whose first n axes are contracting (their scale axes have size 1)."""
    if not isinstance(w, QWeight):
        return w.reshape((-1,) + w.shape[n:])
    return w.replace(values=w.values.reshape((-1,) + w.shape[n:]), scale=w.scale.reshape((1,) + w.scale.shape[n:]))


def _tokens(subscripts: str) -> list[str]:
    head, ell, tail = subscripts.partition("...")
    return list(head) + (["..."] if ell else []) + list(tail)


def _axes(tokens: list[str], letters: set[str]) -> tuple[int, ...]:
    """Positions of `letters` in an operand's tokens (counted from the end after an ellipsis)."""
    n = len(tokens)
    ell = tokens.index("...") if "..." in tokens else n
    return tuple(i - n if i > ell else i for i, t in enumerate(tokens) if t in letters)


# How a full-precision projection in a narrow dtype (bfloat16) accumulates (model.dot_accumulation):
#   output   the dot returns the operands' dtype; the backend accumulates as it chooses (XLA:GPU and
#            XLA:TPU in float32 inside the kernel; XLA:CPU widens the operands to float32 first)
#   float32  the dot returns float32 (preferred_element_type), rounded to the operands' dtype after,
#            its gradients likewise: the same rounding, once per product, and XLA:CPU runs the
#            bfloat16 operands through its bfloat16 kernels (AVX512-BF16 / AMX) instead of widening
ACCUMULATIONS = ("output", "float32")


def _split_spec(spec: str) -> tuple[str, str, str]:
    inputs, out = spec.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    return xs, ws, out


def projection_product(spec: str, a: Array, b: Array) -> Array:
    """einsum(spec, a, b) of a projection or one of its gradients (no batch axis, no axis summed
    alone) as one float32-accumulated dot_general whose summed axes keep a's order in both
    operands. jnp.einsum orders several summed axes its own way: a q / k / v projection's input
    gradient ("btnh,dnh->btd") summed (h, n), so XLA:CPU copied the cotangent and the kernel into
    that order on every call. The output must read as one operand's free axes, then the other's
    (the operands go in that order: the head's weight gradient "td,tv->vd" takes g first)."""
    xs, ws, out = _split_spec(spec)
    summed = [c for c in xs if c in ws]
    if any(c in out for c in summed) or set(xs + ws) - set(out) - set(summed):
        raise ValueError(f"projection_product({spec!r}): a projection's product (no batch axis, no axis summed alone)")
    orders = [o for o in ((a, b, xs, ws), (b, a, ws, xs)) if [c for c in o[2] + o[3] if c not in summed] == list(out)]
    if not orders:
        raise ValueError(f"projection_product({spec!r}): the output must be one operand's free axes, then the other's")
    lhs, rhs, ls, rs = orders[0]
    run = "".join(summed)
    if len(summed) > 1 and ls.endswith(run) and rs.endswith(run):
        # one summed axis (a free reshape): over several, XLA:CPU copied the kernel to
        # [summed..., free] on every call. Not where they lead both operands (a weight gradient):
        # over one such axis XLA:CPU widens a bfloat16 product (_weight_gradient)
        lhs, ls = _merged(lhs, ls, summed), ls.replace(run, summed[0])
        rhs, rs = _merged(rhs, rs, summed), rs.replace(run, summed[0])
        summed = summed[:1]
    dims = (([ls.index(c) for c in summed], [rs.index(c) for c in summed]), ((), ()))
    return jax.lax.dot_general(lhs, rhs, dims, preferred_element_type=jnp.float32)


def _merged(a: Array, letters: str, run: list[str]) -> Array:
    """a with the axes `run` (consecutive in `letters`) merged into one."""
    i = letters.index("".join(run))
    return a.reshape(*a.shape[:i], -1, *a.shape[i + len(run) :])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def float32_accumulated(spec: str, x: Array, w: Array) -> Array:
    """einsum(spec, x, w) in x's dtype from a float32 result (ACCUMULATIONS' float32), both
    gradients the same way from the output's cotangent in x's dtype (what the plain product's
    gradients get). `spec` must be a projection's: every axis of x and of w in the output or in
    the other operand, no ellipsis."""
    return projection_product(spec, x, w).astype(x.dtype)


def _float32_accumulated_fwd(spec, x, w):
    return float32_accumulated(spec, x, w), (x, w)


def _float32_accumulated_bwd(spec, residuals, g):
    x, w = residuals
    xs, ws, out = _split_spec(spec)
    g = g.astype(x.dtype)
    dx = projection_product(f"{out},{ws}->{xs}", g, w).astype(x.dtype)
    return dx, _weight_gradient(xs, ws, out, x, g).astype(w.dtype)


def _weight_gradient(xs: str, ws: str, out: str, x: Array, g: Array) -> Array:
    """einsum(xs,out->ws) of x and the cotangent g, float32, its lone summed axis split in two when
    it leads both operands (an LM head's chunk: [tokens, D] and [tokens, V]). XLA:CPU widens such a
    bfloat16 product to float32 (one contracting axis, first in both: no canonical operand), where
    over two contracting axes it transposes one operand to its canonical layout and runs the
    bfloat16 kernel ([512, 576] x [512, 49,152]: 2x faster). The same sum; a free reshape elsewhere.
    Split as [n / 2, 2] (pairs of adjacent rows): a device's contiguous share of rows stays its own,
    where [2, n / 2] cost a row-sharded program a second all-reduce."""
    summed = [a for a in xs if a in out and a not in ws]
    n = x.shape[0]
    if len(summed) == 1 and xs[0] == out[0] == summed[0] and n > 1 and n % 2 == 0:
        pair = next(c for c in "abcdefghijklmnopqrstuvwxyz" if c not in xs + ws + out)
        x, g = (a.reshape(n // 2, 2, *a.shape[1:]) for a in (x, g))
        xs, out = xs[0] + pair + xs[1:], out[0] + pair + out[1:]
    return projection_product(f"{xs},{out}->{ws}", x, g)


float32_accumulated.defvjp(_float32_accumulated_fwd, _float32_accumulated_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def narrow_cotangent(spec: str, x: Array, w: Array) -> Array:
    """einsum(spec, x, w) as float32 (an LM head's logits), its gradients from the float32
    cotangent rounded to x's dtype first and then float32-accumulated products of x's dtype, as
    float32_accumulated's (Megatron's bfloat16 output layer: the loss in float32, the layer's
    backward in bfloat16). model.head_backward="compute"; `spec` a projection's."""
    return projection_product(spec, x, w)


def _narrow_cotangent_fwd(spec, x, w):
    return narrow_cotangent(spec, x, w), (x, w)


narrow_cotangent.defvjp(_narrow_cotangent_fwd, _float32_accumulated_bwd)


def _accumulates_in_float32(spec: str, x: Array, w, preferred_element_type, accumulate: str) -> bool:
    if accumulate not in ACCUMULATIONS:
        raise ValueError(f"model.dot_accumulation={accumulate!r}: accepted values are {ACCUMULATIONS} (or auto)")
    if accumulate == "output" or preferred_element_type is not None or isinstance(w, QWeight):
        return False
    if x.dtype != w.dtype or not jnp.issubdtype(x.dtype, jnp.floating) or jnp.finfo(x.dtype).bits >= 32:
        return False
    xs, ws, out = _split_spec(spec)
    if "." in spec or set(xs) - set(ws + out) or set(ws) - set(xs + out):
        raise ValueError(
            f"quant.dot({spec!r}): float32 accumulation needs a projection (no ellipsis, no axis summed alone)"
        )
    return True


def dot(spec: str, x: Array, w, *, preferred_element_type=None, accumulate: str = "output") -> Array:
    """einsum(spec, x, w) for a full-precision kernel (with accumulate="float32", narrow operands
    of one dtype go through float32_accumulated); for a QWeight, the quantized product rescaled by
    the activation and weight scales. The output must list x's free axes then w's (as every
    projection of the model does), so the scales broadcast without a transpose."""
    if _accumulates_in_float32(spec, x, w, preferred_element_type, accumulate):
        return float32_accumulated(spec, x, w)
    if not isinstance(w, QWeight):
        return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)
    out_dtype = preferred_element_type or x.dtype
    inputs, out = spec.replace(" ", "").split("->")
    xs, ws = (_tokens(s) for s in inputs.split(","))
    contract = (set(xs) & set(ws)) - set(_tokens(out)) - {"..."}
    x_free = [t for t in xs if t not in contract]
    w_free = [t for t in ws if t not in contract]
    if _tokens(out) != x_free + w_free:
        raise ValueError(f"quant.dot({spec!r}): the output must be x's free axes then w's")
    w_axes = _axes(ws, contract)
    w_scale = jnp.squeeze(w.scale, w_axes)  # [w free axes]
    if w.act is None:  # W8A16: the kernel upcast inside the dot, one rescale per output channel
        if w.impl == "fake":
            return jnp.einsum(spec, x.astype(jnp.float32), w.dequantize()).astype(out_dtype)
        acc = jnp.einsum(spec, x, w.values.astype(x.dtype), preferred_element_type=jnp.float32)
        return (acc * w_scale).astype(out_dtype)
    x_axes = _axes(xs, contract)
    xq, x_scale = quantize(x, w.act, x_axes)
    if w.impl == "fake":
        x_deq = xq.astype(jnp.float32) * x_scale
        return jnp.einsum(spec, x_deq, w.dequantize()).astype(out_dtype)
    acc_dtype = jnp.int32 if w.act == "int8" else jnp.float32
    acc = jnp.einsum(spec, xq, w.values, preferred_element_type=acc_dtype).astype(jnp.float32)
    x_scale = jnp.squeeze(x_scale, x_axes)  # [x free axes] (per token)
    x_scale = x_scale.reshape(x_scale.shape + (1,) * len(w_free))
    return (acc * x_scale * w_scale).astype(out_dtype)
