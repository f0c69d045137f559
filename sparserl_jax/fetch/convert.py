"""A GGUF checkpoint -> the Hugging Face layout that `sparserl_jax.model.hf` loads.

transformers reads the GGUF (`from_pretrained(dir, gguf_file=...)`): it dequantizes every tensor
(Q4_1, Q8_0, ...) to float32 and undoes llama.cpp's interleaving of the q/k projection rows, and
it rebuilds the tokenizer (tokenizer.json, special tokens, chat template) from the GGUF metadata.
We write its tensors as model.safetensors (float32, or bfloat16 rounded from the float32), and
config.json / generation_config.json through our own ModelConfig (so the result is exactly what
the loader accepts), then check the written checkpoint with the loader: its logits on a short
prompt must match transformers' on the GGUF.

torch, transformers, gguf and accelerate are optional (requirements-real.txt), imported here
only when a conversion runs.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from sparserl_jax.fetch.models import FetchError
from sparserl_jax.model import hf
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.hf_config import config_from_hf, config_to_hf, generation_config_to_hf

OPTIONAL_PACKAGES: tuple[str, ...] = ("torch", "transformers", "gguf", "accelerate")
CHECK_TEXT = "The capital of France is"
CHECK_RTOL = 1e-3  # max |logits ours - transformers'| / max |logits transformers'|


def require_optional_packages() -> None:
    """A FetchError naming the missing ones (checked before any download)."""
    missing = []
    for name in OPTIONAL_PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise FetchError(
            f"converting a GGUF checkpoint needs the optional packages {', '.join(missing)}, "
            "which are not installed: pip install -r requirements-real.txt"
        )


def check_gguf(path: Path):
    """The gguf.GGUFReader of `path`; a FetchError unless it is a complete, readable GGUF file."""
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/... on damaged files
        raise FetchError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); "
            "it is damaged or truncated: delete it and fetch it again"
        ) from None


def _tokenizer_config(tok, max_len: int) -> dict:
    """tokenizer_config.json: special tokens and the chat template inline (read by our
    HFTokenizer and by transformers 4.x and 5.x alike)."""
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = getattr(tok, name, None)
        if value is not None:
            cfg[name] = str(value)
    if tok.chat_template is not None:
        cfg["chat_template"] = tok.chat_template
    return cfg


def convert_gguf(gguf_path: Path, out: Path, dtype: str = "float32") -> dict:
    """Write the HF checkpoint of `gguf_path` into the (new) directory `out`; returns facts about
    the conversion (tensor types in the GGUF, the logits check)."""
    import torch
    import transformers

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype={dtype!r}: expected 'float32' or 'bfloat16'")
    reader = check_gguf(gguf_path)
    src = dict(pretrained_model_name_or_path=gguf_path.parent, gguf_file=gguf_path.name)
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    try:
        tok = transformers.AutoTokenizer.from_pretrained(**src)
        model = transformers.AutoModelForCausalLM.from_pretrained(**src, **{dtype_kw: torch.float32})
    except Exception as e:
        raise FetchError(
            f"transformers {transformers.__version__} could not read {gguf_path} ({type(e).__name__}: {e})"
        ) from None
    model.eval()
    hf_cfg = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    cfg = config_from_hf(hf_cfg, model.generation_config.to_dict(), dtype)

    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)  # the embedding, shared; transformers re-ties it
    expected = {spec.name for spec in hf.hf_tensors(cfg)}
    if set(state) != expected:
        raise FetchError(
            f"{gguf_path}: transformers gave tensors {sorted(set(state) - expected)[:4]} "
            f"and lacks {sorted(expected - set(state))[:4]} for a {cfg.family} model"
        )
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    out.mkdir(parents=True)
    save_file(
        {k: np.ascontiguousarray(v.astype(np_dtype)) for k, v in state.items()},
        out / "model.safetensors",
        metadata={"format": "pt"},
    )
    (out / "config.json").write_text(json.dumps(config_to_hf(cfg, dtype), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config_to_hf(cfg), indent=2) + "\n")
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(tok, cfg.max_seq_len), indent=2, ensure_ascii=False) + "\n"
    )

    ids = tok(CHECK_TEXT, add_special_tokens=False).input_ids
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits.numpy()
    rel = _logits_error(out, np.asarray(ids), ref)
    tol = CHECK_RTOL if dtype == "float32" else 5e-2
    if not rel <= tol:
        raise FetchError(
            f"the converted checkpoint in {out} disagrees with transformers on the "
            f"GGUF (logits relative error {rel:.2e} > {tol:g}); report this"
        )
    types = sorted({t.tensor_type.name for t in reader.tensors})
    return {"gguf_tensor_types": types, "logits_rel_err": rel}


def _logits_error(out: Path, ids: np.ndarray, ref: np.ndarray) -> float:
    """max |logits of the written checkpoint (our loader and forward) - ref| / max |ref|."""
    cfg, params = hf.load_params(out, dtype="float32")
    ours = np.asarray(tf.logits(params, cfg, jnp.asarray(ids)[None]), np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())
