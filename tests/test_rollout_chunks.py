"""rollout.rows_per_call: the trainer samples the rollout batch in chunks of rows per sampler call."""

import os

import jax
import numpy as np
import pytest
from compile_cache import compile_cache_in_process
from float_tol import logprob_tol

from sparserl_jax.config import load_config
from sparserl_jax.rollout import on_mesh
from sparserl_jax.rollout.sampler import Rollout, generate_jit
from sparserl_jax.rollout.source import concat_rollouts
from sparserl_jax.train import Trainer

SMOKE = os.path.join(os.path.dirname(__file__), "..", "experiments", "configs", "smoke.yaml")
TIMING = ("time/", "throughput/")


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(tmp_path_factory):
    """Every trainer compiles its own programs, mostly the same ones: with the session's
    compilation cache they compile once (tests/compile_cache.py)."""
    with compile_cache_in_process(tmp_path_factory):
        yield


def _cfg(out, *overrides):  # smoke: 4 prompts x 4 samples = 16 rows
    return load_config(
        [SMOKE], [f"train.out_dir={out}", "train.progress=false", "sft.steps=8", "train.iterations=1", *overrides]
    )


def _untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(TIMING)}


@pytest.mark.parametrize("bad", [3, 5, 32, -4])
def test_rows_per_call_must_divide_the_rows(tmp_path, bad):
    with pytest.raises(ValueError, match=rf"rollout\.rows_per_call={bad} must be 0 .* divisor .* = 16"):
        _cfg(tmp_path, f"rollout.rows_per_call={bad}")


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    """The rollout batch of one key from trainers with rows_per_call 0 (unchunked), 16 (chunks of
    all 16 rows: one call) and 4, built once for the tests below."""
    tmp = tmp_path_factory.mktemp("chunks")
    trainers = {rows: Trainer(_cfg(tmp / str(rows), f"rollout.rows_per_call={rows}")) for rows in (0, 16, 4)}
    key = jax.random.key(7)
    return trainers, key, {rows: t.rollout_batch(key) for rows, t in trainers.items()}


def test_one_call_of_every_row_is_the_unchunked_rollout(rollouts):
    """rows_per_call = all rows is one call with the iteration key itself: the same rollout batch,
    metrics and texts as 0, bit for bit (the same compiled program on the same inputs). Only
    sampling reads rows_per_call (and the evaluation: the last test)."""
    trainers, _, batches = rollouts
    assert trainers[16].call_rows == trainers[0].call_rows == 16
    (batch_w, metrics_w, texts_w), (batch_o, metrics_o, texts_o) = batches[0], batches[16]
    assert batch_o.keys() == batch_w.keys() and metrics_o.keys() == metrics_w.keys()
    for k in batch_w:
        np.testing.assert_array_equal(np.asarray(batch_o[k]), np.asarray(batch_w[k]), err_msg=k)
    assert _untimed(metrics_o) == _untimed(metrics_w) and texts_o == texts_w


def test_chunked_rollout_batch_shapes_and_keys(rollouts):
    trainers, key, batches = rollouts
    whole, chunked = trainers[0], trainers[4]
    assert chunked.call_rows == 4 and whole.call_rows == 16
    (batch_w, metrics_w, texts_w), (batch_c, metrics_c, texts_c) = batches[0], batches[4]
    assert batch_c.keys() == batch_w.keys()
    for k in batch_w:
        assert batch_c[k].shape == batch_w[k].shape and batch_c[k].dtype == batch_w[k].dtype, k
    assert len(texts_c) == len(texts_w) == 16
    assert metrics_c.keys() == metrics_w.keys()
    assert all(np.isfinite(v) for v in metrics_c.values()), metrics_c

    # per-request keys: the chunked rollout is the whole one, and chunk i is generate_jit on
    # rows [4i, 4i + 4) as requests 4i .. 4i + 3 of the same key. 4 rows and 16 rows are two
    # programs: log-probs within float noise (float_tol.logprob_tol; a token sampled from
    # another key would differ by ~1); tokens equal unless a draw falls within that noise of a
    # boundary between two tokens (a probability of the noise's size per token, ~1e-6 measured)
    np.testing.assert_array_equal(np.asarray(batch_c["tokens"]), np.asarray(batch_w["tokens"]))
    tol = logprob_tol(whole.model_cfg, whole.params, keys=batch_w["tokens"].shape[1])
    np.testing.assert_allclose(np.asarray(batch_c["sampler_logp"]), np.asarray(batch_w["sampler_logp"]), atol=tol)
    assert texts_c == texts_w
    tokens = np.arange(16 * 6, dtype=np.int32).reshape(16, 6) % 50 + 3
    lengths = np.array([6, 5, 4, 3] * 4, np.int32)
    out = chunked.source.generate(chunked.params, tokens, lengths, key)
    assert out.tokens.shape == (16, chunked.sampler_cfg.max_new_tokens)
    assert out.lengths.shape == out.n_compressions.shape == out.evicted_fraction.shape == (16,)
    for i in range(4):
        ref = jax.device_get(
            generate_jit(
                chunked.params,
                chunked.model_cfg,
                tokens[4 * i : 4 * i + 4],
                lengths[4 * i : 4 * i + 4],
                key,
                chunked.sampler_cfg,
                np.arange(4 * i, 4 * i + 4),
            )
        )
        rows = slice(4 * i, 4 * i + 4)  # the same compiled program on the same rows: bit-exact
        np.testing.assert_array_equal(out.tokens[rows], ref.tokens)
        np.testing.assert_array_equal(out.logprobs[rows], ref.logprobs)
        np.testing.assert_array_equal(out.kept[rows], ref.kept)
        np.testing.assert_array_equal(out.n_compressions[rows], ref.n_compressions)
    # the chunks differ from each other (different request keys): not one chunk repeated
    assert not np.array_equal(out.logprobs[:4], out.logprobs[4:8])


def test_chunked_training_iteration_is_finite_and_eval_uses_rows_per_call(tmp_path, monkeypatch):
    trainer = Trainer(_cfg(tmp_path, "rollout.rows_per_call=8"))
    (metrics,) = trainer.run()
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    assert metrics["update/tokens"] > 0
    seen = []
    real = on_mesh.generate_jit

    def counting(params, model_cfg, tokens, *args):
        seen.append(tokens.shape[0])
        return real(params, model_cfg, tokens, *args)

    monkeypatch.setattr(on_mesh, "generate_jit", counting)
    res = trainer.evaluate(n=16)
    assert seen == [8, 8] and np.isfinite(res["accuracy"])


def test_concat_rollouts_joins_along_the_batch_axis():
    def part(b, start):
        r = np.arange(start, start + b)
        return Rollout(
            tokens=np.tile(r[:, None], (1, 3)),
            logprobs=np.zeros((b, 3), np.float32),
            mask=np.ones((b, 3), bool),
            lengths=r,
            kept=np.tile(r[:, None], (1, 3)),
            n_compressions=r,
            evicted_fraction=r.astype(np.float32),
            kept_positions=np.tile(r[None, None, :, None, None], (2, 5, 1, 1, 4)),
        )

    out = concat_rollouts([part(2, 0), part(3, 2)])
    np.testing.assert_array_equal(out.lengths, np.arange(5))
    assert out.tokens.shape == (5, 3) and out.kept_positions.shape == (2, 5, 5, 1, 4)
    np.testing.assert_array_equal(out.kept_positions[1, 4, :, 0, 0], np.arange(5))
    none = concat_rollouts([part(2, 0).replace(kept_positions=None)] * 2)
    assert none.kept_positions is None and none.tokens.shape == (4, 3)
