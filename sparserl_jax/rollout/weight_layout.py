"""rollout.weight_layout: how the sampler's kernels are stored in memory.

model         as the model keeps them (q [D, N, H], gate [D, F], ...: contracting axes first),
              the default: the sampler reads the compute copy itself.
output_major  each full-precision projection kernel (and an untied lm_head) copied with its
              contracting axes last (quant.core.OutputMajor) once per iteration, where the
              rollout source receives the weights; dot() contracts it in place. The same
              products in the same dtype: on XLA:CPU a decode step's bfloat16 projections of
              16 rows run 0.69x the time in this layout (SmolLM2's 210 projections of a step on
              a Xeon model 207 core; float32 0.97x); a second copy of the kernels beside the
              compute copy while the rollout runs. Quantized kernels (QuRL) keep their layout.
"""

from __future__ import annotations

import functools

import jax

from sparserl_jax.quant.config import HEAD, PROJECTIONS
from sparserl_jax.quant.core import OutputMajor, QWeight

WEIGHT_LAYOUTS = ("model", "output_major")


def _output_major(params: dict) -> dict:
    def kernel(name, w):
        if (name not in PROJECTIONS and name != HEAD) or isinstance(w, QWeight):  # QWeights stay
            return w
        n_out = PROJECTIONS.get(name, 1)
        return OutputMajor.of(w, w.ndim - n_out)

    out = {k: kernel(k, v) for k, v in params.items() if k != "layers"}
    out["layers"] = [{k: kernel(k, v) for k, v in layer.items()} for layer in params["layers"]]
    return out


@functools.lru_cache(maxsize=1)
def _compiled():
    return jax.jit(_output_major)


def sampler_weights(params: dict, layout: str) -> dict:
    """`params` (the compute copy, placed on the rollout layout, perhaps quantized) as the sampler
    reads them under rollout.weight_layout=`layout`: themselves for "model", else the projection
    kernels output-major, copied by one jitted program (shardings follow the kernels')."""
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"rollout.weight_layout={layout!r}: accepted values are {WEIGHT_LAYOUTS}")
    if layout == "model":
        return params
    return _compiled()(params)
