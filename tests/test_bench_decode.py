"""Smoke test of experiments/bench/bench_decode.py (its benchmark: experiments/lib/decode_bench.py): its main at tiny settings writes a well-formed JSON
and markdown with finite, positive figures (no timing assertions), and the GPU profile lowers."""

import dataclasses
import json
import math
import os

import pytest

from experiments.lib import decode_bench
from sparserl_jax import kvcache as kv


@pytest.fixture(scope="module")
def bench():
    return decode_bench


def test_cpu_main_writes_rows(bench, tmp_path):
    out = tmp_path / "bench.json"
    argv = [
        "--profile",
        "cpu",
        "--n-layers",
        "1",
        "--batch",
        "2",
        "--prompt-len",
        "8",
        "--lengths",
        "24",
        "--budget",
        "8",
        "--buffer",
        "8",
        "--window",
        "2",
        "--policies",
        "none",
        "streaming",
        "--min-seconds",
        "0",
        "--out",
        str(out),
    ]
    report = bench.main(argv)
    saved = json.loads(out.read_text())
    assert saved["command"] == " ".join(argv) and saved["profile"] == "cpu"
    assert saved["device_kind"] and saved["jax_version"] and saved["date"]
    assert saved["model"]["n_layers"] == 1 and saved["setting"]["budget"] == 8
    rows = saved["results"]
    assert [(r["policy"], r["new_tokens"]) for r in rows] == [("none", 24), ("streaming", 24)]
    _, prof = bench.resolve(bench.parse_args(argv))
    for r in rows:
        for name in ("tokens_per_s", "step_ms", "compile_s", "wall_s", "speedup_vs_dense"):
            assert math.isfinite(r[name]) and r[name] > 0, (name, r)
        assert r["batch"] == 2 and r["wall_s_all"] and len(r["wall_s_all"]) >= 1
        assert r["tokens_per_s"] == pytest.approx(2 * 24 / r["wall_s"])
        assert r["step_ms"] == pytest.approx(r["wall_s"] / 24 * 1e3)
        # KV bytes = the physical cache the sampler allocates at this capacity
        cache = kv.cache_for(bench.kv_config(r["policy"], prof), prof.model, 2, 8, capacity=r["kv_capacity"])
        assert r["kv_bytes"] == cache.nbytes()
    dense, sparse = rows
    assert dense["speedup_vs_dense"] == 1.0
    assert dense["kv_capacity"] == 8 + 24 and sparse["kv_capacity"] == 8 + 8  # budget + buffer
    assert sparse["n_compressions"] >= 1 and sparse["evicted_fraction"] > 0
    assert dense["n_compressions"] == 0 and dense["evicted_fraction"] == 0
    acc = saved["acceptance"]
    assert acc["speedup_at_target"] == {} and not acc["passed"]  # 8192 was not run
    assert acc["step_ms_ratio_longest_over_shortest"] == {}  # one length
    assert report["results"] == rows
    md = out.with_suffix(".md").read_text()
    assert md.count("\n| streaming | 24 | 2 |") == 1 and md.count("\n| none | 24 | 2 |") == 1
    assert "## Acceptance" in md and "GPU rows pending: no GPU in this session" in md


def _row(policy, new_tokens, step_ms, batch=4):
    wall_s = step_ms * new_tokens / 1e3
    return dict(
        policy=policy,
        new_tokens=new_tokens,
        batch=batch,
        tokens_per_s=batch / step_ms * 1e3,
        step_ms=step_ms,
        wall_s=wall_s,
        wall_s_all=[wall_s],
        compile_s=1.0,
        kv_capacity=1,
        kv_bytes=1,
    )


