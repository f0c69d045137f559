"""NumPy generators for the NumPy references, seeded from fresh jax.random keys."""

import jax
import numpy as np


def rng_from(seed: int) -> np.random.Generator:
    """A NumPy generator seeded from a fresh jax.random key."""
    data = np.asarray(jax.random.key_data(jax.random.key(seed)), dtype=np.uint32)
    return np.random.default_rng(data)


def keys_with_near_duplicates(rng: np.random.Generator, shape, p: float, noise: float):
    """Random keys [..., S, H] where each key j > 0 is, with probability p, a rescaled noisy copy
    of an earlier key of the same head (so R-KV's similarity search finds near-duplicates)."""
    k = rng.normal(size=shape)
    lead, S = shape[:-2], shape[-2]
    for j in range(1, S):
        for idx in np.ndindex(*lead):
            if rng.random() < p:
                i = rng.integers(0, j)
                k[idx + (j,)] = k[idx + (i,)] * rng.uniform(0.5, 2.0) + noise * rng.normal(size=shape[-1])
    return k
