"""The real-scale configs and the dry-run memory report (shapes only, nothing allocated)."""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import jax
import jax.numpy as jnp
import pytest

from sparserl_jax import dryrun
from sparserl_jax.config import load_config
from sparserl_jax.model import sharding, transformer
from sparserl_jax.model.config import ModelConfig, param_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL = os.path.join(ROOT, "experiments", "configs", "real")
PUBLISHED = {  # parameters, as the model cards state them
    "qwen2.5-1.5b": 1.54e9,
    "qwen2.5-3b": 3.09e9,
    "qwen2.5-7b": 7.62e9,
    "llama-3.2-1b-instruct": 1.24e9,
}
MESHES = ("1gpu", "8gpu", "tpu_pod")


def real(model: str, mesh: str | None = None, *overrides: str):
    paths = [f"{REAL}/{model}.yaml"] + ([f"{REAL}/mesh/{mesh}.yaml"] if mesh else [])
    return load_config(paths, overrides)


def arch(model: str) -> str:
    return f"{REAL}/arch/{model}.json"


def run(model: str, mesh: str, *overrides: str, **kw) -> dict:
    return dryrun.dry_run(real(model, mesh, *overrides), arch=arch(model), **kw)


def test_every_real_config_loads_with_every_overlay():
    # smollm2_*.yaml: the CPU configs of the 135M model (tests/test_chat_arithmetic.py), no overlays
    models = sorted(
        os.path.basename(p)[:-5] for p in glob.glob(f"{REAL}/*.yaml") if not os.path.basename(p).startswith("smollm2_")
    )
    assert models == sorted(PUBLISHED)
    for model in models:
        for mesh in MESHES:
            cfg = load_config([f"{REAL}/{model}.yaml", f"{REAL}/mesh/{mesh}.yaml", f"{REAL}/policy/snapkv.yaml"])
            assert cfg.kv.policy == "snapkv" and cfg.kv.budget == 512 and cfg.kv.buffer == 128
            assert cfg.rollout.prompts * cfg.rollout.samples == 1024
            assert cfg.rollout.rows_per_call == {"1gpu": 64, "8gpu": 512, "tpu_pod": 0}[mesh]
            assert cfg.rl.optim.lr == 1e-6 and cfg.rl.loss.beta == 1e-4
            assert cfg.model.dtype == "bfloat16" and cfg.data.dataset.endswith(".jsonl")
        assert real(model, "8gpu").mesh == sharding.MeshConfig(data=1, fsdp=8, tensor=1)


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_param_counts_match_published(model):
    m, _ = dryrun.model_config(real(model), arch(model))
    n = param_count(m)
    assert abs(n - PUBLISHED[model]) / PUBLISHED[model] < 0.01, (model, n)
    shapes = sharding.abstract_params(m)  # the closed form agrees with the model's own init
    assert sum(x.size for x in jax.tree.leaves(shapes)) == n
    # bfloat16 compute over float32 master weights (model/precision.py): init gives the master
    assert (m.dtype, m.param_dtype) == ("bfloat16", "float32")
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(shapes))


def test_llama_arch_has_llama3_rope_and_head_dim():
    m, _ = dryrun.model_config(real("llama-3.2-1b-instruct"), arch("llama-3.2-1b-instruct"))
    assert (m.head_dim, m.rope_theta, m.tie_embeddings) == (64, 500000.0, True)
    assert m.rope_scaling.factor == 32.0 and m.rope_scaling.original_max_position_embeddings == 8192


def item(rep: dict, name: str) -> int:
    return next(i["bytes"] for i in rep["items"] if i["name"] == name)


def test_fsdp_divides_params_and_optimizer_state():
    whole = "rollout.rows_per_call=0"  # every row in one sampler call on both meshes
    one, eight = run("qwen2.5-7b", "1gpu", whole), run("qwen2.5-7b", "8gpu", whole)
    p1, p8 = item(one, "params (theta)"), item(eight, "params (theta)")
    n = param_count(dryrun.model_config(real("qwen2.5-7b"), arch("qwen2.5-7b"))[0])
    assert p1 == n * 4  # the float32 master; its bfloat16 compute copy and pi_ref half that
    assert item(one, "compute copy of params") == item(one, "reference params (pi_ref)") == n * 2
    assert 7.95 < p1 / p8 <= 8.0  # norms (replicated) are the only unsplit leaves
    o1, o8 = item(one, "optimizer state"), item(eight, "optimizer state")
    assert abs(o1 - 2 * p1) < 1024 and abs(o8 - 2 * p8) < 1024  # Adam's mu and nu, like params
    # the rollout batch splits 8 ways too: the KV cache per device shrinks 8x
    assert item(one, "KV cache (rollout)") == 8 * item(eight, "KV cache (rollout)")


