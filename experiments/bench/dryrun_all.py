"""Dry-run memory reports for the real-scale configs (no checkpoint, no device needed).

  python experiments/bench/dryrun_all.py [--out experiments/results/dryrun]

For every model in experiments/configs/real/ and every mesh overlay (1 GPU and 8 GPUs of 80 GiB,
a TPU v5p-32 slice with 95 GiB per chip, a TPU v5e-8 and v5e-16 with 16 GiB per chip), writes <model>_<mesh>.md and .json through
`python -m sparserl_jax.dryrun` (each report holds its exact command), then summary.md: peak per
device at data.max_prompt_len (the worst case the config admits) and at a typical padded MATH
prompt of 256 tokens, with each overlay's rollout.rows_per_call.
"""

from __future__ import annotations

import argparse
import os

from sparserl_jax import dryrun
from sparserl_jax.config import load_config

REAL = "experiments/configs/real"
MODELS = ("qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "llama-3.2-1b-instruct")
MESHES = {"1gpu": 80.0, "8gpu": 80.0, "tpu_pod": 95.0, "v5e8": 16.0, "v5e16": 16.0}  # overlay -> GiB per device
TYPICAL_PROMPT = 256


def argv_for(model: str, mesh: str, out: str) -> list[str]:
    return [
        "--config",
        f"{REAL}/{model}.yaml",
        "--config",
        f"{REAL}/mesh/{mesh}.yaml",
        "--arch",
        f"{REAL}/arch/{model}.json",
        "--device-memory-gib",
        f"{MESHES[mesh]:g}",
        "--out-json",
        f"{out}/{model}_{mesh}.json",
        "--out-md",
        f"{out}/{model}_{mesh}.md",
    ]


def gib(n: int) -> str:
    return f"{n / dryrun.GIB:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="experiments/results/dryrun")
    out = p.parse_args().out
    rows = []
    for model in MODELS:
        for mesh in MESHES:
            argv = argv_for(model, mesh, out)
            rep = dryrun.main(argv)
            cfg = load_config([f"{REAL}/{model}.yaml", f"{REAL}/mesh/{mesh}.yaml"])
            typical = dryrun.dry_run(
                cfg,
                arch=f"{REAL}/arch/{model}.json",
                device_memory_gib=MESHES[mesh],
                prompt_len=TYPICAL_PROMPT,
            )
            rows.append((model, mesh, rep, typical))
    lines = [
        "# Dry-run memory per device: Sparse-RL at the authors' settings",
        "",
        "```",
        f"python experiments/bench/dryrun_all.py --out {out}",
        "```",
        "",
        "128 prompts x 8 samples per rollout, 4096 new tokens, R-KV budget 512 + buffer 128, bf16, "
        "AdamW, remat, the update step donating the old weights and AdamW state "
        "(rl.update.donate). Rows/call is the mesh overlay's rollout.rows_per_call (the rows one sampler "
        "call decodes; 'all' = the 1024 rows at once); the rollout phase scales with it, the "
        "update phase does not. Each <model>_<mesh>.md holds the full table and its command. Columns: peak "
        f"GiB per device (phase) and the verdict with a 10% margin, at data.max_prompt_len = 1024 "
        f"(worst case) and at a {TYPICAL_PROMPT}-token padded prompt (`--prompt-len "
        f"{TYPICAL_PROMPT}`); the last column is the worst case with dense rollouts.",
        "",
        "| model | params | mesh | GiB/device | rows/call | peak, P=1024 | fits | peak, P=256 | fits | dense P=1024 |",
        "|---|---:|---|---:|---:|---:|---|---:|---|---|",
    ]
    for model, mesh, rep, typ in rows:
        d = rep["dense_rollouts"]
        lines.append(
            f"| {model} | {rep['model']['params'] / 1e9:.2f}B | {mesh} ({rep['devices']}) | "
            f"{rep['device_memory_gib']:g} | {rep['rollout']['rows_per_call'] or 'all'} | "
            f"{gib(rep['peak_bytes'])} ({rep['peak_phase']}) | "
            f"{'yes' if rep['fits'] else 'no'} | {gib(typ['peak_bytes'])} ({typ['peak_phase']}) | "
            f"{'yes' if typ['fits'] else 'no'} | {gib(d['peak_bytes'])}, "
            f"{'fits' if d['fits'] else 'no'} |"
        )
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
