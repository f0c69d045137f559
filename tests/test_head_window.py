"""rl.update.head_window="response": the LM head over each row's response window only
(transformer.token_logprobs' window, head_window_starts; rl/update.py head_window). The
log-probs and gradients it gives against the head over every position, the window's placement,
the program it compiles (the head's chunk holds only the window's tokens), and its errors. The
learner's results with it against the padded update: tests/test_rl_bucketed.py's head-window
cases."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float_tol import logit_magnitude, sum_tol
from test_rl_update import SGD_COUNTING, M, T, _random_rollout, key, random_params

from sparserl_jax import rl
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rl import update as update_lib
from sparserl_jax.rl.bucketed import BucketedUpdate

MC = ModelConfig.tiny()


def _setup():
    params = random_params(MC, key(1))
    packed, _, _, _ = _random_rollout(key(2))
    return params, packed["tokens"], packed["response_mask"]


def test_window_starts_hold_every_response_position():
    mask = np.zeros((4, 10), bool)
    mask[0, 2:5] = True  # starts at its first response position
    mask[1, 6:10] = True  # a window of 6 from 6 would pass the end: moved left to 10 - 6
    mask[3, 0:6] = True
    starts = np.asarray(tf.head_window_starts(jnp.asarray(mask), 6))
    np.testing.assert_array_equal(starts, [2, 4, 0, 0])  # row 2 has no response: 0
    for row, s in zip(mask, starts):
        assert row[:s].sum() == 0 and row[s + 6 :].sum() == 0
    assert update_lib.head_window(12, 8) == 8
    assert update_lib.head_window(8, 8) is None and update_lib.head_window(4, 8) is None  # not narrower
    assert update_lib.head_window(12, None) is None


def test_windowed_logprobs_and_gradients_equal_the_full_heads_on_the_responses():
    params, tokens, mask = _setup()
    W = M  # rollout.max_new_tokens: every row's response fits
    starts = tf.head_window_starts(mask, W)
    assert int(jnp.max(starts)) > 0  # some windows do not start at 0: the gather moves rows
    gather = jnp.where(mask[:, :, None], jnp.arange(3)[None, None, :] + 5, -1)
    full = tf.token_logprobs(params, MC, tokens, chunk_tokens=16, gather_ids=gather)
    win = tf.token_logprobs(params, MC, tokens, chunk_tokens=16, gather_ids=gather, window=W, window_start=starts)
    m = np.asarray(mask)
    # inside the responses: the same logits up to the head product's summation order (D terms of
    # at most the logit magnitude, the rows taken in other chunks), so log-probs within twice that
    tol = 4 * sum_tol(MC.d_model, logit_magnitude(params)) + sum_tol(MC.vocab_size, 1.0)
    for a, b in zip(full, win):
        np.testing.assert_allclose(np.asarray(b)[m], np.asarray(a)[m], rtol=0, atol=tol)
    j = np.arange(T)[None, :] - np.asarray(starts)[:, None]
    outside = (j < 0) | (j >= W)
    assert outside.any()
    assert np.all(np.asarray(win[0])[outside] == 0) and np.all(np.asarray(win[1])[outside] == 0)
    assert np.all(np.isneginf(np.asarray(win[2])[outside]))

    def loss(p, **window):
        logp, entropy, _ = tf.token_logprobs(p, MC, tokens, chunk_tokens=16, gather_ids=gather, **window)
        return jnp.sum(jnp.where(mask, logp + 0.1 * entropy, 0.0))

    g_full = jax.grad(loss)(params)
    g_win = jax.grad(loss)(params, window=W, window_start=starts)
    # the gradient sums one term per response token (at most B M of them) of the same values
    # (B M <= 64) in another order: relative 64 EPS32 of the largest entry, with margin for the
    # terms' cancellation, 1e-5; a lost or misplaced row changes entries by far more
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_full), jax.tree.leaves(g_win)):
        scale = float(jnp.max(jnp.abs(a)))
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-5 * scale + 1e-7, err_msg=str(path))


def _head_rows(fn, *args) -> set[int]:
    """Row counts of the head's products in fn's compiled program: dots whose output has the
    vocabulary as its last axis."""
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    return {int(r) for r in re.findall(rf"f32\[(\d+),{MC.vocab_size}\]\S* dot\(", hlo)}


def test_the_compiled_head_holds_only_the_windows_tokens():
    params, tokens, mask = _setup()
    B = tokens.shape[0]
    starts = tf.head_window_starts(mask, M)
    full = _head_rows(lambda p, t: tf.token_logprobs(p, MC, t, chunk_tokens=1024)[0], params, tokens)
    win = _head_rows(
        lambda p, t, s: tf.token_logprobs(p, MC, t, chunk_tokens=1024, window=M, window_start=s)[0],
        params,
        tokens,
        starts,
    )
    assert full == {1024}  # B T = 96 tokens padded to one chunk of chunk_tokens
    assert win == {B * M}  # B M = 64 tokens in one chunk fitted to them


def test_head_window_errors_name_the_setting():
    with pytest.raises(ValueError, match="update.head_window"):
        rl.UpdateConfig(head_window="prompt")
    cfg = rl.RLConfig(update=rl.UpdateConfig(minibatch_size=8, micro_batch_size=2, head_window="response"))
    with pytest.raises(ValueError, match="head_window=response needs the run's response length"):
        BucketedUpdate(MC, cfg, SGD_COUNTING, donate=False)
    params, tokens, mask = _setup()
    with pytest.raises(ValueError, match="window_start"):
        tf.token_logprobs(params, MC, tokens, window=4)
    with pytest.raises(ValueError, match="window=13"):
        tf.token_logprobs(params, MC, tokens, window=13, window_start=jnp.zeros(tokens.shape[0], jnp.int32))
    upd = BucketedUpdate(MC, cfg, SGD_COUNTING, donate=False, response_len=3)
    batch = {
        "tokens": np.asarray(tokens),
        "response_mask": np.asarray(mask),
        "sampler_logp": np.zeros(tokens.shape, np.float32),
        "advantages": np.zeros(tokens.shape[0], np.float32),
    }
    with pytest.raises(ValueError, match="more than the head's window of 3"):
        upd(params, params, SGD_COUNTING.init(params), batch)
