"""The device check (experiments/device/gpu_check.py): its --smoke run goes through every step on CPU and
reports a failure as one, the guard records timeouts and crashes and goes on, and the full-size
programs it will run on a GPU build and lower for cuda here."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from experiments.device import gpu_check, gpu_e2e, gpu_iteration, gpu_profile, gpu_report, gpu_sizes, gpu_update
from sparserl_jax.kernels.decode_attention_gpu import TRITON_AVAILABLE

CHECK = Path(__file__).parent.parent / "experiments" / "device" / "gpu_check.py"

FORCED = "numerics"


@pytest.mark.extended
@pytest.mark.slow
def test_smoke_runs_every_step_and_a_forced_failure_reads_fail(tmp_path):
    """`--smoke --fail numerics`: every step runs in its own process at toy shapes and leaves its
    figure; the forced failure is one line, the next step still runs, the report reads FAIL and the
    exit code is non-zero."""
    proc = subprocess.run(
        [sys.executable, str(CHECK), "--smoke", "--out", str(tmp_path), "--fail", FORCED],
        capture_output=True,
        text=True,
        timeout=gpu_check.TIME_LIMITS["smoke"] + 120,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == list(gpu_check.BUDGETS["smoke"]) == list(gpu_check.TITLES)
    for name, s in steps.items():
        assert s.get("figure"), (name, s.get("error"))  # every step measured, the failed one too
        assert (s["status"] == "fail") == (name == FORCED), (name, s["status"], s.get("error"))
        assert all(c["passed"] for c in s["checks"] if c["kind"] == "must"), (name, s["checks"])
        assert os.path.exists(s["log"]) and s["seconds"] <= s["budget_s"]
    assert steps[FORCED]["error"] == f"RuntimeError: forced failure (--fail {FORCED}), raised after the step ran"
    assert report["verdict"] == "FAIL" and report["finished"]
    md = (tmp_path / "report.md").read_text()
    n = len(gpu_check.TITLES)
    assert md.startswith(f"# Device check: cpu (smoke)\n\n**FAIL**: 1 of {n} steps failed: numerics.\n")
    assert "PASS" not in md.split("\n## ")[0]
    assert f"| {FORCED} | FAIL |" in md and steps[FORCED]["error"] in md
    assert proc.stdout.strip().splitlines()[-1].startswith(f"FAIL: 1 of {n} steps failed: numerics")
    # the figures themselves
    numerics = steps["numerics"]["result"]
    assert numerics["worst_ratio"]["o"] <= 1 and numerics["worst_ratio"]["lse"] <= 1
    row = numerics["rows"][0]
    assert row["plain/ragged"]["live_rows"] >= 1 and row["plain/empty"]["empty_rows_ok"]
    assert all(row[f"shard_map_identical/{f}"] for f in ("empty", "one", "ragged", "half", "full"))
    assert steps["bandwidth"]["result"]["rows"][0]["frac_of_copy"] > 0
    assert {r["policy"] for r in steps["sampler"]["result"]["rows"]} == {"rkv", "none"}
    (update,) = steps["update"]["result"]["variants"]  # the smoke size measures one attention
    assert update["attention"] == "xla"
    assert update["moved_fraction"] >= 0.9 and update["lr"] == 1e-6 and update["tokens_per_s"] > 0
    assert update["dryrun"]["persistent_plus_update"] > 0 and update["param_dtypes"] and update["compute_dtype"]
    resume = steps["e2e"]["result"]["resume"]
    assert resume["steps_a"] == resume["steps_b"] == [1, 2] and resume["max_rel_diff"] <= 1e-5
    assert "at iteration 1" in resume["resumed_line"]
    engine = steps["engine"]["result"]  # int8 beside the model's dtype, then the slot engine's row
    assert [(r["policy"], r["quant"]) for r in engine["int8_rows"]] == [
        ("none", "none"),
        ("none", "int8"),
        ("rkv", "none"),
        ("rkv", "int8"),
    ]
    assert all(r["tokens_per_s"] > 0 for r in engine["int8_rows"])
    assert engine["int8_rows"][1]["weight_bytes"] < engine["int8_rows"][0]["weight_bytes"]
    (row,) = engine["engine_rows"]
    assert row["forced_lengths_decoded"] == {"static": True, "engine": True} and row["engine_compiles"] == 0
    assert (tmp_path / "engine" / "engine.json").exists()
    env = steps["env"]["result"]
    assert env["backend"] == "cpu" and env["provenance"]["commit"] and "jax" in env["packages"]
    study = steps["study"]["result"]  # the collapse study's config trained and evaluated, its plan priced
    assert study["arms"]["sparse_rl"]["iteration_s"] > 0 and study["arms"]["sparse_rl"]["eval_s"] > 0
    assert study["plan"]["evaluations"] == 21 and study["plan"]["total_s"] > study["plan"]["train_s"] > 0
    profile = steps["profile"]["result"]  # every (batch, cache, candidates) case traced into its folder
    assert [(r["policy"], r["agreement_k"]) for r in profile["rows"]] == [
        ("rkv", 20),
        ("rkv", 0),
        ("none", 20),
        ("none", 0),
    ]
    for r in profile["rows"]:
        assert r["step_ms"] > 0 and r["compile_s"] > 0 and r["trace_files"] > 0, r
        assert any((tmp_path / r["trace"]).rglob("*.xplane.pb")), r["trace"]
    assert (tmp_path / "profile" / "profile.json").exists()
    iteration = steps["iteration"]["result"]  # one trainer iteration, its phases apart
    for k in ("compile_s", "rollout_s", "score_s", "update_s", "rollout_tokens_per_s"):
        assert iteration[k] > 0, (k, iteration)
    assert iteration["rows"] == 16 and np.isfinite(iteration["loss"]) and iteration["skipped"] == 0


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_runner_records_a_timeout_and_a_crash_and_goes_on(tmp_path):
    """A step past its budget is killed, a step that dies leaves one line, the next runs; the
    report is written before and after every step and never reads PASS with a failure."""
    verdict = json.dumps({"status": "ok", "figure": "42 widgets/s", "checks": [], "markdown": ["done"]})
    commands = {
        "slow": _python("import time; time.sleep(60)"),
        "crash": _python("import os; print('about to abort', flush=True); os.abort()"),
        "good": _python(f"open({str(tmp_path / 'steps' / 'good.json')!r}, 'w').write({verdict!r})"),
    }
    steps = [
        gpu_report.Step("slow", "sleeps", 2),
        gpu_report.Step("crash", "aborts", 30),
        gpu_report.Step("good", "works", 30),
    ]
    runner = gpu_report.Runner(
        str(tmp_path),
        steps,
        lambda s: commands[s.name],
        mode="test",
        command_line="test",
        time_limit_s=120,
        log=lambda *a, **k: None,
    )
    assert runner.run() == 1
    report = json.loads((tmp_path / "report.json").read_text())
    slow, crash, good = report["steps"]
    assert slow["status"] == "fail" and slow["error"].startswith("timed out: killed after") and slow["seconds"] < 15
    assert crash["status"] == "fail" and crash["error"] == (
        "the step's process died (signal SIGABRT) without a verdict; last output: about to abort"
    )
    assert good["status"] == "ok" and good["figure"] == "42 widgets/s"
    assert report["verdict"] == "FAIL"
    assert "**FAIL**: 2 of 3 steps failed: slow, crash." in (tmp_path / "report.md").read_text()


def test_a_command_past_its_time_is_killed_with_its_children():
    """The e2e step runs default.py (and its worker processes) this way."""
    code = "import subprocess, time; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); time.sleep(60)"
    rc, tail = gpu_e2e.run_killing_group(_python(code), dict(os.environ), 2)
    assert rc is None and tail.endswith("timed out after 2 s")
    stat = Path(f"/proc/{int(tail.split()[0])}/stat")  # the grandchild: gone, or a zombie not yet reaped

    def dead() -> bool:
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            return True

    deadline = time.monotonic() + 10  # SIGKILL is delivered, not awaited
    while not dead() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dead()


@pytest.mark.parametrize(
    "statuses,word",
    [
        (["ok", "ok"], "PASS"),
        (["ok", "warn"], "PASS with warnings"),
        (["warn", "fail"], "FAIL"),
        (["ok", "skipped"], "INCOMPLETE"),
        (["ok", "running"], "INCOMPLETE"),
        (["fail", "pending"], "FAIL"),
    ],
)
def test_the_verdict_is_green_only_when_every_step_ran_and_none_failed(statuses, word):
    steps = [{"name": f"s{i}", "status": s} for i, s in enumerate(statuses)]
    assert gpu_report.verdict(steps)[0] == word


def test_the_docstring_states_every_step_and_its_budgets():
    doc = gpu_check.__doc__
    for name in gpu_check.TITLES:
        cells = [str(gpu_check.BUDGETS[m].get(name, "-")) for m in ("full", "quick", "smoke")]
        assert re.search(rf"^  {name} +{cells[0]} / +{cells[1]} / {cells[2]} ", doc, re.MULTILINE), name
    for mode, limit in gpu_check.TIME_LIMITS.items():
        assert sum(gpu_check.BUDGETS[mode].values()) <= limit, mode  # the steps fit the check's limit
    assert "{full} / {quick} / {smoke} s".format(**gpu_check.TIME_LIMITS) in doc
    for name, budget in gpu_check.ON_REQUEST.items():  # a step outside the whole check: its budget stated
        assert name not in gpu_check.BUDGETS["full"] and re.search(rf"^  {name} .*: {budget} s on a GPU", doc, re.M)
    # the whole check inside one 10-minute command on a lent GPU machine, with room for the install
    assert gpu_check.TIME_LIMITS["full"] <= 10 * 60 - 30 and gpu_check.TIME_LIMITS["quick"] <= 3 * 60


def test_the_full_size_update_config_builds_and_the_dry_run_plans_it():
    """The update step's real config (the 1-GPU overlay and the check's overrides) loads and the
    dry run it is compared with plans it (on a GPU it would otherwise fail there)."""
    from sparserl_jax.config import load_config
    from sparserl_jax.dryrun import dry_run

    sizes = gpu_sizes.SIZES["full"]
    update = {}
    for attention in sizes.update_attention:
        cfg = load_config(list(sizes.update_configs), [*sizes.update_overrides, f"model.attention={attention}"])
        assert cfg.rl.update.micro_batch_size == 4 and cfg.rl.optim.lr == 1e-6
        plan = dry_run(cfg, arch=sizes.update_arch, devices=1)
        assert plan["model"]["n_layers"] == 28 and plan["shapes"]["update_width"] == 1024 + 4096
        update[attention] = plan["phase_bytes"]["update"]
    # fused attention keeps no [T, T] buffers: the plan drops the recomputed layer's f32 scores and
    # bf16 probabilities (remat), less what the head's moment (then the larger one) covers: at most
    # its chunk buffers and its weight's copies
    b, N, T, D, V = 4, 12, 1024 + 4096, 1536, 151936
    scores, stats = b * N * T * T * (4 + 2), 2 * b * N * T * 4
    head = 2 * b * T * D * 2 + 3 * 1024 * V * 4 + V * D * (2 + 4)
    assert scores - stats - head <= update["xla"] - update["cudnn"] <= scores - stats


def test_an_update_variant_that_raises_is_recorded_and_the_next_runs(monkeypatch):
    """The update step measures each model.attention in turn (here with its measurement stubbed:
    the smoke run measures the real one): a variant that raises is one failed check naming it, and
    the next still runs; the refusal itself is causal_attention's, named by its setting."""
    from sparserl_jax.model import transformer

    with pytest.raises(ValueError, match="model.attention=cudnn needs a GPU"):
        q = np.zeros((1, 4, 2, 8), np.float32)
        transformer.causal_attention(q, q[:, :, :1], q[:, :, :1], implementation="cudnn")

    def variant(sizes, attention, record):
        if attention == "cudnn":
            raise ValueError("model.attention=cudnn needs a GPU (jax's backend here is cpu)")
        record({"attention": attention, "partial": True})
        ok = gpu_report.check("weights moved", 1.0, ">= 0.9", True)
        return [ok], ["| what | value |"], "12 tok/s", {"attention": attention, "moved_fraction": 1.0}

    monkeypatch.setattr(gpu_update, "_update_variant", variant)
    sizes = dataclasses.replace(gpu_sizes.SIZES["smoke"], update_attention=("cudnn", "xla"))
    records = []
    checks, lines, figure, result = gpu_update.step_update(sizes, {}, records.append)
    assert [(c["name"], c["passed"]) for c in checks] == [
        ("[cudnn] model.attention=cudnn: the step compiles and runs", False),
        ("[xla] weights moved", True),
    ]
    assert "needs a GPU" in checks[0]["value"]
    assert [v["attention"] for v in result["variants"]] == ["cudnn", "xla"] and "error" in result["variants"][0]
    assert figure.startswith("cudnn: failed (ValueError") and figure.endswith("; xla: 12 tok/s")
    assert lines[0] == "### model.attention=cudnn" and "### model.attention=xla" in lines
    # recorded as it goes: the failed variant, then the next one's partial result beside it
    assert records[1] == {"variants": [result["variants"][0], {"attention": "xla", "partial": True}]}
    assert records[-1] == result


