"""Do float32 dots give the same bits on this CPU and on another one? Hashes of jitted dots.

  python experiments/bench/dot_bits.py                          # the large dots, this CPU
  python experiments/bench/dot_bits.py --emulate EPYC-Rome      # the same under qemu-user (Zen 2)
  python experiments/bench/dot_bits.py --emulate EPYC-Rome,legacy-cache=on   # other cache descriptors
  python experiments/bench/dot_bits.py --emulate max,host-cache-info=on      # this CPU's descriptors
  python experiments/bench/dot_bits.py --chunk 128              # K cut in fixed chunks, summed in order
  python experiments/bench/dot_bits.py --xla-dots               # XLA emits the dots itself
  python experiments/bench/dot_bits.py --model --xla-dots --canonical   # the tiny model's gradient
  python experiments/bench/dot_bits.py --time                   # median CPU time per dot, this CPU
  python experiments/bench/dot_bits.py --train-steps 5          # seconds per RL iteration, this CPU

Prints a 12-hex-digit SHA-1 of each result's float32 bytes (inputs: standard normals from
numpy's default_rng(0), drawn as tests/test_portable_cpu.py's PROBE draws them, so the hashes of
the plain dots are comparable with it), with the portable CPU settings of workers.py on unless
--host, in one process pinned to one core. Evidence for
experiments/results/default/reproducibility.md ("Large dots across CPUs").

--chunk C computes A @ B as the sum over c of A[:, cC:(c+1)C] @ B[cC:(c+1)C, :], the partial
products added one after the other by XLA's own (LLVM-compiled) code, so no library call
contracts more than C terms.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import time

from experiments.lib import workers  # imports no JAX
from experiments.lib.figstats import untimed  # NumPy only

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/
CONFIG = os.path.join(HERE, "configs", "walk_key_rkv.yaml")
# --xla-dots: XLA emits every dot it can itself (its tiled LLVM IR GEMM, tiles fixed at compile
# time) instead of calling Eigen (blocks sized by the cache sizes the CPU reports) and oneDNN's
# sgemm. XLA takes a [M, K] @ [K, N] dot itself only when multi-threaded Eigen is off; a dot that
# contracts another axis of an operand (x^T @ y, x @ y^T) still goes to Eigen.
XLA_DOTS_FLAGS = (
    "--xla_cpu_multi_thread_eigen=false",
    "--xla_backend_extra_options=xla_force_enable_experimental_llvm_ir_gemm",
)
# Under qemu: the venv's site-packages with its .pth files (site.addsitedir), then this script.
EMULATED = (
    "import runpy, site, sys; site.addsitedir(sys.argv[1]); sys.argv = sys.argv[2:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)
SHAPES = {
    "large": [(2048, 128, 256), (512, 256, 128), (37, 576, 1536)],
    "small": [(4, 4, 4), (8, 8, 8), (8, 64, 64), (1, 128, 256), (128, 128, 49)],
}


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    if text in SHAPES:
        return SHAPES[text]
    try:
        shapes = [tuple(int(d) for d in s.split("x")) for s in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 3 or min(s) < 1 for s in shapes):
        raise SystemExit(f"--shapes: {text!r} is not one of {sorted(SHAPES)} nor MxKxN[,MxKxN...]")
    return shapes  # type: ignore[return-value]


def chunked_dot(a_MxK, b_KxN, chunk: int):
    """a_MxK @ b_KxN as a fixed-order sum of dots over K chunks of `chunk` (the last may be
    shorter): the summation order over chunks is XLA's, the same on every CPU."""
    import jax.numpy as jnp

    k = a_MxK.shape[-1]
    out_MxN = None
    for s in range(0, k, chunk):
        part_MxN = jnp.dot(a_MxK[:, s : s + chunk], b_KxN[s : s + chunk])
        out_MxN = part_MxN if out_MxN is None else out_MxN + part_MxN
    return out_MxN


def _hash(arrays) -> str:
    import numpy as np

    h = hashlib.sha1()
    for a in arrays:
        h.update(np.asarray(a).tobytes())
    return h.hexdigest()[:12]


