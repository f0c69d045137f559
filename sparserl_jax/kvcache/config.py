"""KV eviction settings (Sparse-RL section 1.5): which policy, the budget B of kept entries, the
buffer of new entries between compressions, the observation window w and the policy knobs."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from sparserl_jax.kvcache.policies import POLICIES
from sparserl_jax.validate import check_at_least, check_between, check_bool, check_in

SELECTIONS: tuple[str, ...] = ("per_head", "shared")
TRIGGERS: tuple[str, ...] = ("interval", "newline")
GQA_REDUCTIONS: tuple[str, ...] = ("max_logits", "max_probs")
RKV_REDUNDANCIES: tuple[str, ...] = ("all_keys", "candidates")


@dataclasses.dataclass(frozen=True)
class KVConfig:
    """Eviction settings; hashable, so it can be a static argument of jitted functions.

    policy: a name in `sparserl_jax.kvcache.policies.POLICIES` ("none" = dense, never evicts).
    budget: B, entries kept per sequence, layer and KV head after a compression (prompt included).
    buffer: new entries allowed on top of the budget before the next compression.
    window: w, the last w queries score the keys (SnapKV, R-KV) and the last w keys are always kept.
    pool_kernel: SnapKV/R-KV 1-D max-pool kernel (stride 1, same padding). Max-pool as R-KV
      (rkv/compression/r1_kv.py) and the Sparse-RL fork (KVCluster(pooling="maxpool") in
      sglang-kvc/srt/managers/tp_worker.py) use for both policies; SnapKV's own default is avgpool.
    gqa_reduce: how SnapKV/R-KV turn the G query heads that share a KV head into one score.
      "max_logits" (authors: R-KV rkv/utils.py compute_attention_scores(pooling="max") and the
      fork's KVCluster(attn_pooling="max")): the max over the group of the raw scaled logits,
      then the softmax over the candidate keys and the mean over the window; "max_probs": the
      softmax and window mean per query head, then the max (our earlier reading of
      docs/methods.md#kv-compression).
    rkv_lambda: R-KV's lambda in Z = lambda * I - (1 - lambda) * R. 0.1 is the Sparse-RL fork's
      (KVCluster(mix_alpha=0.1) in tp_worker.py); R-KV's own default is 0.07 (R1KV(mix_lambda)).
    redundancy_threshold: R-KV cosine similarity above which two keys are near-duplicates.
    rkv_redundancy: which keys R-KV's redundancy R is computed over. "all_keys" (authors: R-KV
      rkv/utils.py cal_similarity, also the fork's copy in sglang/compress/r1kv_utils.py): every
      filled slot, window included, counts in the row mean, in the "most recent similar key"
      search and in the softmax, and R is then read on the candidates; a row with no similar key
      zeroes its column 0 (the search returns index 0), which slightly favours the oldest kept
      entry (a quirk of the original, reproduced). "candidates": the similarity, mean and softmax
      over the candidates only and no column-0 quirk (our earlier reading).
    n_sinks: StreamingLLM attention sinks (the first entries by original position).
    selection: "per_head" (every layer and KV head chooses) or "shared" (scores summed over KV
      heads and layer 0 chooses for every layer, as in the Sparse-RL authors' code).
    compress_prompt: compress prompts longer than the budget at prefill (original R-KV) instead of
      keeping them whole until the first decode-time compression, after `buffer` decode steps
      (false, the Sparse-RL authors' code: radix_attention.py RadixAttention.compress keeps the
      full KV at prefill and compresses only in decode). With false, a prompt longer than the
      budget needs a larger cache: capacity() is max(budget, prompt) + buffer.
    trigger: "interval" (compress when the buffer is full) or "newline" (also compress when the
      previous token is one of `newline_token_ids`, as an option in the authors' code).
    budget_schedule: a budget that moves through the generation (Sparrow's schedule,
      docs/implementation.md#the-correction-family): a compression of a sequence that has seen L
      tokens (prompt included) keeps budget_schedule[min(L // schedule_every, len - 1)] entries;
      every entry is at most `budget`, which sizes the cache. Empty (the default): always `budget`.
    schedule_every: tokens per entry of budget_schedule (Sparrow's bins are 2000 tokens).
    """

    policy: str = "none"
    budget: int = 512
    buffer: int = 128
    window: int = 8
    pool_kernel: int = 7
    rkv_lambda: float = 0.1
    redundancy_threshold: float = 0.5
    n_sinks: int = 4
    selection: str = "per_head"
    gqa_reduce: str = "max_logits"
    rkv_redundancy: str = "all_keys"
    compress_prompt: bool = False
    trigger: str = "interval"
    newline_token_ids: tuple[int, ...] = ()
    budget_schedule: tuple[int, ...] = ()
    schedule_every: int = 2048

    def __post_init__(self):
        # YAML gives lists; keep the config hashable.
        try:
            ids = tuple(int(t) for t in self.newline_token_ids)
        except (TypeError, ValueError):
            raise ValueError(f"kv.newline_token_ids={self.newline_token_ids!r} must be a list of token ids") from None
        object.__setattr__(self, "newline_token_ids", ids)
        try:
            schedule = tuple(int(b) for b in self.budget_schedule)
        except (TypeError, ValueError):
            raise ValueError(f"kv.budget_schedule={self.budget_schedule!r} must be a list of budgets") from None
        object.__setattr__(self, "budget_schedule", schedule)
        check_in("kv.policy", self.policy, POLICIES)
        for name in ("budget", "buffer", "window", "pool_kernel"):
            check_at_least(f"kv.{name}", getattr(self, name), 1)
        if self.window >= self.budget:
            raise ValueError(
                f"kv.window={self.window} must be smaller than kv.budget={self.budget} "
                "(the last window keys are always kept)"
            )
        if self.pool_kernel % 2 == 0:
            raise ValueError(f"kv.pool_kernel={self.pool_kernel} must be odd (same padding)")
        check_between("kv.rkv_lambda", self.rkv_lambda, 0, 1)
        check_between("kv.redundancy_threshold", self.redundancy_threshold, -1, 1)  # a cosine
        check_at_least("kv.n_sinks", self.n_sinks, 0)
        if self.policy == "streaming" and self.n_sinks + self.window > self.budget:
            raise ValueError(
                f"kv.n_sinks={self.n_sinks} + kv.window={self.window} must not exceed kv.budget={self.budget}"
            )
        check_in("kv.selection", self.selection, SELECTIONS)
        check_in("kv.gqa_reduce", self.gqa_reduce, GQA_REDUCTIONS)
        check_in("kv.rkv_redundancy", self.rkv_redundancy, RKV_REDUNDANCIES)
        check_in("kv.trigger", self.trigger, TRIGGERS)
        if self.trigger == "newline" and not self.newline_token_ids:
            raise ValueError("kv.trigger='newline' needs kv.newline_token_ids (a non-empty list)")
        check_bool("kv.compress_prompt", self.compress_prompt)
        check_at_least("kv.schedule_every", self.schedule_every, 1)
        low = self.window + 1 + (self.n_sinks if self.policy == "streaming" else 0)
        for b in self.budget_schedule:
            if not low <= b <= self.budget:
                raise ValueError(
                    f"kv.budget_schedule={list(self.budget_schedule)}: every entry must lie in "
                    f"[{low}, kv.budget={self.budget}] (above the always-kept window, at most the budget "
                    "that sizes the cache)"
                )

    @property
    def is_dense(self) -> bool:
        return self.policy == "none"

    def budget_at(self, seen):
        """The entries a compression keeps in a sequence that has seen `seen` tokens (an int, or
        an int32 [B] array inside a traced program): `budget`, or the schedule's entry."""
        if not self.budget_schedule:
            return self.budget if isinstance(seen, int) else jnp.full(jnp.shape(seen), self.budget, jnp.int32)
        schedule = jnp.asarray(self.budget_schedule, jnp.int32)
        return schedule[jnp.minimum(jnp.asarray(seen) // self.schedule_every, len(self.budget_schedule) - 1)]

    def capacity(self, prompt_len: int) -> int:
        """Slots of a sparse cache for prompts of up to `prompt_len` tokens: the budget (or the
        whole prompt, when prompts are not compressed at prefill) plus the buffer."""
        kept = self.budget if self.compress_prompt else max(self.budget, prompt_len)
        return kept + self.buffer
