"""experiments/real/mismatch.py end to end on a tiny HF checkpoint the test builds (random Qwen2
weights + the char tokenizer and its chat template): every measurement writes its table, JSON and
figure, and the numbers obey what they must (a budget above the length is the dense sampler, the
dense sampler against its own teacher-forced recompute is at the float noise floor, rates in
[0, 1], the engine decodes the static sampler's responses)."""

import json

import jax
import numpy as np
import pytest
from compile_cache import compile_cache_in_process
from float_tol import EPS32, logprob_tol
from hf_fixtures import make_tiny_hf_checkpoint

from experiments.real import mismatch, prompts, report, update_mask
from sparserl_jax import quant
from sparserl_jax.model import hf
from sparserl_jax.tokenizer import CharTokenizer

pytestmark = pytest.mark.xdist_group("real_mismatch")
jax.devices()  # the backend runs: workers.parallel_map runs the arms in this process


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(tmp_path_factory):
    """The arms rebuild the sampler and the scorer for every behaviour policy: with the session's
    compilation cache they compile once (tests/compile_cache.py)."""
    with compile_cache_in_process(tmp_path_factory):
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = make_tiny_hf_checkpoint("qwen2", tmp_path_factory.mktemp("real"))
    CharTokenizer().save(directory)
    return str(directory)


@pytest.fixture(scope="module")
def noise(checkpoint):
    """(log-prob, k3) float noise of the dense sampler against its teacher-forced recompute.

    Log-probs: float_tol.logprob_tol over <= 52 keys (40 prompt + 12 new tokens), about 3e-3
    for this checkpoint (measured: 1.9e-6). k3 = xi - log xi - 1 ~ d^2 / 2 for log xi = d, plus
    one float32 rounding of xi - log xi (an ulp of 1, EPS32; measured 0: 1 + d^2 / 2 rounds to 1
    for |d| < 3.4e-4). A real mismatch is far above: the tight-budget arms of test_eviction give
    |dlogp| up to 1.4-1.6 (mean 0.28-0.33), |k1| 0.009-0.09 and k3 0.10-0.17."""
    cfg, params = hf.load_params(checkpoint)
    logp = logprob_tol(cfg, params, keys=52)
    return logp, logp**2 / 2 + EPS32


def _outputs(out, name):
    for f in ("results.md", "results.json", f"{name}.png"):
        assert (out / f).stat().st_size > 0, f
    md = (out / "results.md").read_text()
    assert "Command: `python experiments/real/mismatch.py" in md
    return md, json.loads((out / "results.json").read_text())


def _in_unit(x):
    return 0.0 <= x <= 1.0


def test_eviction(checkpoint, noise, tmp_path):
    out = tmp_path / "eviction"
    mismatch.main(
        [
            "eviction",
            "--checkpoint",
            checkpoint,
            "--prompts",
            "4",
            "--max-new",
            "12",
            "--buffer",
            "4",
            "--budgets",
            "12",
            "256",
            "--policies",
            "streaming",
            "rkv",
            "--rows-per-call",
            "2",
            "--out",
            str(out),
        ]
    )
    md, data = _outputs(out, "eviction")
    rows = {r["arm"]["name"]: r for r in data["rows"]}
    assert set(rows) == {"dense", "streaming@12", "rkv@12", "streaming@256", "rkv@256"}
    for name in rows:
        assert f"| {name} |" in md
    for r in rows.values():
        assert all(_in_unit(r[k]) for k in ("token_reject", "veto", "seq_reject", "truncated"))
        # k3 >= 0; float32 can round xi - log xi one ulp (6e-8) below 1 per token
        assert r["kl_k3"] > -1e-6 and len(r["lengths"]) == 4 and max(r["lengths"]) <= 12
        assert r["tokens"] == sum(r["lengths"])
    # the dense sampler against its own teacher-forced recompute: float noise only (|k1| is at
    # most the mean |dlogp|), and so is a budget above prompt + response, which never evicts
    logp_noise, k3_noise = noise
    dense = rows["dense"]
    assert dense["kv_saving"] == 0 and dense["token_reject"] == 0
    for r in (dense, rows["streaming@256"], rows["rkv@256"]):
        assert r["abs_dlogp_max"] < logp_noise and abs(r["kl_k1"]) < logp_noise, r
        assert r["kl_k3"] < k3_noise and r["kv_saving"] == 0 and r["lengths"] == dense["lengths"]
    for pol in ("streaming", "rkv"):
        tight = rows[f"{pol}@12"]
        assert 0.3 < tight["kv_saving"] < 1 and tight["kl_k3"] > 100 * max(dense["kl_k3"], 1e-9)
        assert tight["abs_dlogp_max"] > 100 * logp_noise
    assert "tiny source" in md and "Sparse-RL (docs/methods.md#what-sparse-rl-reports)" in md
    assert "Provenance: commit" in md and data["provenance"]["cores"] >= 1  # recorded by the run
    report.rerender(str(out))  # the tables again from results.json: the same file
    assert (out / "results.md").read_text() == md


