"""SortedRL (docs/methods.md#sortedrl): length-aware scheduling of rollouts on the slot engine.

Grouped loading: a group of n x b prompts (n = sorted.group_batches update batches of
b = rollout.prompts prompts, each prompt `samples` requests) is queued at once, and no new
prompt is loaded until every prompt of the group has been trained on. The engine is
oversubscribed (the group holds more requests than its Q slots) and refilled as slots free up;
an update batch is harvested as soon as b complete GRPO groups (all samples of a prompt) have
finished, in completion order, so update batches come out sorted by length (short first).
At a harvest the unharvested responses are treated by mode:
  on_policy: dropped (every trained token has the current weights' version; the dropped
    tokens are the discarded-token fraction), and their prompts re-sampled afresh (all samples,
    new request ids). Where a dropped prompt goes is sorted.requeue:
    immediate (the paper's rule): straight back into the queue, behind the requests waiting, so
      the engine stays full; a prompt may be dropped again at a later harvest of the group;
    hold: a dropped prompt has shown a long response, so it is held back as long as the
      untrained prompts never dropped can fill the next harvest on their own. From the harvest
      where they cannot (the group's last one at the latest), just enough held prompts are
      re-queued (first dropped first) to make b prompts in flight: that harvest takes all b and
      drops nothing, and so does every later harvest of the group. So a prompt is dropped at
      most once per group, at the cost of slots left idle while the held prompts wait;
  partial: finished ones wait for their group to complete; unfinished ones keep their tokens
    and per-token sampler log-probs and resume under the new weights: by default
    (sorted.resume='cache') in their slot, with the KV cache the earlier weights wrote (no
    harvest, no re-prefill; an in-flight weight update), or (sorted.resume='prefill') after
    re-prefilling prompt + partial response under the new weights. Each token's ratio uses the
    log-prob of the weights that sampled it and its version is theirs (the engine's module doc:
    the first token after an in-slot update came from the old weights' logits): xi covers
    staleness, staleness < n updates.
The decode loop keeps the device busy while the host books finished responses: a segment's
finished slots are copied on the device (engine.harvest_start), refilled, and the next segment
dispatched before the copy is read on the host (engine.harvest_read). Completion is decided
from the done flags alone, so nothing waits for a copy except the update batch itself.
A checkpoint at a group boundary (nothing queued or running) is an exact resume point.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from sparserl_jax.rollout.config import SortedConfig
from sparserl_jax.rollout.engine import Finished, SlotEngine
from sparserl_jax.validate import check_at_least


@dataclasses.dataclass
class Request:
    uid: int  # request id within the group: its random keys
    prompt: int  # prompt index within the group
    sample: int
    partial: Finished | None = None  # one-row partial response to resume (partial mode)
    limit: int = 1 << 30  # forced response length (benchmarks, tests)


class SortedScheduler:
    """Drives a SlotEngine over groups of prompts; `next_batch` returns one update batch."""

    def __init__(
        self, engine: SlotEngine, cfg: SortedConfig, *, prompts_per_batch: int, samples: int, pad_token_id: int = 0
    ):
        if not isinstance(engine, SlotEngine):
            raise ValueError(f"engine={type(engine).__name__}: a SlotEngine is accepted")
        if not isinstance(cfg, SortedConfig):
            raise ValueError(f"cfg={type(cfg).__name__}: a SortedConfig is accepted")
        check_at_least("rollout.prompts (prompts_per_batch)", prompts_per_batch, 1)
        check_at_least("rollout.samples (samples)", samples, 1)
        check_at_least("pad_token_id", pad_token_id, 0)
        if cfg.slots and cfg.slots != engine.Q:
            raise ValueError(
                f"sorted.slots={cfg.slots} but the engine has {engine.Q} slots: "
                "build the engine with sorted.slots slots (or set sorted.slots=0)"
            )
        self.engine, self.cfg = engine, cfg
        self.b, self.n = prompts_per_batch, samples
        self.pad = pad_token_id
        self.group = -1  # index of the loaded group
        self.state = None  # the engine's slot state, kept across groups (every slot free between)
        self._reset_group()

    # ------------------------------------------------------------------ group state

    def _reset_group(self):
        self.examples: list = []  # the group's prompts (objects with prompt_ids), by index
        self.prompt_tokens = np.zeros((0, self.engine.P), np.int32)
        self.prompt_lengths = np.zeros((0,), np.int32)
        self.queue: collections.deque[Request] = collections.deque()
        self.occupant: dict[int, Request] = {}  # slot -> request
        self.done: dict[int, list] = collections.defaultdict(list)  # prompt -> [(sample, Finished)]
        self.n_done: collections.Counter = collections.Counter()  # prompt -> finished samples
        self.pending: list = []  # (harvest_start copy, [(slot, Request)]) not read yet
        self.complete: list[int] = []  # prompts whose samples all finished, in completion order
        self.trained: set[int] = set()
        self.held: list[int] = []  # on-policy, hold: dropped prompts not re-queued yet, first dropped first
        self.drops: collections.Counter = collections.Counter()  # prompt -> times dropped (hold: <= 1)
        self.next_uid = 0
        self.limits = None
        self.key = None

    @property
    def at_group_boundary(self) -> bool:
        """Every prompt of the loaded group trained on (or none loaded): an exact resume point."""
        return len(self.trained) == len(self.examples)

    def load_group(
        self,
        examples: Sequence,
        prompt_tokens: np.ndarray,
        prompt_lengths: np.ndarray,
        key: jax.Array,
        limits: np.ndarray | None = None,
    ) -> None:
        """Queue a new group (n x b prompts, tokens right-padded to the engine's prompt width);
        `limits` [prompts, samples] optionally forces response lengths (benchmarks, tests)."""
        if not self.at_group_boundary:
            raise RuntimeError("load_group before every prompt of the current group was trained on")
        G = self.cfg.group_batches * self.b
        if len(examples) != G:
            raise ValueError(
                f"a group of {len(examples)} prompts: a group holds sorted.group_batches "
                f"x rollout.prompts = {self.cfg.group_batches} x {self.b} = {G}"
            )
        prompt_tokens = np.asarray(prompt_tokens)
        prompt_lengths = np.asarray(prompt_lengths)
        P = self.engine.P
        if prompt_tokens.shape != (G, P):
            raise ValueError(
                f"prompt_tokens of shape {prompt_tokens.shape}: [{G} prompts, the "
                f"engine's prompt width {P}] is accepted (right-padded)"
            )
        if prompt_lengths.shape != (G,) or not ((prompt_lengths >= 1) & (prompt_lengths <= P)).all():
            raise ValueError(f"prompt_lengths {prompt_lengths.tolist()}: {G} lengths in [1, {P}] are accepted")
        if limits is not None:
            limits = np.asarray(limits)
            if limits.shape != (G, self.n) or not (limits >= 1).all():
                low = limits.min() if limits.size else None
                raise ValueError(
                    f"limits of shape {limits.shape} (min {low}): [{G} prompts, "
                    f"{self.n} samples] forced lengths >= 1 are accepted"
                )
        self._reset_group()
        self.group += 1
        self.examples = list(examples)
        self.prompt_tokens = prompt_tokens.astype(np.int32)
        self.prompt_lengths = prompt_lengths.astype(np.int32)
        self.key = key
        self.limits = None if limits is None else limits.astype(np.int32)
        for p in range(len(examples)):
            for s in range(self.n):
                self.queue.append(self._fresh(p, s))
        if self.state is None:
            self.state = self.engine.init_state()

    def _fresh(self, prompt: int, sample: int) -> Request:
        self.next_uid += 1
        limit = self.engine.M if self.limits is None else int(self.limits[prompt, sample])
        return Request(self.next_uid - 1, prompt, sample, limit=limit)

    # ------------------------------------------------------------------ the loop

    def _fill(self, params, version: int) -> None:
        if self.cfg.mode == "partial" and self.cfg.resume == "prefill":  # resumed inserts ahead:
            # their buckets compile with the fresh ones, in the first iteration
            self.state = self.engine.warm_up(params, self.state, self.key, resume=True)
        free = [q for q in range(self.engine.Q) if q not in self.occupant]
        take = []
        while free and self.queue:
            take.append((free.pop(0), self.queue.popleft()))
        for resume in (False, True):
            part = [(q, r) for q, r in take if (r.partial is not None) == resume]
            if not part:
                continue
            slots = [q for q, _ in part]
            reqs = [r for _, r in part]
            idx = [r.prompt for r in reqs]
            self.state = self.engine.insert(
                params,
                self.state,
                self.key,
                slots,
                self.prompt_tokens[idx],
                self.prompt_lengths[idx],
                [r.uid for r in reqs],
                limits=[r.limit for r in reqs],
                partial=Finished.concat([r.partial for r in reqs]) if resume else None,
                version=version,
            )
            self.occupant.update(part)

    def next_batch(self, params, version: int):
        """Decode until b prompts have all their samples finished; returns (examples [b],
        prompt tokens [b*n, P], lengths [b*n], Finished [b*n] rows prompt-major, metrics)."""
        eng = self.engine
        stats0 = dataclasses.replace(eng.stats)
        while len(self.complete) < self.b:
            self._fill(params, version)
            if not self.occupant:
                raise RuntimeError("SortedRL: nothing left to decode before a harvest was complete")
            self.state, run = eng.segment_start(params, self.state, self.key, version)
            self._read_pending(idle=False)  # the device decodes meanwhile
            done, _ = eng.segment_wait(run)
            finished = [q for q in self.occupant if done[q]]
            if finished:
                reqs = [(q, self.occupant.pop(q)) for q in finished]
                self.pending.append((eng.harvest_start(self.state), reqs))
                for _, req in reqs:
                    self.n_done[req.prompt] += 1
                    if self.n_done[req.prompt] == self.n:
                        self.complete.append(req.prompt)
        self._read_pending(idle=True)
        take, self.complete = self.complete[: self.b], self.complete[self.b :]
        rows = []
        for p in take:
            rows.extend(f for _, f in sorted(self.done.pop(p), key=lambda x: x[0]))
            del self.n_done[p]
            self.trained.add(p)
        out = Finished.concat(rows)
        discarded = self._after_harvest(version)
        generated = eng.stats.tokens - stats0.tokens
        idx = np.repeat(np.asarray(take), self.n)
        metrics = self._metrics(out, version, eng.stats, stats0, discarded, generated)
        return ([self.examples[p] for p in take], self.prompt_tokens[idx], self.prompt_lengths[idx], out, metrics)

    def _read_pending(self, *, idle: bool) -> None:
        """Bring the harvested copies to the host and file each response under its prompt."""
        for copy, reqs in self.pending:
            got = self.engine.harvest_read(copy, [q for q, _ in reqs], idle=idle)
            for j, (_, req) in enumerate(reqs):
                self.done[req.prompt].append((req.sample, got.row(j)))
        self.pending = []

    def _after_harvest(self, version: int) -> int:
        """Treat the unharvested responses by mode; returns the tokens discarded (on-policy)."""
        eng = self.engine
        slots = sorted(self.occupant)
        if self.cfg.mode == "partial" and self.cfg.resume == "cache":
            return 0  # every slot keeps decoding its request under the next weights
        partial = eng.harvest(self.state, slots) if slots else None
        self.state = eng.release_all(self.state)
        if self.cfg.mode == "on_policy":
            discarded = 0 if partial is None else int(partial.lengths.sum())
            prompts = sorted({self.occupant[q].prompt for q in slots} | set(self.done) | set(self.complete))
            for p in prompts:
                discarded += sum(int(f.lengths.sum()) for _, f in self.done.get(p, ()))
            self.drops.update(prompts)
            self.held.extend(prompts)  # every sample re-sampled on release, with fresh request ids
            self.queue = collections.deque(r for r in self.queue if r.prompt not in prompts)
            self.done.clear()
            self.n_done.clear()
            self.complete = []
            self.occupant.clear()
            self._release_held()
            return discarded
        resumed = [dataclasses.replace(self.occupant[q], partial=partial.row(j)) for j, q in enumerate(slots)]
        resumed.sort(key=lambda r: (r.prompt, r.sample))
        self.queue = collections.deque(resumed + list(self.queue))
        self.occupant.clear()
        return 0

    def _release_held(self) -> None:
        """Queue the dropped prompts: all of them at once (requeue 'immediate'), or ('hold') just
        enough that the prompts in flight (queued or decoding) can make the next harvest, once
        those never dropped cannot alone (module doc)."""
        untrained = len(self.examples) - len(self.trained)
        short = len(self.held) if self.cfg.requeue == "immediate" else self.b - (untrained - len(self.held))
        if short > 0:
            release, self.held = self.held[:short], self.held[short:]
            self.queue.extend(self._fresh(p, s) for p in release for s in range(self.n))

    def _metrics(self, out: Finished, version: int, stats, stats0, discarded: int, generated: int) -> dict:
        Q = self.engine.Q
        idle = stats.idle_slot_seconds - stats0.idle_slot_seconds
        seconds = stats.seconds - stats0.seconds
        active = stats.active_slot_steps - stats0.active_slot_steps
        slot_steps = stats.slot_steps - stats0.slot_steps
        mask = np.arange(out.tokens.shape[1])[None] < out.lengths[:, None]
        stale = (version - out.version)[mask]
        m = {
            "rollout/bubble_wall": idle / max(seconds * Q, 1e-12),
            "rollout/bubble_slots": 1.0 - active / max(slot_steps, 1),
            "sorted/harvest_length_mean": float(out.lengths.mean()),
            "sorted/harvest_length_max": float(out.lengths.max()),
            "sorted/group": float(self.group),
            "sorted/staleness_mean": float(stale.mean()) if stale.size else 0.0,
            "sorted/staleness_max": float(stale.max()) if stale.size else 0.0,
        }
        for k in range(self.cfg.group_batches):
            m[f"sorted/staleness_frac_{k}"] = float(np.mean(stale == k)) if stale.size else 0.0
        if self.cfg.mode == "on_policy":
            m["sorted/discarded_token_fraction"] = discarded / max(generated, 1)
            m["sorted/held_prompts"] = float(len(self.held))  # 0 with requeue 'immediate'
            m["sorted/dropped_prompts"] = float(sum(self.drops.values()))  # this group, so far
        return m
