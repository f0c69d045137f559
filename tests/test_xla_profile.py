"""experiments/lib/xla_profile.py: a traced program's executed instructions joined with XLA's dump
of it (in a fresh interpreter: the dump flag must reach XLA before its CPU client starts), and
profile_cpu.py at smoke size (extended)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

PROGRAM = textwrap.dedent(
    """
    import json, os, sys
    from experiments.lib import xla_profile as xp
    work = sys.argv[1]
    os.environ["XLA_FLAGS"] = xp.dump_flags(os.path.join(work, "hlo"))
    import jax, jax.numpy as jnp

    def f(a_bf16, b_bf16, key):
        def body(c, _):  # a bfloat16 product with a bfloat16 result, three times in a loop
            return c @ b_bf16, None
        c = jax.lax.scan(body, a_bf16, None, length=3)[0]
        d = jnp.dot(a_bf16, b_bf16, preferred_element_type=jnp.float32)  # float32 accumulation
        e = jnp.dot(d, d.T)  # float32 operands from float32 values
        return c, e, jax.random.categorical(key, d)

    a = jax.random.normal(jax.random.key(0), (64, 128), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (128, 128), jnp.bfloat16)
    g = jax.jit(f)
    jax.block_until_ready(g(a, b, jax.random.key(2)))
    with xp.traced(os.path.join(work, "trace")):
        for i in range(2):
            jax.block_until_ready(g(a, b, jax.random.key(3 + i)))
    print(json.dumps(xp.op_rows(os.path.join(work, "trace"), os.path.join(work, "hlo"))))
    """
)


def test_a_traced_program_reads_as_its_dots_loops_and_random_numbers(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)},
        check=True,
    )
    rows = [r for r in json.loads(out.stdout.splitlines()[-1]) if r["program"] == "jit_f"]
    assert rows and all(r["opcode"] not in ("while", "conditional", "call") for r in rows)  # loops left out
    assert [r["seconds"] for r in rows] == sorted((r["seconds"] for r in rows), reverse=True)
    dots = {(d["lhs"].split("[")[0], d["rhs"].split("[")[0], d["out"], r["calls"]): d for r in rows for d in r["dots"]}
    # the 64 x 128 x 128 products: the loop's runs 3 times a call, 2 calls; each dot 2*64*128*128 FLOPs
    in_loop = [d for (_, _, out_t, calls), d in dots.items() if calls == 6]
    once = [d for (_, _, out_t, calls), d in dots.items() if calls == 2 and out_t == "f32[64,128]"]
    square = [d for (_, _, out_t, calls), d in dots.items() if out_t == "f32[64,64]"]
    assert len(in_loop) == 1 and in_loop[0]["flops"] == 2 * 64 * 128 * 128
    assert len(once) == 1 and once[0]["flops"] == 2 * 64 * 128 * 128
    assert len(square) == 1 and square[0]["flops"] == 2 * 64 * 64 * 128 and not square[0]["upcast"]
    # the dot with float32 accumulation reads its bfloat16 operands as they are, or XLA widened them:
    # either way the row says which (operand dtype and the upcast mark agree)
    for d in (*in_loop, *once):
        assert d["lhs"].startswith("bf16") or d["upcast"], d
        assert not (d["lhs"].startswith("bf16") and d["upcast"]), d
    categories = {r["category"] for r in rows}
    assert "random numbers" in categories  # the Gumbel noise of jax.random.categorical
    assert all("xla_profile" not in r["source"] for r in rows)


@pytest.mark.extended
def test_profile_cpu_smoke(tmp_path):
    pytest.importorskip("transformers")
    from hf_fixtures import make_tiny_hf_checkpoint

    from sparserl_jax.tokenizer import CharTokenizer

    ckpt = make_tiny_hf_checkpoint("llama", tmp_path / "ckpt")
    CharTokenizer().save(ckpt)
    out = tmp_path / "profile.json"
    subprocess.run(
        [sys.executable, "experiments/bench/profile_cpu.py", "--smoke", "--checkpoint", str(ckpt), "--out", str(out)],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    data = json.loads(out.read_text())
    for dtype in ("float32", "bfloat16"):
        prof = data["arms"][dtype]["profile"]
        assert 0 < prof["seconds"] <= data["arms"][dtype]["wall_s"]
        assert {p["program"] for p in prof["programs"]} >= {"jit_generate"} and prof["dots"]
    assert any(d["dot"]["lhs"].startswith("bf16") for d in data["arms"]["bfloat16"]["profile"]["dots"])
    assert not any(d["dot"]["lhs"].startswith("bf16") for d in data["arms"]["float32"]["profile"]["dots"])
    assert "| random numbers |" in (tmp_path / "profile.md").read_text()
