"""Two commits' model programs in one process on one core, alternating: a code change's effect
measured inside the host's drift.

  taskset -c 1 python experiments/bench/bench_commits.py --base 90bcccd --rounds 200
  python experiments/bench/bench_commits.py --base HEAD --smoke --out /tmp/bc.json    # seconds (tests)

On this project's CPU hosts a program's speed drifts 10-30% over minutes, and a step inside one
process moves by as much: two commits benchmarked one after the other (or in alternating
processes) cannot resolve a 5% change. Here each side's sparserl_jax (--base and --head: a git
revision, extracted with `git archive`, or `worktree`, the files as they are) is imported in turn
under its own modules; each traces and compiles a gradient with respect to the bfloat16 compute
copy of float32 master weights, at the learner's micro-batch shape: by default (--program
logprobs) of the tokens' log-probs through its own transformer.token_logprobs (--layers
SmolLM2-135M-Instruct blocks with random weights, then the LM head's chunks), with --program
blocks of <forward(params, tokens), dY> (the blocks alone). Then the two compiled programs run
alternately, --rounds pairs, so both sides of a pair see the same host. The report gives each
side's median step, the pairs' ratio (median and quartiles) and how far the two sides' gradients
are apart (relative to each parameter's largest).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

from experiments.lib import figprov, micro_step_bench  # import no JAX

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/
REPO = os.path.dirname(HERE)
PKG = "sparserl_jax"
WORKTREE = "worktree"
PROGRAMS = ("logprobs", "blocks")
DEFAULT_OVERRIDES = ["model.head_backward=compute", "model.attention_backward=compute"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    micro_step_bench.add_shape_args(p)
    p.set_defaults(rounds=200)
    p.add_argument("--base", required=True, help="a git revision (or 'worktree')")
    p.add_argument("--head", default=WORKTREE, help="a git revision, or 'worktree' (default): the files as they are")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks in each side's program")
    p.add_argument(
        "--program",
        choices=PROGRAMS,
        default="logprobs",
        help="logprobs: the gradient of the tokens' log-probs (the LM head's chunks included); "
        "blocks: of <forward(params, tokens), dY> (the blocks alone)",
    )
    p.add_argument("--overrides", nargs="*", default=DEFAULT_OVERRIDES, help="model.key=value, both sides")
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_commits.json"))
    args = micro_step_bench.check_shape_args(p, p.parse_args(argv))
    if args.smoke:
        args.layers, args.rounds = 1, 3
    if args.layers < 1 or args.rounds < 1:
        p.error(f"--layers {args.layers} and --rounds {args.rounds} must be positive")
    return args


def _pkg_modules() -> list[str]:
    return [k for k in sys.modules if k == PKG or k.startswith(PKG + ".")]


@contextlib.contextmanager
def side_modules(tree: str):
    """`tree`'s sparserl_jax (and its kernels/, installed as sparserl_jax.kernels) as this process's
    while the block runs (tracing imports lazily, so a side's program is traced inside it); the
    modules imported before are back afterwards."""
    before = {k: sys.modules.pop(k) for k in _pkg_modules()}
    sys.path.insert(0, tree)
    try:
        pkg = importlib.import_module(PKG)
        if not pkg.__file__.startswith(os.path.join(tree, PKG)):
            raise RuntimeError(f"{PKG} came from {pkg.__file__}, not from {tree}")
        spec = importlib.util.spec_from_file_location(
            f"{PKG}.kernels",
            os.path.join(tree, "kernels", "__init__.py"),
            submodule_search_locations=[os.path.join(tree, "kernels")],
        )
        kernels = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = kernels
        spec.loader.exec_module(kernels)
        pkg.kernels = kernels
        yield
    finally:
        sys.path.remove(tree)
        for k in _pkg_modules():
            del sys.modules[k]
        sys.modules.update(before)


def _tree(rev: str, scratch: str) -> tuple[str, str]:
    """(directory holding the side's sparserl_jax/ and kernels/, the commit it is) for `rev`."""
    if rev == WORKTREE:
        return REPO, WORKTREE
    git = ["git", "-C", REPO]
    sha = subprocess.run([*git, "rev-parse", "--verify", f"{rev}^{{commit}}"], capture_output=True, text=True)
    if sha.returncode:
        raise SystemExit(f"--base/--head {rev!r} is not a commit of {REPO}: {sha.stderr.strip()}")
    sha = sha.stdout.strip()
    out = os.path.join(scratch, sha)
    if not os.path.isdir(out):  # both sides may name one commit
        archive = f"{out}.tar"
        subprocess.run([*git, "archive", "-o", archive, sha, PKG, "kernels"], check=True)
        with tarfile.open(archive) as t:
            t.extractall(out, filter="data")
    return out, sha


def _side_program(settings: dict, inputs: dict, program: str):
    """The current side's compiled gradient program, its compile seconds and XLA's temporaries."""
    import jax
    import jax.numpy as jnp

    from sparserl_jax.config_io import from_dict
    from sparserl_jax.model import precision, transformer
    from sparserl_jax.model.config import ModelConfig

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = from_dict(ModelConfig, {k: v for k, v in settings.items() if k in fields}, "model")
    master = transformer.init_params(cfg, jax.random.key(0))
    params = precision.compute_copy(master, cfg)

    def loss(p, tokens, dy, weights):
        if program == "blocks":
            return jnp.sum(transformer.forward(p, cfg, tokens).astype(jnp.float32) * dy)
        return jnp.sum(transformer.token_logprobs(p, cfg, tokens)[0] * weights)

    t0 = time.perf_counter()
    compiled = jax.jit(jax.grad(loss)).lower(params, *inputs.values()).compile()
    compile_s = time.perf_counter() - t0
    return compiled, params, compile_s, getattr(compiled.memory_analysis(), "temp_size_in_bytes", None)


def run(args) -> dict:
    import jax
    import numpy as np

    from sparserl_jax.config_io import to_dict

    settings = {**to_dict(micro_step_bench.model_config(args, args.overrides)), "n_layers": args.layers}
    rng = np.random.default_rng(0)
    inputs = {
        "tokens": rng.integers(0, settings["vocab_size"], (args.rows, args.width), dtype=np.int32),
        "dy": rng.standard_normal((args.rows, args.width, settings["d_model"]), dtype=np.float32),
        "weights": rng.standard_normal((args.rows, args.width), dtype=np.float32),  # each log-prob's
    }
    sides = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, rev in (("base", args.base), ("head", args.head)):
            tree, commit = _tree(rev, scratch)
            with side_modules(tree):
                compiled, params, compile_s, temp = _side_program(settings, inputs, args.program)
            sides[name] = dict(rev=rev, commit=commit, compiled=compiled, params=params, compile_s=compile_s, temp=temp)

    def step(s):
        t0 = time.perf_counter()
        out = jax.block_until_ready(s["compiled"](s["params"], *inputs.values()))
        return out, time.perf_counter() - t0

    grads = {name: step(s)[0] for name, s in sides.items()}  # untimed
    walls = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, s in sides.items():
            walls[name].append(step(s)[1])
    ratios = [h / b for b, h in zip(walls["base"], walls["head"])]

    def apart(a, b):  # the largest difference, relative to the leaf's largest magnitude
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1e-30))

    same_tree = jax.tree.structure(grads["base"]) == jax.tree.structure(grads["head"])
    diffs = jax.tree.leaves(jax.tree.map(apart, grads["base"], grads["head"])) if same_tree else None
    return {
        "sides": {
            name: {
                "rev": s["rev"],
                "commit": s["commit"],
                "step_s": round(statistics.median(walls[name]), 4),
                "compile_s": round(s["compile_s"], 2),
                "temp_bytes": s["temp"],
            }
            for name, s in sides.items()
        },
        "pairs": {
            "median": round(statistics.median(ratios), 3),
            "q25": round(float(np.quantile(ratios, 0.25)), 3),
            "q75": round(float(np.quantile(ratios, 0.75)), 3),
            "n": len(ratios),
        },
        "grad_apart": max(diffs) if diffs is not None else None,
        "shape": micro_step_bench.shape_line(args, args.overrides).split("; pi_ref")[0]
        + (
            f"; {args.layers} blocks' forward + backward (no LM head)"
            if args.program == "blocks"
            else f"; the log-probs' gradient through {args.layers} blocks and the LM head"
        ),
    }