def test_speedups_and_acceptance(bench):
    prof = bench.PROFILES["cpu"]  # target 2x at 8192, lengths 1024 .. 8192
    rows = [
        _row("none", 1024, 2.0),
        _row("h2o", 1024, 1.0),
        _row("rkv", 1024, 1.5),
        _row("none", 8192, 9.0),
        _row("h2o", 8192, 1.2),
        _row("rkv", 8192, 3.0),
    ]
    bench.add_speedups(rows)
    assert [r["speedup_vs_dense"] for r in rows] == pytest.approx([1, 2, 4 / 3, 1, 7.5, 3])
    acc = bench.acceptance(rows, prof)
    assert acc["speedup_at_target"] == pytest.approx({"h2o": 7.5, "rkv": 3.0})
    assert acc["min_speedup_at_target"] == pytest.approx(3.0) and acc["passed"]
    assert acc["step_ms_ratio_longest_over_shortest"] == pytest.approx({"none": 4.5, "h2o": 1.2, "rkv": 2.0})
    slow = [dict(r) for r in rows]
    slow[-1] = _row("rkv", 8192, 6.0)
    bench.add_speedups(slow)
    assert not bench.acceptance(slow, prof)["passed"]  # rkv only 1.5x at 8192
    no_dense = [r for r in rows if r["policy"] != "none"]
    bench.add_speedups(no_dense)
    assert all(r["speedup_vs_dense"] is None for r in no_dense)
    assert not bench.acceptance(no_dense, prof)["passed"]
    # rows of several batches (the device check's sampler step): each against its own batch's dense
    # (the H200's B=256 R-KV row was divided by B=64's dense before this)
    mixed = [_row("none", 4096, 2.0, batch=64), _row("rkv", 4096, 1.0, batch=64), _row("rkv", 4096, 4.0, batch=256)]
    bench.add_speedups(mixed)
    assert [r["speedup_vs_dense"] for r in mixed[:2]] == pytest.approx([1, 2]) and mixed[2]["speedup_vs_dense"] is None
    mixed.append(_row("none", 4096, 5.0, batch=256))
    bench.add_speedups(mixed)
    assert [r["speedup_vs_dense"] for r in mixed] == pytest.approx([1, 2, 1.25, 1])


def test_gpu_profile_dry_run_lowers(bench):
    report = bench.main(["--profile", "gpu", "--dry-run", "--policies", "none", "snapkv"])
    dry = report["dry_run"]
    assert 1.5e9 < dry["n_params_full"] < 1.6e9  # Qwen2.5-1.5B shape
    assert {(r["policy"], r["n_layers"]) for r in dry["lowered"]} == {("none", 2), ("snapkv", 2)}
    assert all(r["hlo_chars"] > 0 for r in dry["lowered"])
    full = {(r["policy"], r["new_tokens"]): r for r in dry["full_size_rows"]}
    assert full[("snapkv", 8192)]["kv_capacity"] == 512 + 128
    assert full[("none", 8192)]["kv_bytes"] > 10 * full[("snapkv", 8192)]["kv_bytes"]
    # 64 sequences x 28 layers x (K and V) x 2 heads x 640 slots x 128 dims x 2 bytes (bf16)
    assert full[("snapkv", 8192)]["kv_bytes"] == 64 * 28 * 2 * 2 * 640 * 128 * 2


def test_markdown_keeps_error_rows_out_of_the_figures(bench):
    prof = bench.PROFILES["cpu"]
    rows = [
        _row("none", 8192, 9.0),
        _row("snapkv", 8192, 1.5),
        dict(policy="rkv", new_tokens=8192, batch=4, error="XlaRuntimeError: out of memory"),
    ]
    bench.add_speedups(rows)
    assert "speedup_vs_dense" not in rows[2]
    report = dict(
        profile="cpu",
        platform="cpu",
        device_kind="cpu",
        jax_version="x",
        date="d",
        command="c",
        total_s=1.0,
        model=bench.dataclasses.asdict(prof.model),
        setting=dict(
            batch=4, prompt_len=64, budget=256, buffer=64, window=8, repeats=1, min_seconds=0.0, attn_impl="auto"
        ),
        results=rows,
        acceptance=bench.acceptance(rows, prof),
    )
    assert report["acceptance"]["speedup_at_target"] == pytest.approx({"snapkv": 6.0})
    md = bench.markdown(report)
    assert "| rkv | 8192 | 4 | error: XlaRuntimeError: out of memory |" in md
    assert "snapkv 6.00x" in md and "PASS" in md