def test_tensor_axis_splits_heads_and_mlp():
    base = run("qwen2.5-7b", "8gpu")
    tp = run("qwen2.5-7b", "8gpu", "mesh.fsdp=4", "mesh.tensor=2", "rl.update.micro_batch_size=8")
    assert item(tp, "params (theta)") == pytest.approx(item(base, "params (theta)"), rel=0.01)
    assert tp["shapes"]["rows_per_device"]["micro_batch"] == 2 == base["shapes"]["rows_per_device"]["micro_batch"]
    # same rows per device: heads, MLP and vocabulary split 2 ways, [b, T, D] not
    assert 0.5 < item(tp, "update activations") / item(base, "update activations") < 0.8


def test_sparse_cache_is_much_smaller_than_dense():
    rep = run("qwen2.5-1.5b", "8gpu")
    s = rep["shapes"]
    # kv.compress_prompt=false (the authors'): a 1024-token prompt stays whole until the first
    # decode-time compression, so the cache holds prompt + buffer slots, not budget + buffer
    assert (s["cache_capacity"], s["dense_capacity"]) == (1024 + 128, 1024 + 4096)
    squeezed = run("qwen2.5-1.5b", "8gpu", "kv.compress_prompt=true")["shapes"]
    assert squeezed["cache_capacity"] == 512 + 128
    # (its prefill still builds a prompt-sized cache before squeezing it: 1024 slots, not 1152)
    assert squeezed["sparse_cache_bytes"] < s["sparse_cache_bytes"]
    assert s["sparse_cache_bytes"] * 4 < s["dense_cache_bytes"]
    assert rep["dense_rollouts"]["peak_bytes"] > rep["peak_bytes"]
    short = run("qwen2.5-1.5b", "8gpu", prompt_len=256)  # budget 512 + buffer 128 vs 256 + 4096
    assert short["shapes"]["cache_capacity"] == 640
    assert short["shapes"]["sparse_cache_bytes"] * 6 < short["shapes"]["dense_cache_bytes"]


def test_cache_bytes_match_the_formula():
    for rows_per_call in (0, 64):  # the cache holds one sampler call's rows
        rep = run("qwen2.5-1.5b", "1gpu", "kv.policy=streaming", f"rollout.rows_per_call={rows_per_call}")
        m, b = rep["model"], rows_per_call or 1024  # streaming: no policy state besides pos
        assert rep["shapes"]["rows_per_call"] == b and rep["shapes"]["rollout_calls"] == 1024 // b
        C = rep["shapes"]["cache_capacity"]
        kv_bytes = b * C * 2 * m["n_layers"] * m["n_kv_heads"] * m["head_dim"] * 2
        pos_bytes = b * C * m["n_layers"] * m["n_kv_heads"] * 4
        assert item(rep, "KV cache (rollout)") == kv_bytes + pos_bytes + 2 * b * 4


def test_rows_per_call_scales_the_rollout_phase_only():
    full, half = (run("qwen2.5-1.5b", "1gpu", f"rollout.rows_per_call={n}") for n in (128, 64))
    for name in ("KV cache (rollout)", "prefill activations", "decode step + compression", "rollout outputs"):
        assert item(half, name) * 2 == item(full, name), name
    assert half["phase_bytes"]["rollout"] < full["phase_bytes"]["rollout"]
    for phase in ("persistent", "score", "update"):
        assert half["phase_bytes"][phase] == full["phase_bytes"][phase], phase
    assert item(half, "update batch") == item(full, "update batch")  # every row, whatever the calls
    assert half["shapes"]["rows_per_device"]["rollout_call"] == 64
    assert half["rollout"] == {"rows": 1024, "rows_per_call": 64, "calls": 16}
    md = dryrun.to_markdown(half)
    assert "1024 rows in 16 sampler call(s) of 64 (rollout.rows_per_call=64)" in md
    # without chunking the same config does not fit one GPU: the rollout phase sets the peak
    whole = run("qwen2.5-1.5b", "1gpu", "rollout.rows_per_call=0")
    assert not whole["fits"] and whole["peak_phase"] == "rollout"


