"""Length buckets: which rows the learner puts together and how wide each group is (host side).

A rollout batch is laid out [B, T] with T = the padded prompt width + rollout.max_new_tokens
(rl/batch.py), but a row needs only its prompt + response positions. Scoring and the update
therefore run micro-batches of rows trimmed to the longest row among them, rounded up to a
multiple of `update.length_bucket` (a few compiled widths), and, when they may, sort the rows by
length first so that short rows travel together. Trimming trailing padding changes nothing a
row computes: attention is causal and position t scores token t + 1, so a row of `n` positions
needs columns 0 .. n - 1 only.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """Rows of the rollout batch (indices, in the order they are stacked) at one width."""

    rows: np.ndarray  # [m] int
    width: int


def bucket_widths(full: int, bucket: int) -> tuple[int, ...]:
    """Every width a micro-batch can take: the multiples of `bucket` below `full`, then `full`
    (`bucket` 0, or >= full: `full` only)."""
    if full < 1:
        raise ValueError(f"a rollout batch of width {full}: nothing to score")
    if bucket <= 0 or bucket >= full:
        return (full,)
    return tuple(range(bucket, full, bucket)) + (full,)


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