def _median_s(fn, n: int) -> float:
    """Median CPU seconds of the process per call of fn (all its threads, on the one core it is
    pinned to): less moved than wall time by other processes sharing the machine."""
    times = []
    for _ in range(n):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return sorted(times)[n // 2]


def run(shapes, chunk: int, timing: bool) -> list[str]:
    """Hash (and time) jnp.dot, or chunked_dot, of each [m, k] @ [k, n] in `shapes`."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    r = np.random.default_rng(0)
    r.standard_normal((64, 1000))  # PROBE's first draw (its reduction input)
    fn = jax.jit(jnp.dot if chunk == 0 else lambda a, b: chunked_dot(a, b, chunk))
    rows = []
    for m, k, n in shapes:
        a = jnp.asarray(r.standard_normal((m, k)), jnp.float32)
        b = jnp.asarray(r.standard_normal((k, n)), jnp.float32)
        out = np.asarray(fn(a, b))
        row = f"{m}x{k}x{n} {hashlib.sha1(out.tobytes()).hexdigest()[:12]}"
        if timing:
            row += f" {1e6 * _median_s(lambda: fn(a, b).block_until_ready(), 51):.1f}us"  # noqa: B023 (called within the iteration)
        rows.append(row)
    return rows


def canonical_projections() -> None:
    """Route the model's projections (quant.dot, full-precision kernels) through `_matmul`: one
    [M, K] @ [K, N] dot forward and backward, every transposed operand materialized behind an
    optimization barrier so that XLA cannot fold the transpose back into the dot. A dot that
    contracts an operand's other axis (the weight gradients x^T dy, dy W^T) is one XLA's own GEMM
    emitter does not take: it goes to Eigen, whose blocking follows the cache sizes. The model's
    code is left as it is: the experiment patches transformer.dot and layers.dot in this process."""
    import math

    import jax
    import jax.numpy as jnp

    from sparserl_jax.model import layers, transformer
    from sparserl_jax.quant import core

    barrier = jax.lax.optimization_barrier

    @jax.custom_vjp
    def _matmul(x_MxK, w_KxN):
        return jnp.dot(x_MxK, barrier(w_KxN))

    def _fwd(x_MxK, w_KxN):
        return _matmul(x_MxK, w_KxN), (x_MxK, w_KxN)

    def _bwd(res, g_MxN):
        x_MxK, w_KxN = res
        return jnp.dot(g_MxN, barrier(w_KxN.T)), jnp.dot(barrier(x_MxK.T), g_MxN)

    _matmul.defvjp(_fwd, _bwd)

    def dot(spec, x, w, *, preferred_element_type=None):
        inputs, out = spec.replace(" ", "").split("->")
        xs, ws = (core._tokens(t) for t in inputs.split(","))
        n_contract = len((set(xs) & set(ws)) - set(core._tokens(out)) - {"..."})
        contract = xs[len(xs) - n_contract :]
        if (
            isinstance(w, core.QWeight)
            or x.dtype != jnp.float32
            or w.dtype != jnp.float32
            or preferred_element_type not in (None, jnp.float32)
            or ws[:n_contract] != contract
            or core._tokens(out) != xs[: len(xs) - n_contract] + ws[n_contract:]
        ):
            return core.dot(spec, x, w, preferred_element_type=preferred_element_type)
        k = math.prod(x.shape[x.ndim - n_contract :])
        out_shape = x.shape[: x.ndim - n_contract] + w.shape[n_contract:]
        return _matmul(x.reshape(-1, k), w.reshape(k, -1)).reshape(out_shape)

    transformer.dot = layers.dot = dot


def model_grad(timing: bool) -> list[str]:
    """The tiny model of CONFIG (random init, seed 0): loss and gradient of the mean next-token
    log-prob over a [32, 256] batch of random tokens, what one update minibatch computes: its
    projections (M = 32 * 256 rows), attention and head."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sparserl_jax.config import load_config
    from sparserl_jax.model import transformer

    arch = load_config([CONFIG]).model.arch
    params = transformer.init_params(arch, jax.random.key(0))
    tokens_BxT = jnp.asarray(np.random.default_rng(0).integers(0, arch.vocab_size, (32, 256)), jnp.int32)

    @jax.jit
    def loss_and_grad(params, tokens_BxT):
        return jax.value_and_grad(lambda p: -transformer.token_logprobs(p, arch, tokens_BxT)[0].mean())(params)

    loss, grads = loss_and_grad(params, tokens_BxT)
    row = f"model loss+grad {_hash([loss, *jax.tree.leaves(grads)])}"
    if timing:
        row += f" {_median_s(lambda: jax.block_until_ready(loss_and_grad(params, tokens_BxT)), 21):.4f}s"
    return [row]


def train_steps(n: int) -> list[str]:
    """n RL iterations (rollout with R-KV, rewards, update) of CONFIG from a random init (no SFT),
    after one untimed iteration that compiles: median seconds per iteration, and a hash of the
    last iteration's metrics (a random init earns no reward, so the params do not move)."""
    import tempfile

    import jax
    import numpy as np

    from sparserl_jax.config import load_config
    from sparserl_jax.train import Trainer

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            [CONFIG], ["sft.steps=0", "sft.curriculum.steps=0", f"train.out_dir={out}", "train.progress=false"]
        )
        trainer = Trainer(cfg, log=lambda *a, **k: None)

        metrics = {}

        def step():
            metrics.update(trainer.step())
            trainer.iteration += 1
            jax.block_until_ready(trainer.params)

        step()
        seconds = _median_s(step, n)
        values = [float(v) for _, v in sorted(untimed(metrics).items())]  # not the clock-dependent ones
        return [f"train step {seconds:.3f}s metrics {_hash([np.asarray(values, np.float64)])}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="large", help="large, small or MxKxN[,MxKxN...]")
    p.add_argument("--chunk", type=int, default=0, help="cut K in chunks of this size (0: plain dot)")
    p.add_argument("--model", action="store_true", help="the tiny model's loss and gradient instead")
    p.add_argument(
        "--train-steps",
        type=int,
        default=0,
        metavar="N",
        help="time N RL iterations of the tiny model instead (this CPU only)",
    )
    p.add_argument("--xla-dots", action="store_true", help="XLA emits the dots itself: " + " ".join(XLA_DOTS_FLAGS))
    p.add_argument(
        "--canonical",
        action="store_true",
        help="with --model or --train-steps: the "
        "projections as canonical dots forward and backward (canonical_projections)",
    )
    p.add_argument(
        "--emulate",
        metavar="CPU",
        help="run under qemu-x86_64 -cpu CPU (a model, optionally with properties: EPYC-Rome,legacy-cache=on)",
    )
    p.add_argument("--host", action="store_true", help="without the portable CPU settings")
    p.add_argument("--time", action="store_true", help="also the median CPU time per call (this CPU only)")
    args = p.parse_args()
    if args.chunk < 0:
        raise SystemExit(f"--chunk: {args.chunk} must be 0 (plain dot) or a positive chunk size")
    if args.train_steps < 0:
        raise SystemExit(f"--train-steps: {args.train_steps} must be 0 (none) or a positive count")
    shapes = parse_shapes(args.shapes)
    if args.canonical and not (args.model or args.train_steps):
        raise SystemExit("--canonical: acts on the model only (with --model or --train-steps)")
    if args.emulate and (args.time or args.train_steps):
        raise SystemExit("--time, --train-steps: time this CPU only (no --emulate)")
    if args.emulate:
        qemu = shutil.which("qemu-x86_64")
        if qemu is None:
            raise SystemExit("--emulate needs qemu-x86_64 (apt-get install qemu-user)")
        argv = [a for a in sys.argv[1:] if a not in ("--emulate", args.emulate) and not a.startswith("--emulate=")]
        env = dict(os.environ)
        # qemu-user runs the interpreter itself, outside the venv: the venv's packages come by
        # PYTHONPATH, and this repository (the venv's editable install) by the import hook its .pth
        # file installs, which EMULATED runs before this script; no compilation cache (its entries
        # hold this host's instruction set)
        purelib = sysconfig.get_paths()["purelib"]
        env["PYTHONPATH"] = purelib
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        cmd = [qemu, "-cpu", args.emulate, sys.executable, "-c", EMULATED, purelib, os.path.abspath(__file__), *argv]
        raise SystemExit(subprocess.run(cmd, env=env).returncode)
    if args.xla_dots:  # before set_portable_cpu_env, which keeps flags already given
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *XLA_DOTS_FLAGS]).strip()
    if not args.host:
        workers.set_portable_cpu_env()
    os.sched_setaffinity(0, {workers.available_cores()[0]})  # one thread, as the workers run
    if args.canonical:
        canonical_projections()
    if args.train_steps:
        rows = train_steps(args.train_steps)
    elif args.model:
        rows = model_grad(args.time)
    else:
        rows = run(shapes, args.chunk, args.time)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