def test_1gpu_overlay_fits_every_model_whose_update_fits():
    """With the 1gpu overlay's rows_per_call a model fits one 80 GiB GPU exactly when its
    persistent state + update phase does: the update sets the peak of the models that do not fit
    (7B: its float32 master, compute copy, reference copy and AdamW state alone exceed the budget);
    with the fused attention (auto in bfloat16) 1.5B, Llama 1B and 3B fit."""
    for model in sorted(PUBLISHED):
        rep = run(model, "1gpu")
        pb = rep["phase_bytes"]
        update_fits = pb["persistent"] + pb["update"] <= rep["budget_bytes"]
        assert rep["fits"] == update_fits == (model != "qwen2.5-7b"), model
        if not rep["fits"]:
            assert rep["peak_phase"] == "update" and pb["persistent"] > rep["budget_bytes"], model
    for model in sorted(PUBLISHED):  # and every model fits its 8gpu overlay
        assert run(model, "8gpu")["fits"], model


def test_donation_saves_one_copy_of_params_and_optimizer_state():
    """rl.update.donate (the default): the update's new params, compute copy and AdamW state
    reuse the old buffers; without it both coexist, and Qwen2.5-3B no longer fits one 96 GiB GPU."""
    donated, kept = (run("qwen2.5-3b", "1gpu", *o, device_memory_gib=96) for o in ((), ("rl.update.donate=false",)))
    extra = item(kept, "params (theta)") + item(kept, "optimizer state") + item(kept, "compute copy of params")
    assert item(donated, "update outputs") == 0 and item(kept, "update outputs") == extra
    assert kept["phase_bytes"]["update"] - donated["phase_bytes"]["update"] == extra
    for phase in ("persistent", "rollout", "score"):
        assert kept["phase_bytes"][phase] == donated["phase_bytes"][phase], phase
    assert donated["fits"] and not kept["fits"]


def test_small_device_memory_does_not_fit_and_large_does():
    small = run("qwen2.5-1.5b", "8gpu", device_memory_gib=8)
    assert not small["fits"] and small["peak_bytes"] > small["budget_bytes"]
    assert "does not fit" in dryrun.to_markdown(small)
    big = run("qwen2.5-1.5b", "8gpu", device_memory_gib=1000)
    assert big["fits"] and "**Peak" in dryrun.to_markdown(big) and "does not fit**" not in dryrun.to_markdown(big)
    assert big["peak_bytes"] == small["peak_bytes"]


def test_peak_is_persistent_plus_largest_phase():
    rep = run("qwen2.5-3b", "8gpu")
    pb = rep["phase_bytes"]
    assert rep["peak_bytes"] == pb["persistent"] + max(pb["rollout"], pb["score"], pb["update"])
    persistent = sum(i["bytes"] for i in rep["items"] if i["phase"] == "persistent")
    assert pb["persistent"] == persistent


