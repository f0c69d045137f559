"""The generate CLI on a tiny HF checkpoint that the test builds (model + char tokenizer)."""

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from compile_cache import compile_cache_in_process
from hf_fixtures import make_tiny_hf_checkpoint

from sparserl_jax import generate
from sparserl_jax.model import hf
from sparserl_jax.model import transformer as tf
from sparserl_jax.tokenizer import CharTokenizer


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(tmp_path_factory):
    """Each CLI call builds its sampler afresh: with the session's
    compilation cache they compile once (tests/compile_cache.py)."""
    with compile_cache_in_process(tmp_path_factory):
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = make_tiny_hf_checkpoint("qwen2", tmp_path_factory.mktemp("gen"))
    CharTokenizer().save(directory)
    return directory


def test_greedy_json_matches_teacher_forced_recompute(checkpoint, tmp_path):
    out = tmp_path / "out.json"
    prompts = ["Compute 2+2.", "Pairs:\nab:12\nValue of ab?"]
    args = [
        "--checkpoint",
        str(checkpoint),
        "--max-new-tokens",
        "10",
        "--temperature",
        "0",
        "--output-json",
        str(out),
        "--kv-buffer",
        "4",
    ]
    for p in prompts:
        args += ["--prompt", p]
    generate.main(args)
    results = json.loads(out.read_text())["results"]
    cfg, params = hf.load_params(checkpoint)
    tok = CharTokenizer()
    for r, p in zip(results, prompts):
        assert r["prompt_token_ids"] == tok.encode(p, add_special_tokens=True)
        gen = r["generated_token_ids"]
        assert 1 <= len(gen) <= 10 and len(r["logprobs"]) == len(gen)
        seq = jnp.asarray([r["prompt_token_ids"] + gen])
        logits = tf.logits(params, cfg, seq)[0]
        P = len(r["prompt_token_ids"])
        # greedy: each generated token is the argmax, and its log-prob is the plain log-softmax
        np.testing.assert_array_equal(jnp.argmax(logits[P - 1 : P - 1 + len(gen)], -1), gen)
        lp, _ = tf.token_logprobs(params, cfg, seq)
        np.testing.assert_allclose(r["logprobs"], lp[0, P - 1 : P - 1 + len(gen)], atol=1e-4)


def test_sparse_policy_and_chat_template(checkpoint, tmp_path):
    out = tmp_path / "sparse.json"
    generate.main(
        [
            "--checkpoint",
            str(checkpoint),
            "--prompt",
            "Repeat 123456789 please",
            "--chat",
            "--max-new-tokens",
            "12",
            "--seed",
            "3",
            "--kv-policy",
            "streaming",
            "--kv-budget",
            "8",
            "--kv-buffer",
            "4",
            "--kv-window",
            "2",
            "--kv-sinks",
            "2",
            "--kv-compress-prompt",
            "--output-json",
            str(out),
        ]
    )
    (r,) = json.loads(out.read_text())["results"]
    tok = CharTokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "Repeat 123456789 please"}])
    assert r["prompt_token_ids"] == tok.encode(chat)
    assert r["kv_compressions"] >= 1  # the 27-token prompt was squeezed into the budget
    if len(r["generated_token_ids"]) > 1:  # the first token's logits come from the whole prompt
        assert r["kv_kept_last"] <= 12
    assert all(lp <= 0 for lp in r["logprobs"])


def test_too_long_request_is_refused_with_the_flag_named(checkpoint):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sparserl_jax.generate",
            "--checkpoint",
            str(checkpoint),
            "--prompt",
            "hi",
            "--max-new-tokens",
            "100000",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "--max-new-tokens=100000" in proc.stderr


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        generate.main(["--checkpoint", str(tmp_path / "nowhere"), "--prompt", "x"])