@pytest.mark.skipif(not TRITON_AVAILABLE, reason="this jax has no Pallas Triton")
def test_the_kernel_programs_lower_for_cuda_at_the_checks_shapes():
    """The numerics step's kernel calls, plain and under shard_map, exported for cuda from shapes
    (`python experiments/device/gpu_check.py --lower` does every step's programs, about a minute)."""
    from experiments.device import gpu_lower

    rows = gpu_lower.lower_all(gpu_sizes.SIZES["quick"], steps=("numerics",), log=lambda *a, **k: None)
    assert len(rows) == 2 * 2 * 2  # two models' heads x two batches x plain / shard_map
    assert all(r["ok"] and r["triton_calls"] == 1 for r in rows), [r for r in rows if not r["ok"]]


def test_the_programs_lowered_for_cuda_carry_a_gpus_dot_accumulation():
    """model.dot_accumulation=auto reads JAX's backend at trace time (here the CPU's: float32, the
    custom-VJP projections); the update and a sampler call lowered for cuda must be what a GPU host
    traces: bfloat16 projections with no float32-accumulated call (traced at full size, not lowered)."""
    from experiments.device import gpu_lower

    traced = {}
    for step, _, _, build in gpu_lower.programs(gpu_sizes.SIZES["full"]):
        if step in ("update", "sampler") and step not in traced:
            fn, args = build()
            traced[step] = str(fn.trace(*args).jaxpr)
    assert set(traced) == {"update", "sampler"}
    for step, text in traced.items():
        assert "bf16[" in text and "dot_general" in text, step
        assert "float32_accumulated" not in text, step


