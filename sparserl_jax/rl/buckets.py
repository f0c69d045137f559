"""Length buckets: which rows the learner puts together and how wide each group is (host side).

A rollout batch is laid out [B, T] with T = the padded prompt width + rollout.max_new_tokens
(rl/batch.py), but a row needs only its prompt + response positions. Scoring and the update
therefore run micro-batches of rows trimmed to the longest row among them, rounded up to the next
of a few widths (each compiled once: a scoring and a gradient program), and, when they may, sort
the rows by length first so that short rows travel together. Trimming trailing padding changes
nothing a row computes: attention is causal and position t scores token t + 1, so a row of `n`
positions needs columns 0 .. n - 1 only.

The widths are the multiples of a step up to T: `update.length_bucket` positions, widened to the
smallest multiple of it that gives at most `update.max_buckets` widths (`bucket_step`), so the
programs a run compiles stay bounded however long its responses. The price is padding: a
micro-batch pays for its width, on average half a step beyond its longest row. On a synthetic
long-tail batch of 4096-token responses (1024 rows: prompts lognormal around 130 tokens, responses
lognormal around 700, 1% cut at 4096; tests/test_compile_budget.py), the learner's micro-batches
of 4 run 2.8% more positions than their longest rows need at a 64-position step (80 widths), 12%
at 256 (20 widths), 15% at 320 (16) and 23% at 512 (10); with responses about twice as long
(median 1500, 10% cut) 1.6%, 7%, 9% and 13%. The update's forwards and backwards run at the
micro-batch's width, so its cost grows as the positions (the metric update/padding_fraction
reports a run's own).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """Rows of the rollout batch (indices, in the order they are stacked) at one width."""

    rows: np.ndarray  # [m] int
    width: int


def bucket_step(full: int, bucket: int, max_buckets: int = 0) -> int:
    """The step between widths for a batch `full` positions wide: `bucket`
    (update.length_bucket), or the smallest multiple of it that gives at most `max_buckets`
    widths (update.max_buckets; 0: no bound). 0 (`bucket` 0): one width, `full`."""
    if full < 1:
        raise ValueError(f"a rollout batch of width {full}: nothing to score")
    if bucket <= 0:
        return 0
    widths = -(-full // bucket)  # ceil: the last width is `full` itself
    return bucket * -(-widths // max_buckets) if max_buckets > 0 else bucket


def bucket_widths(full: int, bucket: int, max_buckets: int = 0) -> tuple[int, ...]:
    """Every width a micro-batch can take: the multiples of the step (`bucket_step`) below
    `full`, then `full` (step 0, or >= full: `full` only); at most `max_buckets` of them when it
    is set."""
    step = bucket_step(full, bucket, max_buckets)
    if step <= 0 or step >= full:
        return (full,)
    return tuple(range(step, full, step)) + (full,)


def width_for(length: int, widths: tuple[int, ...]) -> int:
    """The narrowest width that holds `length` positions."""
    for w in widths:
        if w >= length:
            return w
    raise ValueError(f"a row of {length} positions is wider than the rollout batch ({widths[-1]})")


def row_lengths(response_mask_BxT: np.ndarray) -> np.ndarray:
    """Positions each row needs: its last response position t scores token t + 1, so t + 2
    columns (1 for a row without response tokens, which contributes nothing)."""
    mask = np.asarray(response_mask_BxT, bool)
    T = mask.shape[1]
    last = T - 1 - np.argmax(mask[:, ::-1], axis=1)
    return np.where(mask.any(axis=1), np.minimum(last + 2, T), 1).astype(np.int64)


def plan(
    lengths_B: np.ndarray, rows: np.ndarray, size: int, widths: tuple[int, ...], *, group: bool
) -> list[MicroBatch]:
    """Cut `rows` (indices into the batch) into consecutive groups of `size` (the last one may be
    shorter), after a stable sort by length when `group`; each group at the width of its longest row."""
    rows = np.asarray(rows, np.int64)
    if group:
        rows = rows[np.argsort(lengths_B[rows], kind="stable")]
    return [
        MicroBatch(rows[i : i + size], width_for(int(lengths_B[rows[i : i + size]].max()), widths))
        for i in range(0, len(rows), size)
    ]