@pytest.mark.extended  # the eviction experiment runs the same measurement; test_quant the quantized sampler
def test_quantization(checkpoint, noise, tmp_path):
    out = tmp_path / "quantization"
    mismatch.main(
        [
            "quantization",
            "--checkpoint",
            checkpoint,
            "--prompts",
            "4",
            "--max-new",
            "8",
            "--buffer",
            "4",
            "--update-rows",
            "4",
            "--out",
            str(out),
        ]
    )
    md, data = _outputs(out, "quantization")
    names = [r["arm"]["name"] for r in data["rows"]]
    assert names[0] == "full precision" and len(names) == 9
    assert {"int8 w8a8", "fp8 w8a16", "int8 w8a8 s=1.5", "fp8 w8a16 s=1.5"} <= set(names)
    rows = {r["arm"]["name"]: r for r in data["rows"]}
    full = rows["full precision"]  # the dense sampler: float noise only
    logp_noise, k3_noise = noise  # over <= 44 keys: within the 52 the fixture assumes
    assert full["abs_dlogp_max"] < logp_noise and abs(full["kl_k1"]) < logp_noise
    assert full["kl_k3"] < k3_noise
    # W8A8 quantizes activations too: a larger departure from the dense policy than the noise floor
    assert rows["int8 w8a8"]["abs_dlogp_mean"] > 10 * rows["full precision"]["abs_dlogp_mean"]
    assert all(_in_unit(r["token_reject"]) and r["kl_k3"] > -1e-6 for r in rows.values())  # k3 >= 0
    assert [u["arm"]["invariant_s"] for u in data["updates"]] == [0.0, 1.5]
    for u in data["updates"]:
        assert u["skipped"] == 0 and u["weights_changed"] > 0.5  # Adam moves every weight
        for fmt in ("int8", "fp8"):
            assert all(_in_unit(v) for v in u["codes_changed"][fmt].values())
    assert "| s = 1.5 |" in md and "| off |" in md
    assert "QuRL (docs/methods.md#what-qurl-reports)" in md


def test_lengths(checkpoint, tmp_path):
    out = tmp_path / "lengths"
    mismatch.main(
        [
            "lengths",
            "--checkpoint",
            checkpoint,
            "--prompts",
            "4",
            "--max-new",
            "12",
            "--buffer",
            "4",
            "--slots",
            "2",
            "--out",
            str(out),
        ]
    )
    md, data = _outputs(out, "lengths")
    r = data["run"]
    assert r["same_responses"] == 1.0  # per-request keys: the engine decodes the same responses
    assert len(r["lengths"]) == 4 and all(1 <= n <= 12 for n in r["lengths"])
    assert r["tokens"] == sum(r["lengths"])
    assert all(_in_unit(r[k]) for k in ("static_bubble", "engine_bubble_slots", "engine_bubble_wall"))
    assert r["engine_over_static"] > 0
    assert "| tokens/s relative to static | 1.00 |" in md and "p95 / p50" in md


def test_code_changes_see_only_what_moves(checkpoint):
    _, params = hf.load_params(checkpoint)
    for fmt in update_mask.FORMATS:
        same = update_mask.code_change_fractions(params, params, fmt)
        assert same == {"qkv": 0.0, "o_mlp": 0.0, "all": 0.0}
        # invariant scaling divides q/k/v by s: per-channel absmax codes stay (up to rounding)
        scaled = update_mask.code_change_fractions(params, quant.invariant_scale(params, 1.5), fmt)
        assert scaled["o_mlp"] == 0.0 and scaled["qkv"] < 0.01
        moved = dict(params, layers=[dict(layer, up=layer["up"] + 0.05) for layer in params["layers"]])
        frac = update_mask.code_change_fractions(params, moved, fmt)
        assert frac["qkv"] == 0.0 and frac["o_mlp"] > 0.1
    assert update_mask.weight_change_fraction(params, params) == 0.0


def test_bad_settings_are_named(checkpoint, tmp_path):
    with pytest.raises(SystemExit):
        mismatch.main(["eviction", "--checkpoint", checkpoint, "--prompts", "0"])
    with pytest.raises(SystemExit):
        mismatch.main(["eviction", "--checkpoint", str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="--prompts=3 must be a multiple of --slots=2"):
        mismatch.main(
            ["lengths", "--checkpoint", checkpoint, "--prompts", "3", "--slots", "2", "--out", str(tmp_path / "x")]
        )
    n = len(prompts.INSTRUCTIONS)
    with pytest.raises(ValueError, match=f"--prompts={n + 1}: expected 1 to {n}"):
        prompts.chat_prompts(CharTokenizer(), n + 1)
    assert len(set(prompts.INSTRUCTIONS)) == n >= 64
    np.testing.assert_array_equal(prompts.chat_prompts(CharTokenizer(), 2)[1] > 0, True)
