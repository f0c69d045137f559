"""Settings of the quantized rollout (QuRL): format, mode, implementation, what stays in full
precision, and the invariant scaling applied once before training."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from sparserl_jax.validate import check_bool, check_in, check_positive

FORMATS = ("none", "int8", "fp8")  # quant.format
QUANT_MODES = ("w8a8", "w8a16")  # quant.mode: which operands are 8-bit (weights, activations)
IMPLS = ("native", "fake")  # quant.impl
# Kernels quantize_params can swap (their trailing axes are the output channels: q/k/v [D, N|K, H]
# keep 2, o [N, H, D] and the MLP and head kernels keep 1), and the full-precision leaves it knows.
PROJECTIONS = {"q": 2, "k": 2, "v": 2, "o": 1, "gate": 1, "up": 1, "down": 1}
HEAD = "lm_head"
KEEP_FULL = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "q_bias", "k_bias", "v_bias")
SKIPPABLE = ("embed", HEAD, *PROJECTIONS)


def fp8_dtype(setting: str = "quant.format"):
    """jnp.float8_e4m3fn, or a clear error on a jax without float8 support."""
    dtype = getattr(jnp, "float8_e4m3fn", None)
    if dtype is None:
        raise ValueError(f"{setting}='fp8' needs a jax with float8_e4m3fn support (this one has none); use 'int8'")
    return dtype


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """`format` none | int8 | fp8 (e4m3); `mode` w8a8 (weights per output channel and activations
    per token, an integer / float8 dot) or w8a16 (weight-only: the dot runs in the activation
    dtype); `impl` native (the low-precision dot) or fake (quantize -> dequantize, float32 dot:
    the numerical reference); `skip` names the weights left in full precision (the embedding is a
    gather and always stays). `invariant_scaling` multiplies the RMSNorm scales feeding q/k/v by
    `invariant_s` and divides the q/k/v kernels by it, once before training (QuRL's update-aware
    quantization)."""

    format: str = "none"
    mode: str = "w8a8"
    impl: str = "native"
    skip: tuple[str, ...] = ("embed", HEAD)
    invariant_scaling: bool = False
    invariant_s: float = 1.5

    def __post_init__(self):
        check_in("quant.format", self.format, FORMATS)
        check_in("quant.mode", self.mode, QUANT_MODES)
        check_in("quant.impl", self.impl, IMPLS)
        if isinstance(self.skip, str):
            raise ValueError(f"quant.skip={self.skip!r} must be a list of weight names; accepted: {SKIPPABLE}")
        object.__setattr__(self, "skip", tuple(self.skip))
        unknown = [s for s in self.skip if s not in SKIPPABLE]
        if unknown:
            raise ValueError(f"quant.skip={self.skip}: unknown weight(s) {unknown}; accepted: {SKIPPABLE}")
        if "embed" not in self.skip:
            raise ValueError(
                "quant.skip must contain 'embed': the embedding is a gather, not a matmul, and stays in full precision"
            )
        check_bool("quant.invariant_scaling", self.invariant_scaling)
        check_positive("quant.invariant_s", self.invariant_s)
        if self.format == "fp8":
            fp8_dtype()

    @property
    def enabled(self) -> bool:
        return self.format != "none"
