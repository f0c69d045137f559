"""The slot engine: continuous batching over a fixed-slot KV cache (SortedRL's rollout engine).

Q slots each hold one sequence in the same fixed-slot cache the static sampler uses (dense:
prompt + max new tokens; sparse: budget + buffer). A request flows through it as follows:
  1. insert: the host pads the new requests to one of a few row buckets (powers of two from
     Q / 8 to Q: each compiles once per engine, all of them at the first insert of each kind,
     fresh or resumed, or before it by warm_up) and dispatches one jitted program that prefills
     them (prompt, or prompt + partial response when resumed) into a fresh cache and scatters
     every cache leaf (keys, values, fill, length, positions, H2O mass, window queries) into
     free slots, so nothing of the previous occupant survives (a resumed request brings its
     tokens and records so far, a fresh one starts them empty). It returns at once (JAX async
     dispatch); the device runs it before the next segment.
  2. segment: a jitted program of up to `segment_chunks` x kv.buffer decode steps (the slot
     state donated) with the static sampler's own step (sampler.decode_token), every slot at its
     own token index t. `segment_start` dispatches it; `segment_wait` fetches only the slots'
     done flags and t (two [Q] arrays).
  3. harvest: `harvest_start` dispatches a copy of every slot's response (tokens, sampler
     log-probs, kept counts, the policy version of each token, and the sampler's per-token
     records when its config asks for them: kept sets, top candidates; one compiled shape, all Q rows);
     the slots are free to insert into at once, and `harvest_read` brings the copy to the host
     later: the SortedScheduler reads it after dispatching the next segment, so the device
     decodes while the host copies and books the finished responses.
Between harvests a slot may also keep its request across a policy update (the scheduler's
partial mode with sorted.resume='cache'): its cache stays and it decodes on under the new weights.
A token's version is that of the weights whose logits it was sampled from: each slot keeps the
version of its stored next-token logits (the prefill's, then each decode step's), so the first
token after such an update, sampled from logits the old weights computed, carries the old version
(as its recorded log-prob does), and the tokens after it the new one.
Randomness is per request (sampler.request_keys): token t of request r draws with
fold_in(fold_in(key, r), t), and an interval-trigger compression runs before a slot's token t
when t is a multiple of kv.buffer, as the static sampler's chunk boundaries. So with Q >= N and
no refill the engine reproduces sampler.generate, and with refills every request equals its
generation alone.

On a mesh the slots split over its data x fsdp. On the training layout (rollout.mesh=train) XLA
partitions each program over the mesh; on "data" and "tensor:N" (`manual_axes`, rollout/layout.py)
each row group runs its own Q / groups slots alone under shard_map (engine_programs.jitted): an
insert's rows are laid out so that each group prefills only the requests aimed at its own slots
(its bucket: the busiest group's rows x groups), and a segment's decode loop moves nothing between
devices but its scalar stop test, which keeps every group stepping until all slots are done, as
one device does.

Bubble ratio (SortedRL Eq. 4): sum_k (Q - r_k) dt_k / (T Q) over the wall-time intervals k of
the engine's host calls, T their total:
  - a segment's interval runs from its dispatch to its done flags on the host, with r_k its mean
    running slots (active slot-steps / steps). Device work queued before it (the asynchronous
    prefill of an insert, a harvest copy) runs inside this interval and counts at r_k;
  - the host time of an insert (padding, dispatch) and of a harvest (dispatch; a read that no
    segment overlaps) is idle, r = 0;
  - with `sync` (profiles: every insert and harvest blocked on), the blocked device time is moved
    out of the call into the next segment's interval (or the next idle read), as without it;
  - compile time (compile_clock: tracing, lowering and XLA compilation inside these calls, the
    warm-up's compilation of every row bucket included) is in neither idle time nor T: it is
    counted apart, in stats.compile_seconds and stats.compiles; the warm-up's other time
    (running each bucket once on padding rows) is not counted at all.
The slot-step form is 1 - active slot-steps / (Q x steps).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from sparserl_jax import compile_clock
from sparserl_jax.distributed import to_host
from sparserl_jax.model import sharding as shd
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rollout import engine_programs as programs
from sparserl_jax.rollout.engine_programs import SlotState
from sparserl_jax.rollout.sampler import (
    Rollout,
    SamplerConfig,
    cache_capacity,
    empty_records,
    evicted_fraction,
    token_records,
)
from sparserl_jax.validate import check_at_least


@dataclasses.dataclass
class Finished:
    """Host copies of harvested responses, one row per request (numpy)."""

    request: np.ndarray  # [n]
    tokens: np.ndarray  # [n, M]
    logprobs: np.ndarray
    kept: np.ndarray
    version: np.ndarray
    lengths: np.ndarray  # [n]
    n_compressions: np.ndarray
    prompt_lengths: np.ndarray
    kept_ids: np.ndarray | None = None  # [n, M, K], with the sampler's replay_filters
    top_ids: np.ndarray | None = None  # [n, M, A], with its agreement_k
    top_logp: np.ndarray | None = None

    def row(self, i: int) -> Finished:
        """Row i, as a one-row Finished."""
        return Finished(**{f.name: _rows(getattr(self, f.name), i) for f in dataclasses.fields(self)})

    @staticmethod
    def concat(rows: Sequence[Finished]) -> Finished:
        """Rows joined in order (one Finished)."""
        names = (f.name for f in dataclasses.fields(Finished))
        return Finished(**{k: _cat_rows([getattr(r, k) for r in rows]) for k in names})

    def to_rollout(self) -> Rollout:
        """The same rows as the static sampler's Rollout (host arrays)."""
        mask = np.arange(self.tokens.shape[1])[None] < self.lengths[:, None]
        return Rollout(
            tokens=self.tokens,
            logprobs=self.logprobs,
            mask=mask,
            lengths=self.lengths,
            kept=self.kept,
            n_compressions=self.n_compressions,
            evicted_fraction=np.asarray(evicted_fraction(self.kept, self.lengths, self.prompt_lengths)),
            kept_ids=self.kept_ids,
            top_ids=self.top_ids,
            top_logp=self.top_logp,
        )


