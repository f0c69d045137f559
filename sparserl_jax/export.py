"""Export a training run's checkpoint as a Hugging Face directory: safetensors, config, tokenizer.

transformers, vLLM and lighteval load the result: model.safetensors, config.json,
generation_config.json and the tokenizer files.

  python -m sparserl_jax.export RUN_DIR [--step N] --out HF_DIR [--dtype bfloat16|float32]

RUN_DIR is a train.out_dir: its config.yaml says what the model is (model.checkpoint, an HF
directory whose tokenizer files are copied; or model.arch, saved with its task's tokenizer and
that tokenizer's special tokens), its checkpoints/ hold the params (the newest intact step unless
--step), restored as evaluate restores them. The tensors are written by model/hf.py save_params in
--dtype: by default the checkpoint's own (the master weights, model.param_dtype), exactly;
bfloat16 halves the files, each weight rounded to the nearest.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence

from sparserl_jax import cli, components
from sparserl_jax.checkpoint import restore_params
from sparserl_jax.config import TrainConfig, load_config
from sparserl_jax.model import hf
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.model.hf_config import DTYPES
from sparserl_jax.validate import check_in


def load_run(run_dir: str, step: int | None = None) -> tuple[TrainConfig, components.Components, int]:
    """(config, components with the checkpoint's params, the step restored) of a run directory."""
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"RUN_DIR {run_dir!r}: no such directory")
    config = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(config):
        raise FileNotFoundError(
            f"RUN_DIR {run_dir!r} has no config.yaml: not a training run directory (a train.out_dir)"
        )
    cfg = load_config([config])
    parts = components.build_model(cfg)
    parts.params, meta = restore_params(os.path.join(run_dir, "checkpoints"), parts.params, step=step)
    return cfg, parts, int(meta.get("iteration", step or 0))


def export_model_config(cfg: TrainConfig, parts: components.Components) -> ModelConfig:
    """The architecture as config.json states it; a model.arch run's special tokens are its
    tokenizer's (an HF checkpoint's come with its config.json)."""
    if cfg.model.checkpoint:
        return parts.model_cfg
    tok = parts.tokenizer
    return dataclasses.replace(
        parts.model_cfg,
        bos_token_id=tok.bos_token_id,
        eos_token_ids=tuple(tok.eos_token_ids),
        pad_token_id=tok.pad_token_id,
    )


def export(run_dir: str, out: str, *, step: int | None = None, dtype: str | None = None) -> int:
    """Write the HF directory `out` from `run_dir`'s checkpoint; returns the step exported."""
    if dtype is not None:
        check_in("--dtype", dtype, DTYPES)
    cfg, parts, restored = load_run(run_dir, step)
    tokenizer_dir = cfg.model.checkpoint or None
    hf.save_params(out, export_model_config(cfg, parts), parts.params, tokenizer_dir=tokenizer_dir, dtype=dtype)
    if tokenizer_dir is None:
        parts.tokenizer.save(out)  # tokenizer.json + tokenizer_config.json (transformers' fast tokenizer)
    return restored


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparserl_jax.export", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory (config.yaml + checkpoints/)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest intact one)")
    p.add_argument("--out", required=True, help="the Hugging Face directory to write")
    p.add_argument(
        "--dtype", default=None, help=f"tensor dtype, one of {DTYPES} (default: the checkpoint's own, exact)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    step = export(args.run_dir, args.out, step=args.step, dtype=args.dtype)
    print(f"exported {args.run_dir} step {step} to {args.out}")
    return step


if __name__ == "__main__":
    cli.run(main)