def to_markdown(data: dict) -> str:
    b, h, p = data["sides"]["base"], data["sides"]["head"], data["pairs"]
    diff = data["grad_apart"]
    lines = [
        *figprov.report_head("Two commits' model programs, alternating in one process", data),
        f"Shape: {data['shape']}. Each side compiled once, one untimed step, then {p['n']} pairs "
        "of steps, base then head, on the same core.",
        "",
        "| | base | head | head / base |",
        "|---|---|---|---:|",
        f"| revision | {b['rev']} ({b['commit'][:12]}) | {h['rev']} ({h['commit'][:12]}) | |",
        f"| step, median s | {b['step_s']} | {h['step_s']} | {h['step_s'] / b['step_s']:.3f}x |",
        f"| pairs' ratio, median (quartiles) | | | {p['median']:.3f}x ({p['q25']:.3f}-{p['q75']:.3f}) |",
        f"| compile s | {b['compile_s']} | {h['compile_s']} | |",
        f"| XLA's temporaries, bytes | {b['temp_bytes']:,} | {h['temp_bytes']:,} | |",
        "",
        "The two sides' parameter gradients: "
        + (
            f"at most {diff:.3g} of a parameter's largest gradient apart."
            if diff is not None
            else "different pytrees (not compared)."
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    return micro_step_bench.main(lambda _: args, lambda a: run(a), to_markdown)


if __name__ == "__main__":
    main()