def _rows(x: np.ndarray | None, i: int):
    return None if x is None else x[i : i + 1]


def _cat_rows(xs: list):
    return None if xs[0] is None else np.concatenate(xs)


@dataclasses.dataclass
class EngineStats:
    """Running totals for the bubble ratios and throughput (compile time apart: module doc)."""

    active_slot_steps: int = 0
    slot_steps: int = 0
    idle_slot_seconds: float = 0.0  # sum_k (Q - r_k) dt_k
    seconds: float = 0.0  # T
    tokens: int = 0
    compile_seconds: float = 0.0  # tracing, lowering and XLA compilation inside engine calls
    compiles: int = 0  # XLA compilations inside engine calls

    def bubble_wall(self, slots: int) -> float:
        return self.idle_slot_seconds / max(self.seconds * slots, 1e-12)

    def bubble_slots(self) -> float:
        return 1.0 - self.active_slot_steps / max(self.slot_steps, 1)


def bubble_ratio(intervals, slots: int) -> float:
    """SortedRL Eq. 4 for a list of (running requests r_k, duration dt_k)."""
    total = sum(dt for _, dt in intervals)
    return sum((slots - r) * dt for r, dt in intervals) / max(total * slots, 1e-12)


# SlotEngine's manual_axes: none (XLA partitions the programs), or RolloutMesh.manual_axes's
MANUAL_AXES = ((), shd.AXES, shd.BATCH)


