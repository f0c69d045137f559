"""The decode benchmark's agreement rows and step breakdown (experiments/lib/decode_bench.py
--agreement-k / --breakdown, experiments/lib/decode_breakdown.py): at a tiny size its main writes a
row with and one without the candidates, each with its step in pieces (positive, finite, the rest
closing the sum), and the table; the pieces' loops carry each step into the next (no step hoisted
out), and a row's pieces follow what its step runs. No timing assertions."""

from __future__ import annotations

import json
import math
import re

import jax
import pytest

from experiments.lib import decode_bench, decode_breakdown
from sparserl_jax.kvcache import KVConfig
from sparserl_jax.model import transformer
from sparserl_jax.model.config import ModelConfig


def _shapes(policy: str = "rkv", k: int = 4) -> decode_breakdown.Shapes:
    model = ModelConfig.tiny("qwen2")
    kv_cfg = KVConfig(policy=policy, budget=8, buffer=4, window=2)
    return decode_breakdown.Shapes(
        model=model,
        batch=2,
        capacity=12,
        mean_fill=10,
        kv=kv_cfg,
        agreement_k=k,
        agreement_topk="auto",
        attn_impl="xla",
    )


def test_pieces_follow_the_row_and_the_rest_closes_the_step():
    assert decode_breakdown.pieces_of(_shapes()) == decode_breakdown.PIECES
    assert decode_breakdown.pieces_of(_shapes(k=0)) == ("lm_head", "sampling", "attention", "compression")
    assert decode_breakdown.pieces_of(_shapes("none", k=0)) == ("lm_head", "sampling", "attention")
    out = decode_breakdown.breakdown(10.0, {"lm_head": 1.0, "sampling": 2.0, "candidates": 3.0})
    assert out["rest"] == pytest.approx(4.0) and out["candidates_share"] == pytest.approx(0.3)
    assert sum(out[f"{n}_share"] for n in ("lm_head", "sampling", "candidates", "rest")) == pytest.approx(1.0)
    # rows with and without candidates share every other piece's timing
    with_k, without = _shapes(k=4), _shapes(k=0)
    for name in ("lm_head", "sampling", "attention", "compression"):
        assert decode_breakdown.piece_key(name, with_k) == decode_breakdown.piece_key(name, without)


def _loop_body(hlo: str) -> list[str]:
    """The instructions of the compiled while loop's body and of every computation it calls
    (fusions, reductions, sorts), less parameters and tuple plumbing."""
    comps: dict[str, list[str]] = {}
    name = entry = None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name = head.group(2)
            entry = name if head.group(1) else entry
            comps[name] = []
        elif line == "}":
            name = None
        elif name is not None:
            comps[name].append(line)
    # the loop of the piece's STEPS steps: the program's own while (the draws' inner loops are in it)
    todo, seen = re.findall(r"body=%?([\w.\-]+)", "\n".join(comps[entry])), set()
    assert len(todo) == 1, todo
    while todo:
        n = todo.pop()
        if n in seen or n not in comps:
            continue
        seen.add(n)
        for line in comps[n]:
            todo += re.findall(r"(?:calls|to_apply|body|condition|comparator)=%?([\w.\-]+)", line)
    skip = ("parameter(", "get-tuple-element(", " tuple(")
    return [line for n in seen for line in comps[n] if " = " in line and not any(k in line for k in skip)]


@pytest.mark.parametrize("name", decode_breakdown.PIECES)
def test_each_piece_runs_in_every_step_of_its_loop(name):
    """The piece's work sits inside the compiled loop (its step carries into the next: nothing for
    XLA to hoist): an instruction over [B, V] for the vocabulary's pieces, over the C = 12 slots
    for attention and compression; no full sort over [B, V] stands in for a top-k. And it times
    to a positive, finite figure."""
    s = _shapes()
    params = transformer.init_params(s.model, jax.random.key(0))
    compiled = decode_breakdown.compile_piece(name, s, params, seed=1)
    body = _loop_body(compiled[0].as_text())
    V, C = s.model.vocab_size, s.capacity
    assert {V, C}.isdisjoint({s.batch, s.model.d_model, s.model.d_ff, s.model.head_dim, s.kv.budget})
    shape = rf"\[2,{V}\]" if name in ("lm_head", "sampling", "candidates") else rf"\[[\d,]*\b{C}\b[\d,]*\]"
    assert any(re.search(shape, line.split(" = ", 1)[1]) for line in body), (name, body[:20])
    # the candidates' top-k is XLA's top-k kernel, as in the sampler (which records every column),
    # not a sort of the whole [B, V] (what XLA keeps when a loop reads one column of it)
    assert not any(" sort(" in line and f"[2,{V}]" in line for line in body), name
    ms = decode_breakdown.piece_ms(name, s, params, repeats=1, min_seconds=0, compiled=compiled)
    assert math.isfinite(ms) and ms > 0


@pytest.mark.slow
def test_main_times_rows_with_and_without_candidates_in_pieces(tmp_path):
    out = tmp_path / "bench.json"
    argv = [
        "--profile",
        "cpu",
        "--n-layers",
        "1",
        "--vocab",
        "1024",
        "--batch",
        "2",
        "--prompt-len",
        "8",
        "--lengths",
        "16",
        "--budget",
        "8",
        "--buffer",
        "4",
        "--window",
        "2",
        "--policies",
        "rkv",
        "--agreement-k",
        "0",
        "4",
        "--breakdown",
        "--min-seconds",
        "0",
        "--out",
        str(out),
    ]
    decode_bench.main(argv)
    saved = json.loads(out.read_text())
    assert saved["model"]["vocab_size"] == 1024 and saved["setting"]["agreement_k"] == [0, 4]
    bare, with_k = saved["results"]
    assert (bare["agreement_k"], with_k["agreement_k"]) == (0, 4) and with_k["agreement_topk"] == "exact"
    assert bare["speedup_vs_no_candidates"] == 1.0 and with_k["speedup_vs_no_candidates"] > 0
    for r in (bare, with_k):
        b = r["breakdown"]
        assert "candidates" in b if r["agreement_k"] else "candidates" not in b
        pieces = [n for n in decode_breakdown.PIECES if n in b]
        assert all(math.isfinite(b[n]) and b[n] > 0 for n in pieces), b
        assert b["rest"] + sum(b[n] for n in pieces) == pytest.approx(r["step_ms"])
    # the pieces the two rows share were timed once
    assert all(bare["breakdown"][n] == with_k["breakdown"][n] for n in pieces if n != "candidates")
    md = out.with_suffix(".md").read_text()
    assert "| rkv | 16 | 2 |" in md and "top-4 (exact)" in md and "## The step in pieces" in md
