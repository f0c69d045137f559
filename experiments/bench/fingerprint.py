"""Does this machine reproduce ours bit for bit? The default experiment's fingerprint.

  python experiments/bench/fingerprint.py           # smoke size, about a minute on one core: compares
                                              # with experiments/results/default/fingerprint_smoke.json
  python experiments/bench/fingerprint.py --write   # records this machine's fingerprint there instead

The default experiment at smoke size (5 SFT steps, 2 RL iterations per arm, seed 0), in this one
process pinned to one core with the portable CPU numerics of workers.py, hashed: the warm start's
params, one sparse rollout from it (tokens, log-probs, kept sets) and every arm's metrics. The
full-size fingerprint of the committed default run is in experiments/results/default/results.json
("fingerprint"); `python experiments/default.py` on a machine that reproduces ours gives the same.
One process, no workers: it also runs under an emulator (tests/test_portable_cpu.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from experiments.lib import workers  # imports no JAX
from experiments.lib.figprov import cpu_model  # imports no JAX

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/
COMMITTED = os.path.join(HERE, "results", "default", "fingerprint_smoke.json")
CONFIG = os.path.join(HERE, "configs", "walk_key_rkv.yaml")


def compute(config: str = CONFIG) -> dict:
    """The smoke-size fingerprint, computed in this process (pinned, portable CPU settings)."""
    workers.pin_to_one_core()
    import jax

    jax.devices()  # start the backend here: parallel_map then runs every arm in this process
    from experiments.lib import default_experiment as default

    with tempfile.TemporaryDirectory() as out:
        results = default.run(config, overrides(config), out, seeds=(0,), warms=(0,), log=lambda *a: None)
    return {
        "config": os.path.relpath(config, os.path.dirname(HERE)),
        "jax": jax.__version__,
        "cpu": cpu_model(),
        "portable_cpu": workers.portable_cpu_enabled(),
        **results["fingerprint"],
    }


def overrides(config: str = CONFIG) -> list[str]:
    """The fingerprint's run: `python experiments/default.py --smoke` (whose results.json holds the
    same fingerprint for its first warm start), without a progress bar."""
    from experiments.lib.figlib import smoke_overrides

    return [*smoke_overrides(config), "train.progress=false"]


def compare(mine: dict, ours: dict) -> list[str]:
    """The fields of the fingerprint that differ (versions and settings first; not the CPU)."""
    return [k for k in ours if k != "cpu" and mine.get(k) != ours[k]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true", help="record this machine's fingerprint")
    p.add_argument("--out", default=COMMITTED, help="the fingerprint file to compare with or write")
    p.add_argument("--json", default=None, help="also write this machine's fingerprint here")
    args = p.parse_args(argv)
    mine = compute()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(mine, f, indent=1)
    if args.write:
        with open(args.out, "w") as f:
            json.dump(mine, f, indent=1)
            f.write("\n")
        print(f"wrote {args.out}: {mine}")
        return 0
    with open(args.out) as f:
        ours = json.load(f)
    diff = compare(mine, ours)
    if not diff:
        print(f"reproduces {os.path.relpath(args.out)} bit for bit: {mine}")
        return 0
    for k in diff:
        print(f"differs: {k}: this machine {mine.get(k)!r}, committed {ours[k]!r}")
    if "jax" in diff or "portable_cpu" in diff:
        print("(another jax version or SPARSERL_PORTABLE_CPU=0: bit-identity is not expected)")
    elif mine["cpu"] != ours["cpu"]:
        print(
            f"(committed on {ours['cpu']}, this is {mine['cpu']}: see "
            "experiments/results/default/reproducibility.md for what is known to differ)"
        )
    return 1


if __name__ == "__main__":
    sys.exit(main())
