"""QuRL's quantized rollouts: a quantized copy of theta_old as the behaviour policy.

  qparams = quantize_params(params, QuantConfig(format="int8"))   # jitted, sharding-preserving
  prefill / decode_step / token_logprobs / the sampler take qparams unchanged

Every projection of the model goes through `dot` (core.py), which runs a plain einsum for a
full-precision kernel and the quantized product for a QWeight: W8A8 quantizes the activation per
token and runs an int8 dot with int32 accumulation (`preferred_element_type`) or a float8 dot
with float32 accumulation, then rescales; W8A16 is weight-only; impl="fake" (quantize ->
dequantize, float32 dot) is the numerical reference of the native path.

Why our own module and not google's qwix (0.1.8, evaluated): qwix.quantize / qwix.einsum do give a
native int8 dot with int32 accumulation on pure functions, but importing qwix imports flax.nnx and
needs flax >= 0.12 (we support 0.11), its QArray dequantizes by broadcasting and transposes the
dot's output, and what we need is four small functions (absmax scale with a safe zero channel,
fp8 clipping, the rescaled dot, the sharded tree swap) whose sharding and errors we control. qwix
serves as the independent oracle in tests/test_quant.py.
"""

from sparserl_jax.quant.config import FORMATS, IMPLS, QUANT_MODES, QuantConfig
from sparserl_jax.quant.core import QWeight, dot, merge_leading_axes, quantize
from sparserl_jax.quant.params import abstract_quantized, invariant_scale, quantize_params, quantized_bytes

__all__ = [
    "FORMATS",
    "IMPLS",
    "QUANT_MODES",
    "QWeight",
    "QuantConfig",
    "abstract_quantized",
    "dot",
    "invariant_scale",
    "quantize",
    "quantize_params",
    "quantized_bytes",
]