def test_bad_settings_error_clearly(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        dryrun.dry_run(real("qwen2.5-1.5b", "1gpu"), arch=str(bad))
    with pytest.raises(FileNotFoundError, match="--arch"):  # checkpoint absent on this machine
        dryrun.dry_run(real("qwen2.5-1.5b", "1gpu"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        dryrun.dry_run(real("qwen2.5-1.5b", "1gpu"), arch=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="mesh.data=-1"):  # no mesh overlay, no --devices
        dryrun.dry_run(real("qwen2.5-1.5b"), arch=arch("qwen2.5-1.5b"))
    with pytest.raises(ValueError, match="rl.update.micro_batch_size=4 is not a multiple of mesh"):
        run("qwen2.5-1.5b", "8gpu", "rl.update.micro_batch_size=4")
    with pytest.raises(ValueError, match="rollout.rows_per_call=4 is not a multiple of mesh"):
        run("qwen2.5-1.5b", "8gpu", "rollout.rows_per_call=4")
    with pytest.raises(ValueError, match=r"rollout\.rows_per_call=48 must be 0 .* or a divisor"):
        run("qwen2.5-1.5b", "1gpu", "rollout.rows_per_call=48")
    with pytest.raises(ValueError, match="max_seq_len"):
        run("qwen2.5-3b", "8gpu", "rollout.max_new_tokens=40000")
    with pytest.raises(ValueError, match="device-memory-gib"):
        run("qwen2.5-1.5b", "8gpu", device_memory_gib=0)
    with pytest.raises(ValueError, match="mesh.fsdp=3"):
        dryrun.dry_run(
            real("qwen2.5-1.5b", "8gpu", "mesh.data=-1", "mesh.fsdp=3"), arch=arch("qwen2.5-1.5b"), devices=8
        )


def test_cli_writes_markdown_and_json_with_its_command(tmp_path, capsys):
    argv = [
        "--config",
        f"{REAL}/qwen2.5-1.5b.yaml",
        "--config",
        f"{REAL}/mesh/8gpu.yaml",
        "--arch",
        arch("qwen2.5-1.5b"),
        "--device-memory-gib",
        "80",
        "--out-json",
        str(tmp_path / "r.json"),
        "--out-md",
        str(tmp_path / "r.md"),
    ]
    dryrun.main(argv)
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["command"].startswith("python -m sparserl_jax.dryrun --config")
    assert rep["devices"] == 8 and rep["fits"] is True
    md = (tmp_path / "r.md").read_text()
    assert rep["command"] in md and "| KV cache (rollout) |" in md
    assert "fits" in capsys.readouterr().out


def test_committed_reports_match_the_code():
    """experiments/results/dryrun/*.json were produced by this code (re-run dryrun_all.py if not)."""
    from experiments.bench import dryrun_all

    paths = sorted(glob.glob(os.path.join(ROOT, "experiments/results/dryrun/*.json")))
    assert len(paths) == len(dryrun_all.MODELS) * len(dryrun_all.MESHES)
    for path in paths[::4]:  # a spread of models and meshes
        with open(path) as f:
            old = json.load(f)
        model, mesh = (
            os.path.basename(path)[:-5].rsplit("_", 1)
            if "tpu_pod" not in path
            else (os.path.basename(path)[: -len("_tpu_pod.json")], "tpu_pod")
        )
        new = run(model, mesh, device_memory_gib=old["device_memory_gib"])
        assert new["peak_bytes"] == old["peak_bytes"] and new["fits"] == old["fits"]
        assert new["rollout"] == old["rollout"] and new["phase_bytes"] == old["phase_bytes"]


@pytest.mark.parametrize("remat", [False, True])
def test_activation_estimate_against_compiled_memory(remat):
    """Cross-check the update-activation formula with XLA:CPU's buffer assignment of one
    micro-batch gradient (a small model, compiled from shapes). Without remat the formula is
    within 15%. With remat it is a lower bound: XLA:CPU schedules the recomputation without the
    saving (its temp is the no-remat size), GPU and TPU schedulers recompute per block."""
    m = ModelConfig.tiny(
        vocab_size=512, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=256, max_seq_len=1024
    )
    b, T = 2, 256

    def loss(params, tokens):
        lp, _ = transformer.token_logprobs(params, m, tokens, chunk_tokens=128, remat=remat)
        return jnp.sum(lp)

    compiled = (
        jax.jit(jax.grad(loss)).lower(sharding.abstract_params(m), jax.ShapeDtypeStruct((b, T), jnp.int32)).compile()
    )
    temp = compiled.memory_analysis().temp_size_in_bytes
    cfg = load_config(
        [os.path.join(ROOT, "experiments/configs/smoke.yaml")],
        [
            f"rl.update.micro_batch_size={b}",
            "rl.update.minibatch_size=16",
            f"rl.update.remat={remat}",
            "rl.update.chunk_tokens=128",
            f"data.max_prompt_len={T - 64}",
            "rollout.max_new_tokens=64",
        ],
    )
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, arch=m))
    items, facts = dryrun.estimate(cfg, m, {"data": 1, "fsdp": 1, "tensor": 1})
    est = next(i.bytes for i in items if i.name == "update activations")
    if not remat:
        assert abs(est - temp) / temp < 0.15, (est, temp)
    else:
        assert est < temp <= 1.15 * facts["update_activations_no_remat"], (est, temp)


def test_rollout_layouts_copy_and_the_fused_attentions_linear_scores():
    """rollout.mesh=data adds the whole bfloat16 compute copy on every device to the rollout phase
    (tensor:2 half of it) and, decoding from whole weights, no fsdp gathers there; train adds no
    copy and gathers as the scoring pass does. The update's activations with a fused attention
    (auto in bfloat16: cuDNN / splash / blockwise) hold no [T, T] scores: XLA's materialised
    attention adds the recomputed layer's f32 [T, T] scores and its bf16 probabilities (b Nt T^2 x
    6 bytes, XLA:TPU's plan) where the fused one keeps 2 layers' b Nt T float32 softmax statistics
    (the update then peaks at the head's moment, not a block's)."""
    n = param_count(dryrun.model_config(real("qwen2.5-1.5b"), arch("qwen2.5-1.5b"))[0])
    train, data = run("qwen2.5-1.5b", "8gpu"), run("qwen2.5-1.5b", "8gpu_rollout_data")
    tensor2 = run("qwen2.5-1.5b", "8gpu", "rollout.mesh=tensor:2")
    assert "rollout copy of params" not in {i["name"] for i in train["items"]}
    assert item(data, "rollout copy of params") == 2 * n  # bfloat16, every leaf whole
    assert abs(item(tensor2, "rollout copy of params") - n) < 0.01 * n  # split in 2 (norms whole)
    gathers = item(train, "fsdp all-gather buffers")
    assert gathers > 0 and "rollout" in next(
        i["phase"] for i in train["items"] if i["name"] == "fsdp all-gather buffers"
    )
    assert data["phase_bytes"]["rollout"] - train["phase_bytes"]["rollout"] == 2 * n - gathers
    assert data["phase_bytes"]["score"] == train["phase_bytes"]["score"]  # the scoring pass gathers on both
    fused, xla = run("qwen2.5-1.5b", "8gpu"), run("qwen2.5-1.5b", "8gpu", "model.attention=xla")
    m = dryrun.model_config(real("qwen2.5-1.5b", "8gpu"), arch("qwen2.5-1.5b"))[0]
    b, T = 2, 1024 + 4096  # the overlay's 16-row micro-batch over 8 devices; prompt + response
    scores, stats = b * m.n_heads * T * T * (4 + 2), 2 * b * m.n_heads * T * 4
    # the recomputed layer's scores, less what of them the head's moment (the larger one with a
    # fused attention) already covered: at most the head's chunk buffers and its weight's copies
    head = 2 * b * T * m.d_model * 2 + 3 * 1024 * m.vocab_size * 4 + m.vocab_size * m.d_model * (4 + 2 + 2)
    diff = item(xla, "update activations") - item(fused, "update activations")
    assert scores - stats - head <= diff <= scores - stats


def test_scanned_layers_add_their_stacked_copy_to_the_learners_phases_only():
    """model.scan_layers stacks the layers' compute weights inside the scoring and update programs
    (transformer._run_blocks): the dry run adds that copy, the layers' bf16 bytes over the fsdp
    shards, to those two phases and nothing to the rollout (prefill and decode stay unrolled); the
    update no longer keeps the MLP activations XLA:TPU keeps for unrolled layers under fsdp."""
    m = dryrun.model_config(real("qwen2.5-1.5b"), arch("qwen2.5-1.5b"))[0]
    layers = param_count(m) - m.vocab_size * m.d_model - m.d_model  # tied embedding, final norm
    plain, scanned = run("qwen2.5-1.5b", "8gpu"), run("qwen2.5-1.5b", "8gpu", "model.scan_layers=true")
    stacked = item(scanned, "stacked layer weights")
    assert "stacked layer weights" not in {i["name"] for i in plain["items"]}
    assert abs(stacked - 2 * layers / 8) < 0.01 * stacked  # bfloat16, split 8 ways
    # unrolled under fsdp XLA:TPU keeps each block's MLP activation (b = 16 rows / 8, T = 1024 + 4096);
    # a scan recomputes it inside each iteration
    hoisted = m.n_layers * 2 * (1024 + 4096) * m.d_ff * 2
    for phase, extra in (("score", stacked), ("update", stacked - hoisted), ("rollout", 0)):
        assert scanned["phase_bytes"][phase] - plain["phase_bytes"][phase] == extra, phase