def test_the_study_step_runs_the_collapse_studys_config_and_prices_its_plan(tmp_path):
    """The `study` step's arms are the collapse study's runs (its config, the arm's overrides at the
    default setting, the evaluation as the study's) on the checkpoint it is given, and its plan's
    cost adds every planned iteration and evaluation (naive at Sparse-RL's seconds)."""
    from experiments.device import gpu_study
    from experiments.real import collapse as real_collapse

    with open(gpu_study.ARCH) as f:
        arch = json.load(f)
    assert (arch["num_hidden_layers"], arch["hidden_size"], arch["vocab_size"]) == (30, 576, 49152)
    study = real_collapse.SETTINGS[real_collapse.DEFAULT_SETTING]
    for arm in gpu_study.FULL.arms:
        cfg = gpu_study.arm_config(arm, str(tmp_path), str(tmp_path / arm), gpu_study.FULL, char_tokenizer=False)
        assert cfg.model.checkpoint == str(tmp_path) and cfg.train.iterations == gpu_study.FULL.iterations
        assert (cfg.rollout.prompts, cfg.rollout.samples, cfg.rollout.max_new_tokens) == (4, 8, 192)
        assert cfg.train.eval_temperature == 0 and cfg.rl.mode == real_collapse.ARMS[arm][0]
        if real_collapse.ARMS[arm][1]:
            assert f"kv.budget={cfg.kv.budget}" in study.kv and cfg.kv.policy == "rkv"
        else:
            assert cfg.kv.policy == "none"
    arms = {"dense": {"iteration_s": 2.0, "eval_s": 5.0}, "sparse_rl": {"iteration_s": 3.0, "eval_s": 7.0}}
    plan = gpu_study.plan_cost(arms)
    seeds, its = len(real_collapse.SEEDS), real_collapse.ITERATIONS
    assert plan["train_s"] == seeds * its * (2.0 + 3.0 + 3.0)
    assert plan["runs"] == 9 and plan["evaluations"] == seeds * (1 + 3 * (its // real_collapse.EVAL_EVERY)) == 21
    assert plan["total_s"] == plan["train_s"] + 21 * 6.0


def test_engine_bench_decodes_the_forced_lengths_in_both_arms():
    """The engine step's (and bench_sorted.py's) comparison at toy size: the static sampler and the
    slot engine decode one workload's forced lengths, the same tokens in both arms (5 requests in
    batches of Q = 2: a short last static batch), with nothing compiled inside the timed runs."""
    import jax

    from experiments.lib import engine_bench
    from sparserl_jax.model import transformer
    from sparserl_jax.model.config import ModelConfig

    with pytest.raises(ValueError, match="high <= max_new"):
        engine_bench.workload(4, max_new=8, short=(2, 12), long_frac=0.1)
    m = ModelConfig.tiny(
        "qwen2", vocab_size=64, max_seq_len=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64
    )
    limits_N = engine_bench.workload(5, max_new=12, short=(2, 6), long_frac=0.3)
    assert limits_N.max() == 12 and limits_N.min() >= 2  # one at the cap, the rest short
    prompts_NxP, plens_N = engine_bench.requests(5, prompt_len=6, vocab=64, min_len=2)
    row, lengths = engine_bench.compare(
        transformer.init_params(m, jax.random.key(0)),
        m,
        prompts_NxP,
        plens_N,
        limits_N,
        policy="rkv",
        slots=2,
        max_new=12,
        budget=4,
        buffer=4,
        window=2,
        segment_chunks=1,
    )
    assert lengths["engine"].tolist() == limits_N.tolist()
    assert lengths["static"].tolist() == limits_N.tolist()
    assert row["tokens"] == int(limits_N.sum())
    assert row["static_compiles"] == row["engine_compiles"] == 0
    assert 0 < row["static_bubble"] < 1
    assert all(0 <= row[f"engine_bubble_{k}"] < 1 for k in ("slots", "wall", "slots_until_drain", "wall_until_drain"))


def test_a_profile_case_that_raises_is_recorded_and_the_next_is_traced(tmp_path, monkeypatch):
    """The profile step at a toy size (one batch, dense only): the case with the top candidates
    is made to raise and is recorded with its error (the step's must check then fails, naming it);
    the next case still compiles, runs inside jax.profiler.trace and leaves its trace folder."""
    from experiments.lib import decode_bench

    real = decode_bench.bench_row

    def bench_row(*args, agreement_k=0, **kwargs):
        if agreement_k:
            raise RuntimeError("out of memory (forced)")
        return real(*args, agreement_k=agreement_k, **kwargs)

    monkeypatch.setattr(decode_bench, "bench_row", bench_row)
    monkeypatch.setattr(gpu_profile, "POLICIES", ("none",))
    sizes = dataclasses.replace(gpu_sizes.SIZES["smoke"], profile_batches=(1,), profile_steps=4)
    records = []
    checks, lines, figure, result = gpu_profile.step_profile(sizes, {"out": str(tmp_path)}, records.append)
    failed, ran = result["rows"]
    assert (failed["case"], failed["error"]) == ("b1_dense_k20", "RuntimeError: out of memory (forced)")
    assert ran["case"] == "b1_dense_k0" and ran["step_ms"] > 0 and "error" not in ran
    assert ran["trace_files"] > 0 and any((tmp_path / ran["trace"]).rglob("*.xplane.pb"))
    assert [(c["kind"], c["passed"]) for c in checks] == [("must", False), ("goal", False)]
    assert "b1_dense_k20: RuntimeError" in checks[0]["value"] and checks[1]["value"] == "n/a"
    assert any("| b1_dense_k20 |" in x and "error:" in x for x in lines) and figure.startswith("b1_dense_k0 ")
    assert records[-1] == {"rows": result["rows"]}
    assert json.loads((tmp_path / "profile" / "profile.json").read_text())["rows"] == result["rows"]


def test_the_full_size_iteration_config_builds_at_qwen_shape_without_weights(tmp_path):
    """The iteration step's real config (not run here: one Qwen2.5-1.5B iteration; the smoke run
    does the step at toy size): 64 rows of 1024 new tokens in one sampler call and one optimizer
    step, no checkpoint (random init at the arch file's shape), a task's prompts, no SFT."""
    from sparserl_jax import components

    cfg, overrides = gpu_iteration.iteration_config(gpu_sizes.SIZES["full"], str(tmp_path))
    m = cfg.model.arch
    assert cfg.model.checkpoint is None and (m.n_layers, m.d_model, m.vocab_size) == (28, 1536, 151936)
    assert (m.dtype, m.param_dtype) == ("bfloat16", "float32")
    r, u = cfg.rollout, cfg.rl.update
    assert (r.prompts * r.samples, r.max_new_tokens, r.call_rows) == (64, 1024, 64)
    assert u.minibatch_size == 64 and not u.compile_ahead and cfg.train.iterations == 1 and cfg.sft.steps == 0
    assert cfg.data.task == "arithmetic" and cfg.data.dataset is None and cfg.train.out_dir == str(tmp_path)
    components.check_lengths(cfg, m)  # what the trainer checks before it builds anything
    smoke, _ = gpu_iteration.iteration_config(gpu_sizes.SIZES["smoke"], str(tmp_path))
    assert smoke.model.checkpoint is None and smoke.train.iterations == 1 and smoke.sft.steps == 0