def test_quantized_rows_record_weight_bytes_and_lower_to_low_precision_dots(bench, tmp_path):
    out = tmp_path / "bench.json"
    argv = [
        "--profile",
        "cpu",
        "--n-layers",
        "1",
        "--batch",
        "2",
        "--prompt-len",
        "8",
        "--lengths",
        "16",
        "--budget",
        "8",
        "--buffer",
        "8",
        "--window",
        "2",
        "--policies",
        "streaming",
        "--quant",
        "none",
        "int8",
        "--min-seconds",
        "0",
        "--out",
        str(out),
    ]
    rows = bench.main(argv)["results"]
    assert [(r["policy"], r["quant"]) for r in rows] == [("streaming", "none"), ("streaming", "int8")]
    full, q = rows
    assert full["speedup_vs_full_precision"] == 1.0 and q["speedup_vs_full_precision"] > 0
    assert q["weight_bytes"] < full["weight_bytes"]  # f32 kernels -> int8 + per-channel scales
    assert "| streaming | 16 | 2 |" in out.with_suffix(".md").read_text()
    assert "| int8 |" in out.with_suffix(".md").read_text()
    dry = bench.main(["--profile", "cpu", "--dry-run", "--policies", "none", "--quant", "w8a16", "int8", "fp8"])[
        "dry_run"
    ]["lowered"]
    dots = {r["quant"]: r["low_precision_dots"] for r in dry}
    assert dots["w8a16"] == 0 and dots["int8"] > 0 and dots["fp8"] > 0  # 7 per layer and phase


def test_draw_rows_and_the_step_against_its_bounds(bench, tmp_path):
    """--draws gives a row per draw, each against the Gumbel row of its kind; --bounds measures the
    host once and puts each row's step against its FLOPs and bytes (no timing asserted)."""
    out = tmp_path / "bench.json"
    argv = ["--profile", "cpu", "--n-layers", "1", "--vocab", "1024", "--batch", "2", "--prompt-len", "8"]
    argv += ["--lengths", "16", "--policies", "none", "--draws", "gumbel", "inverse_cdf", "--bounds"]
    argv += ["--min-seconds", "0", "--out", str(out)]
    bench.main(argv)
    saved = json.loads(out.read_text())
    gumbel, icdf = saved["results"]
    assert (gumbel["draw"], icdf["draw"]) == ("gumbel", "inverse_cdf") and saved["setting"]["draws"] == [
        "gumbel",
        "inverse_cdf",
    ]
    assert gumbel["speedup_vs_gumbel"] == 1.0 and icdf["speedup_vs_gumbel"] == pytest.approx(
        icdf["tokens_per_s"] / gumbel["tokens_per_s"]
    )
    host = saved["host"]
    assert host["peak_flops"] > 0 and host["read_bytes_per_s"] > 0
    _, prof = bench.resolve(bench.parse_args(argv))
    for r in (gumbel, icdf):
        b = r["bounds"]
        assert b["flops"] == bench.decode_bounds.step_flops(prof.model, 2, 8 + 8)  # dense: prompt + half the tokens
        assert b["compute_ms"] == pytest.approx(b["flops"] / host["peak_flops"] * 1e3)
        assert b["step_over_bound"] == pytest.approx(r["step_ms"] / max(b["compute_ms"], b["bandwidth_ms"]))
    md = out.with_suffix(".md").read_text()
    assert "## The step against its bounds" in md and md.count("| inverse_cdf |") == 2


def test_the_bounds_count_every_matmul_weight_once():
    """model.config.matmul_params: every weight of rank 2 or more the step multiplies by (biases are added; the LM head once, tied
    or not; the input embedding, a gather, not at all)."""
    import jax

    from sparserl_jax.model import transformer
    from sparserl_jax.model.config import matmul_params

    for name in ("cpu", "smollm2"):
        m = dataclasses.replace(decode_bench.PROFILES[name].model, n_layers=2)
        shapes = jax.eval_shape(lambda k, m=m: transformer.init_params(m, k), jax.random.key(0))
        leaves = jax.tree_util.tree_leaves_with_path(shapes)
        n = sum(
            math.prod(x.shape)
            for path, x in leaves
            if len(x.shape) >= 2 and not jax.tree_util.keystr(path).endswith("_bias']")
        )
        if not m.tie_embeddings:
            n -= m.vocab_size * m.d_model
        assert matmul_params(m) == n, name
    from sparserl_jax.model.hf_config import config_from_hf

    arch = os.path.join(os.path.dirname(__file__), "..", "experiments", "configs", "real", "arch")
    with open(os.path.join(arch, "smollm2-135m-instruct.json")) as f:
        hf = config_from_hf(json.load(f), dtype="float32")
    smol = decode_bench.PROFILES["smollm2"].model  # SmolLM2-135M's shape, less its token ids
    assert smol == dataclasses.replace(hf, norm_eps=1e-5, bos_token_id=None, eos_token_ids=(), pad_token_id=0)