def _bucket(n: int, cap: int, multiple: int) -> int:
    """Rows of a compiled insert call: the next power of two >= n, at least cap / 8 (a few
    shapes per engine) and `multiple`, a multiple of it, at most `cap`."""
    b = max(multiple, cap // 8, 1 << max(n - 1, 0).bit_length())
    b = min(b, cap)
    return -(-b // multiple) * multiple


def _row_layout(slots: np.ndarray, Q: int, groups: int, local: bool, rows: int | None = None):
    """Where an insert's n rows go in its compiled batch of `rows` rows (None: the bucket they
    need): returns (take [rows]: the input row each batch row holds, -1 for a padding row; its
    slot as the program indexes it). A row aimed at slot Q (warm_up) is padding. Over every slot
    (not `local`) the rows come in order, padding after them, a padding row's slot Q (dropped).
    `local` (per device: row group g holds slots g*q .. (g+1)*q - 1, q = Q / groups, and batch
    rows g*rows/groups onwards): each group's rows hold the requests aimed at its own slots, by
    their index in the group (q: padding), so each group prefills only its own requests."""
    slots = np.asarray(slots, np.int64)
    real = np.flatnonzero(slots < Q)
    if not local:
        rows = rows or _bucket(len(real), Q, groups)
        take = np.concatenate([real, np.full(rows - len(real), -1)])
        return take, np.where(take >= 0, slots[take], Q).astype(np.int32)
    q = Q // groups
    mine = [real[slots[real] // q == g] for g in range(groups)]
    rows = rows or _bucket(max(len(m) for m in mine) * groups, Q, groups)
    per = rows // groups
    take = np.concatenate([np.concatenate([m, np.full(per - len(m), -1)]) for m in mine])
    return take, np.where(take >= 0, slots[take] % q, q).astype(np.int32)


def _take_rows(x, take: np.ndarray, fill):
    """Rows `take` of array x (-1: a row of `fill`)."""
    x = np.asarray(x)
    out = np.full((len(take), *x.shape[1:]), fill, x.dtype)
    out[take >= 0] = x[take[take >= 0]]
    return out


def _check_engine_args(model_cfg, cfg, slots, prompt_len, segment_chunks, mesh, manual_axes) -> int:
    """SlotEngine's arguments, each bad one named in a one-line error; returns the data-parallel
    degree the slots are split over (1 without a mesh)."""
    if not isinstance(model_cfg, ModelConfig):
        raise ValueError(f"model_cfg={type(model_cfg).__name__}: a ModelConfig is accepted")
    if not isinstance(cfg, SamplerConfig):
        raise ValueError(f"cfg={type(cfg).__name__}: a SamplerConfig is accepted")
    if cfg.record_kept:
        raise ValueError(
            "sampler.record_kept (rl masked recompute) is not supported by "
            "rollout.scheduler='sorted'; use rollout.scheduler='batch'"
        )
    check_at_least("sorted.slots", slots, 1)
    check_at_least("prompt_len (data.max_prompt_len)", prompt_len, 1)
    check_at_least("sorted.segment_chunks", segment_chunks, 1)
    if manual_axes and tuple(manual_axes) not in MANUAL_AXES:
        raise ValueError(
            f"manual_axes={tuple(manual_axes)}: accepted values are {MANUAL_AXES} (rollout/layout.py "
            "RolloutMesh.manual_axes: each row group runs its own slots)"
        )
    if mesh is None or mesh.size <= 1:
        return 1
    if not {"data", "fsdp"} <= set(mesh.shape):
        raise ValueError(
            f"mesh axes {tuple(mesh.shape)}: the engine splits its slots over "
            "'data' x 'fsdp' (sharding.make_mesh's axes)"
        )
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    if slots % dp:
        raise ValueError(
            f"sorted.slots={slots} must be a multiple of mesh data x fsdp = {dp} "
            "(the slots are split over those devices)"
        )
    return dp


class SlotEngine:
    """Q slots decoding requests of prompts up to `prompt_len` tokens (see the module doc)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        cfg: SamplerConfig,
        slots: int,
        prompt_len: int,
        *,
        segment_chunks: int = 2,
        mesh: Mesh | None = None,
        manual_axes: tuple[str, ...] = (),
    ):
        self.dp = _check_engine_args(model_cfg, cfg, slots, prompt_len, segment_chunks, mesh, manual_axes)
        if mesh is None or mesh.size <= 1:
            mesh, manual_axes = None, ()
        elif not manual_axes:
            cfg = dataclasses.replace(cfg, mesh=mesh)
        self.mesh, self.manual_axes = mesh, tuple(manual_axes)
        self.model_cfg, self.cfg, self.Q, self.P = model_cfg, cfg, slots, prompt_len
        self.M = cfg.max_new_tokens
        self.records = tuple(token_records(cfg))  # the per-token records beside tokens and log-probs
        self.C = cache_capacity(cfg.kv, prompt_len, self.M)
        self.segment_chunks = segment_chunks
        self.stats = EngineStats()
        self.sync = False  # block on every insert and harvest (profiles; module doc)
        self._device_s = 0.0  # sync: device time blocked on, for the next segment's interval
        self.shape = programs.EngineShape(
            model_cfg, cfg, slots, prompt_len, self.M, self.C, segment_chunks, self.records
        )
        jit = programs.jitted(self.shape, mesh, self.manual_axes)
        self._segment, self._insert, self._harvest, self._release = jit.segment, jit.insert, jit.harvest, jit.release
        self._all_slots = None  # the harvest's row index, every slot (built on first use)
        self._warmed: set[bool] = set()  # insert kinds (resume?) whose buckets are compiled

    # ------------------------------------------------------------------ device programs

    def init_state(self) -> SlotState:
        state = programs.empty_state(self.shape)
        if self.mesh is None:
            # committed to the device, as every program's output is: a jit cache key includes
            # committedness, so an uncommitted fresh state would compile the insert again
            return jax.device_put(state, jax.devices()[0])
        # in the layout the programs return it (slots split, the cache's heads too), so the
        # second segment call does not compile again for another input layout
        return shd.place(state, programs.state_shardings(self.shape, self.mesh))

    def _place(self, tree):
        return tree if self.mesh is None else shd.shard_batch(tree, self.mesh)

    # ------------------------------------------------------------------ host side

    def _fetch(self, x):
        return to_host(x)

    def segment_start(self, params, state: SlotState, key, version: int):
        """Dispatch one segment with the weights of `version` (returns at once); returns
        (state, a handle for segment_wait)."""
        tic, compiled = time.perf_counter(), compile_clock.Since()
        state, active, steps = self._segment(params, state, key, jnp.int32(version))
        return state, (tic, compiled, state.done, state.t, active, steps)

    def segment_wait(self, handle):
        """Wait for a dispatched segment; returns done [Q] and t [Q] as host arrays and counts the
        segment's interval (dispatch to done flags, compile time apart) at its mean running
        slots, with the device time of inserts and harvests blocked on before it (sync)."""
        tic, compiled, *arrays = handle
        done, t, active, steps = self._fetch(tuple(arrays))
        dt = time.perf_counter() - tic - self._compiled(compiled) + self._take_device_s()
        active, steps = int(active), int(steps)
        st = self.stats
        st.active_slot_steps += active
        st.slot_steps += self.Q * steps
        st.tokens += active
        running = active / max(steps, 1)
        st.idle_slot_seconds += (self.Q - running) * dt
        st.seconds += dt
        return done, t

    def segment(self, params, state: SlotState, key, version: int):
        """Run one segment; returns (state, done [Q] and t [Q] as host arrays)."""
        state, handle = self.segment_start(params, state, key, version)
        done, t = self.segment_wait(handle)
        return state, done, t

    def _compiled(self, since: compile_clock.Since) -> float:
        """Count what compiled since `since` apart; returns its seconds."""
        self.stats.compile_seconds += since.seconds
        self.stats.compiles += since.compiles
        return since.seconds

    def _take_device_s(self) -> float:
        dt, self._device_s = self._device_s, 0.0
        return dt

    def _host_call(self, tic: float, compiled: compile_clock.Since, out) -> None:
        """Account an insert or harvest dispatch: its host time idle, compile time apart, and,
        with `sync`, its device time (blocked on here) kept for the next segment's interval."""
        dt = time.perf_counter() - tic - self._compiled(compiled)
        if self.sync:
            t0 = time.perf_counter()
            jax.block_until_ready(out)
            self._device_s += time.perf_counter() - t0
        self._idle(dt)

    def _idle(self, dt: float) -> None:
        self.stats.idle_slot_seconds += self.Q * dt
        self.stats.seconds += dt

    def insert(
        self,
        params,
        state: SlotState,
        key,
        slots,
        prompts,
        lengths,
        request,
        *,
        limits=None,
        partial: Finished | None = None,
        version: int = 0,
    ) -> SlotState:
        """Start requests `request` (prompts [n, P] right-padded, lengths [n]) in free `slots`,
        prefilled with the weights of `version`; with `partial` (their harvested partial
        responses) they resume after re-prefilling prompt + partial response. Its host time is
        idle in the wall bubble ratio, its device prefill inside the next segment's interval.
        The first insert of each kind (fresh, resumed) compiles every row bucket (warm_up)."""
        state = self.warm_up(params, state, key, resume=partial is not None)
        return self._insert_rows(
            params, state, key, slots, prompts, lengths, request, limits=limits, partial=partial, version=version
        )

    def warm_up(self, params, state: SlotState, key, *, resume: bool) -> SlotState:
        """Compile the insert of one kind (fresh or `resume`d requests) for every row bucket, once
        per engine: its program runs for each bucket with every row aimed at the padding slot Q
        (dropped: nothing is written), so that no bucket compiles in a later group, or a later
        iteration. Only its compile time is counted (compile_seconds); the rest is not the run's
        insert time. `insert` calls it; a scheduler that will resume calls it up front."""
        if resume in self._warmed:
            return state
        self._warmed.add(resume)
        compiled = compile_clock.Since()
        stats, device_s = dataclasses.replace(self.stats), self._device_s
        for nb in sorted({_bucket(n, self.Q, self.dp) for n in range(1, self.Q + 1)}):
            partial = None
            if resume:
                zeros = np.zeros((nb, self.M), np.int32)
                ones = np.ones((nb,), np.int32)
                partial = Finished(
                    ones * 0,
                    zeros,
                    zeros.astype(np.float32),
                    zeros,
                    zeros,
                    lengths=ones,
                    n_compressions=ones * 0,
                    prompt_lengths=ones,
                    **empty_records(self.cfg, (nb, self.M), np),
                )
            state = self._insert_rows(
                params,
                state,
                key,
                [self.Q] * nb,
                np.zeros((nb, self.P), np.int32),
                np.ones((nb,), np.int32),
                np.zeros((nb,), np.int32),
                partial=partial,
                rows=nb,
            )
        jax.block_until_ready(state.done)  # none of it in the next segment's interval
        self.stats, self._device_s = stats, device_s
        self._compiled(compiled)
        return state

    def _insert_rows(
        self,
        params,
        state: SlotState,
        key,
        slots,
        prompts,
        lengths,
        request,
        *,
        limits=None,
        partial: Finished | None = None,
        version: int = 0,
        rows: int | None = None,
    ) -> SlotState:
        tic, compiled = time.perf_counter(), compile_clock.Since()
        args, prefix = self.insert_args(slots, prompts, lengths, request, limits=limits, partial=partial, rows=rows)
        resume = partial is not None
        state = self._insert(params, state, key, *args, prefix, jnp.int32(version), resume=resume)
        self._host_call(tic, compiled, state.done)
        return state

    def insert_args(self, slots, prompts, lengths, request, *, limits=None, partial=None, rows=None) -> tuple:
        """The insert program's row arguments (slots, prompts, lengths, request, t0, limit) and
        prefix (the rows' tokens so far and records) on the engine's devices, in a batch of
        `rows` rows (None: the bucket they need; warm_up names each bucket) laid out by
        _row_layout (per device: each row group's rows aimed at its own slots)."""
        n = len(slots)
        take, slot_index = _row_layout(slots, self.Q, self.dp, bool(self.manual_axes), rows)
        M = self.M
        prompts = np.asarray(prompts, np.int32)
        lengths = np.asarray(lengths, np.int32)
        t0 = np.zeros((n,), np.int32)
        tokens = np.full((n, M), self.cfg.pad_token_id, np.int32)
        logprobs, kept, versions = np.zeros((n, M), np.float32), np.zeros((n, M), np.int32), np.zeros((n, M), np.int32)
        n_comp = np.zeros((n,), np.int32)
        records = {}  # fresh: the insert starts them empty on the device
        if partial is not None:
            t0 = partial.lengths.astype(np.int32)
            tokens, logprobs, kept, versions = partial.tokens, partial.logprobs, partial.kept, partial.version
            n_comp = partial.n_compressions
            records = {name: getattr(partial, name) for name in self.records}
            width = self.P + M
            joined = np.full((n, width), self.cfg.pad_token_id, np.int32)
            for i in range(n):
                p = int(lengths[i])
                joined[i, :p] = prompts[i, :p]
                joined[i, p : p + t0[i]] = tokens[i, : t0[i]]
            prompts, lengths = joined, lengths + t0
        limit = np.full((n,), M, np.int32) if limits is None else np.asarray(limits, np.int32)
        args = [prompts, lengths, np.asarray(request, np.int32), t0, limit]
        fills = [0, 1, 0, 0, M]  # a padding row's values: a one-token prompt, aimed at no slot
        args = [slot_index, *(_take_rows(a, take, f) for a, f in zip(args, fills))]
        prefix = jax.tree.map(lambda a: _take_rows(a, take, 0), (tokens, logprobs, kept, versions, n_comp, records))
        return self._place((args, prefix))

    def harvest_start(self, state: SlotState):
        """Dispatch a copy of every slot's response (all Q rows: one compiled shape); the slots
        may be inserted into at once. Read it with harvest_read."""
        tic, compiled = time.perf_counter(), compile_clock.Since()
        if self._all_slots is None:  # every slot, as the program indexes it (per device: its group's own)
            idx = np.arange(self.Q, dtype=np.int32) % (self.Q // self.dp if self.manual_axes else self.Q)
            self._all_slots = self._place(idx) if self.mesh is not None else jnp.asarray(idx)
        out = self._harvest(state, self._all_slots)
        self._host_call(tic, compiled, out)
        return out

    def harvest_read(self, pending, slots, *, idle: bool = True) -> Finished:
        """Host copies of the responses of `slots` in a harvest_start copy; `idle`: the wait is
        idle time (False while a segment is running: its interval covers the wait)."""
        tic, compiled = time.perf_counter(), compile_clock.Since()
        rows = np.asarray(slots, np.int64)
        *out, records = jax.tree.map(lambda x: np.asarray(x)[rows], self._fetch(pending))
        if idle:
            self._idle(time.perf_counter() - tic - self._compiled(compiled) + self._take_device_s())
        return Finished(*out[:5], lengths=out[5], n_compressions=out[6], prompt_lengths=out[7], **records)

    def harvest(self, state: SlotState, slots) -> Finished:
        """Host copies of the responses in `slots` (the slots are then free to insert into)."""
        return self.harvest_read(self.harvest_start(state), slots)

    def release_all(self, state: SlotState) -> SlotState:
        """Stop decoding in every slot (their occupants were harvested or dropped)."""
        tic, compiled = time.perf_counter(), compile_clock.Since()
        state = self._release(state)
        self._host_call(tic, compiled, state.done)
        return state

    def run(self, params, key, prompts, lengths, request_ids=None, *, limits=None, version: int = 0) -> Finished:
        """Decode every request with continuous batching (FIFO refills, no scheduling policy):
        the reference use of the engine (tests, benchmark). Rows of the result follow the input."""
        N = len(prompts)
        ids = np.arange(N, dtype=np.int32) if request_ids is None else np.asarray(request_ids, np.int32)
        limits = np.full((N,), self.M, np.int32) if limits is None else np.asarray(limits, np.int32)
        state = self.init_state()
        free = list(range(self.Q))
        occupant = {}  # slot -> input row
        queue = list(range(N))
        results = {}
        self.stats_at_drain = None  # the totals when the queue ran empty (the drain follows)
        while queue or occupant:
            if not queue and self.stats_at_drain is None:
                self.stats_at_drain = dataclasses.replace(self.stats)
            if queue and free:
                take, queue = queue[: len(free)], queue[len(free) :]
                slots, free = free[: len(take)], free[len(take) :]
                state = self.insert(
                    params,
                    state,
                    key,
                    slots,
                    np.asarray(prompts)[take],
                    np.asarray(lengths)[take],
                    ids[take],
                    limits=limits[take],
                    version=version,
                )
                occupant.update(zip(slots, take))
            state, done, _ = self.segment(params, state, key, version)
            finished = [s for s in occupant if done[s]]
            if finished:
                got = self.harvest(state, finished)
                for j, s in enumerate(finished):
                    results[occupant.pop(s)] = got.row(j)
                free.extend(finished)
        if self.stats_at_drain is None:  # the last insert's requests all ended in one segment
            self.stats_at_drain = dataclasses.replace(self.stats)
        return Finished.concat([results[i] for i in range(N)])
