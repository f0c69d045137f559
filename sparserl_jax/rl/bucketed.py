"""The learner's scoring and update at the cost of the real tokens (length-bucketed micro-batches).

`make_update_fn` (rl/update.py) is the update as one program over the padded [B, T] batch; this
is the same computation driven micro-batch by micro-batch from the host, so that each micro-batch
can have its own width (rl/buckets.py): rows trimmed to the longest among them, rounded up to a
multiple of update.length_bucket. Per micro-batch one jitted program (compiled once per width)
computes the learner's log-probs, the corrections and the gradient of the loss *numerator*,
accumulated in float32; per minibatch one jitted program divides by the minibatch's denominator
(counted tokens or rows, known once every micro-batch is done) and takes the optimizer step.
Dividing at the end is exact: the denominator is a constant of the minibatch.

Forwards that compute nothing new are skipped, and each batch takes the cheaper of the exact
paths its settings allow (`paths`, `choose`; a cost model over the planned widths):
  fused   with one minibatch and one epoch (update.reuse_old_forward), log pi_old is the
          learner's first forward under stop_gradient: theta_old is theta before the only step;
  scored  otherwise, or where it is cheaper, pi_old is teacher-forced first in length-sorted
          chunks of update.score_batch_size rows, and every row's weight normaliser is fixed before
          rows are regrouped (row_weight_normalisers), so regrouping changes no number beyond
          rounding (fused with IBR normalised per micro-batch keeps the micro-batches' rows);
  pi_ref  teacher-forced inside the micro-batch's program when each row is visited once (one
          epoch), scored first otherwise, not computed at all when loss.beta = 0.
Every path's programs are compiled for every width before the first update (`warm_up`, with
update.compile_ahead, the default), so none compiles later and the widest one's memory is known at
once.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from sparserl_jax import distributed
from sparserl_jax.model import precision, sharding, transformer
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rl import buckets
from sparserl_jax.rl.config import RLConfig
from sparserl_jax.rl.corrections.compose import (
    mismatch_metrics,
    row_weight_normalisers,
    weight_normalisation,
)
from sparserl_jax.rl.update import _combine, apply_gradients, head_window, micro_batch_loss, reduce_steps

TOKEN_INPUTS = ("tokens", "response_mask", "sampler_logp")  # [B, T] host arrays the update reads
KEPT = "kept_ids"  # [B, T, K] the sampler's kept sets, in a batch sampled with top-p / top-k
TOP = "top_ids"  # [B, T, A] the sampler's top candidates: pi_old's log-probs of them (agreement)


@dataclasses.dataclass(frozen=True)
class Path:
    """How one rollout batch is scored and updated (BucketedUpdate.paths)."""

    fused: bool  # log pi_old is the update's own first forward (no scoring pass)
    grouped: bool  # a minibatch's rows are regrouped by length into micro-batches
    ref_inside: bool  # log pi_ref is teacher-forced inside each micro-batch's program


@dataclasses.dataclass
class LearnerOutput:
    """What one update call returns besides params and optimizer state (host values)."""

    metrics: dict
    old_logp: np.ndarray  # [B, T] log pi_old (0 beyond each row's micro-batch width)
    # [B, T, A] log pi_old of the sampler's top candidates (batch["top_ids"]; -inf where none), or None
    old_top_logp: np.ndarray | None
    score_s: float  # seconds of the scoring pass before the update (pi_old / pi_ref; 0 if none)
    positions: int  # row positions run through the update's forwards (rows x widths, all epochs)


class BucketedUpdate:
    """Scoring and update of one run's rollout batches (see the module doc)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        cfg: RLConfig,
        optimizer: optax.GradientTransformation,
        *,
        max_len: int | None = None,
        mesh=None,
        donate: bool = True,
        kept_k: int = 0,
        top_k: int = 0,
        response_len: int | None = None,
    ):
        """`max_len`: the widest batch a run can produce (data.max_prompt_len +
        rollout.max_new_tokens); narrower batches are padded to it, so the compiled widths are
        the run's, not each batch's (a batch whose prompts pad to another width compiles nothing).
        `kept_k`: the width of the kept sets the run's batches carry (rollout/sampling.py
        kept_width(rollout.top_k) when it trains with filters; 0 without) and of the top candidates they record (rollout.agreement_k; 0:
        none): what warm_up compiles for. `response_len`: the longest response a run samples
        (rollout.max_new_tokens), which update.head_window="response" needs: the head's window."""
        if max_len is not None and max_len < 1:
            raise ValueError(f"max_len={max_len} must be >= 1 (data.max_prompt_len + rollout.max_new_tokens)")
        u = cfg.update
        if u.head_window == "response" and (response_len is None or response_len < 1):
            raise ValueError(
                f"rl.update.head_window=response needs the run's response length (rollout.max_new_tokens); got {response_len}"
            )
        self.model_cfg, self.cfg, self.optimizer, self.max_len = model_cfg, cfg, optimizer, max_len
        self.kept_k, self.top_k = kept_k, top_k
        self.window_len = response_len if u.head_window == "response" else None
        self.mesh = mesh if mesh is not None and mesh.size > 1 else None
        # the forwards keep the activations split on B over self.mesh (model/activation_sharding.py)
        self._score = jax.jit(
            functools.partial(
                _score_rows, model_cfg, u.temperature, u.chunk_tokens, mesh=self.mesh, window_len=self.window_len
            )
        )
        self._micro = jax.jit(
            functools.partial(_micro_step, model_cfg, cfg, mesh=self.mesh, window_len=self.window_len),
            static_argnames=("fused",),
            donate_argnums=(2,),
        )
        # the accumulator is not donated to the step: no output has its place (a warning)
        self._apply = jax.jit(functools.partial(_apply, optimizer), donate_argnums=(0, 1) if donate else ())
        # model.dtype != model.param_dtype (model/precision.py): the forwards and the gradient
        # read a compute copy of the master, re-cast after each optimizer step into its buffers
        self.mixed = precision.is_mixed(model_cfg)
        self._recast = jax.jit(
            lambda params, old: precision.cast_floats(params, model_cfg.dtype), donate_argnums=(1,) if donate else ()
        )
        self._zeros_fns: dict = {}  # (params' tree, shardings) -> jitted float32 zeros like them
        self._mismatch = jax.jit(functools.partial(mismatch_metrics, cfg=cfg))
        self._row_norms = jax.jit(functools.partial(row_weight_normalisers, cfg=cfg))
        self._warmed: set = set()

    # ------------------------------------------------------------------ plans

    def paths(self, rows: int) -> list[Path]:
        """The exact ways to score and update a batch of `rows` rows (each gives today's padded
        update to float rounding), cheapest-first candidates for `choose`:
        fused   log pi_old from the update's first forward: one minibatch, one epoch
                (update.reuse_old_forward), not with ibr.normalisation='global' (its normaliser
                needs every row's pi_old before the first gradient); rows regrouped by length
                unless IBR is normalised per micro-batch (the composition is then part of the math
                and pi_old is only known inside each micro-batch's program);
        scored  pi_old teacher-forced first, every row's weight normaliser fixed, rows regrouped.
        pi_ref is teacher-forced inside the micro-batch program when each row is visited once
        (one epoch), else scored first; not at all when loss.beta = 0."""
        cfg, u = self.cfg, self.cfg.update
        norm = weight_normalisation(cfg)
        ref_inside = cfg.loss.beta > 0 and u.epochs == 1
        scored = Path(False, u.group_by_length, ref_inside)
        if not (u.reuse_old_forward and u.epochs == 1 and rows == u.minibatch_size and norm != "global"):
            return [scored]
        fused = Path(True, u.group_by_length and norm != "micro_batch", ref_inside)
        return [fused] if fused.grouped or not u.group_by_length else [fused, scored]

    def cost(self, path: Path, lengths_B: np.ndarray, widths: tuple[int, ...]) -> float:
        """Forward-pass units of `path` on these rows: a forward 1 per position, a forward and
        backward 3 (+1 for pi_ref inside), scoring 1 per position of each scored policy."""
        u, B = self.cfg.update, len(lengths_B)
        update = sum(len(mb.rows) * mb.width for mb in self._plan(path, lengths_B, widths, 0))
        scoring = sum(
            len(mb.rows) * mb.width
            for mb in buckets.plan(lengths_B, np.arange(B), min(u.score_batch_size, B), widths, group=u.group_by_length)
        )
        scored = (not path.fused) + (self.cfg.loss.beta > 0 and not path.ref_inside)
        return u.epochs * (B // u.minibatch_size) * update * (3 + path.ref_inside) + scored * scoring

    def choose(self, lengths_B: np.ndarray, widths: tuple[int, ...]) -> Path:
        """The cheapest exact path for these row lengths (the first on a tie)."""
        return min(self.paths(len(lengths_B)), key=lambda p: self.cost(p, lengths_B, widths))

    def _plan(self, path: Path, lengths_B: np.ndarray, widths, start: int) -> list[buckets.MicroBatch]:
        u = self.cfg.update
        return buckets.plan(
            lengths_B, np.arange(start, start + u.minibatch_size), u.micro_batch_size, widths, group=path.grouped
        )

    def widths(self, T: int) -> tuple[int, ...]:
        return buckets.bucket_widths(T, self.cfg.update.length_bucket, self.cfg.update.max_buckets)

    # ------------------------------------------------------------------ placement

    def _place(self, x):
        """Host rows onto the devices: split over data x fsdp when they divide, else replicated."""
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, x)
        dp = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        rows = jax.tree.leaves(x)[0].shape[0]
        if rows % dp == 0:
            return sharding.shard_batch(x, self.mesh)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return sharding.place(x, jax.tree.map(lambda _: replicated, x))

    def _micro_inputs(self, host: dict, rows: np.ndarray, width: int, norms_B, *, fused: bool) -> tuple[dict, object]:
        """A micro-batch's rows at `width`; the top candidates only where pi_old is its forward."""
        mb = {k: host[k][rows, :width] for k in host if k != "advantages" and (k != TOP or fused)}
        mb["advantages"] = host["advantages"][rows]
        return self._place(mb), None if norms_B is None else self._place(norms_B[rows])

    # ------------------------------------------------------------------ compile

    def warm_up(self, params, ref_params, opt_state, B: int, T: int) -> None:
        """Compile every program a batch of [B, T] rows can run (each path and width once),
        without running them; a no-op after the first call for that shape. `params` is the
        master; the forwards are compiled for its compute copy."""
        if (B, T) in self._warmed:
            return
        self._warmed.add((B, T))
        u, with_ref = self.cfg.update, self.cfg.loss.beta > 0
        m, s = u.micro_batch_size, min(u.score_batch_size, B)

        def zeros(rows, w):
            out = {
                "tokens": np.zeros((rows, w), np.int32),
                "response_mask": np.zeros((rows, w), bool),
                "sampler_logp": np.zeros((rows, w), np.float32),
            }
            if self.kept_k:
                out[KEPT] = np.full((rows, w, self.kept_k), -1, np.int32)
            if self.top_k:
                out[TOP] = np.full((rows, w, self.top_k), -1, np.int32)
            return out

        acc = self._zeros(params)
        paths = self.paths(B)
        master, params = params, self._compute_like(params)
        for w in self.widths(T):
            z = self._place(zeros(s, w))
            kept, top = z.get(KEPT), z.get(TOP)
            mask = z["response_mask"] if self.window_len else None
            if not all(p.fused for p in paths):  # pi_old (with its top candidates)
                self._score.lower(params, z["tokens"], kept, top, mask).compile()
            if with_ref and not all(p.ref_inside for p in paths) and top is not None:  # pi_ref
                self._score.lower(ref_params, z["tokens"], kept, None, mask).compile()
            for path in {(p.fused, p.ref_inside) for p in paths}:
                fused, ref_inside = path
                host = zeros(m, w)
                if not fused:
                    host["old_logp"] = np.zeros((m, w), np.float32)
                if with_ref and not ref_inside:
                    host["ref_logp"] = np.zeros((m, w), np.float32)
                host["advantages"] = np.zeros((m,), np.float32)
                norms = None if fused else np.ones(m, np.float32)
                mb, norm = self._micro_inputs(host, np.arange(m), w, norms, fused=fused)
                self._micro.lower(params, ref_params if ref_inside else None, acc, mb, norm, fused=fused).compile()
        scalar = self._scalar(0.0)  # placed as the micro-batch programs return their scalars
        self._apply.lower(master, opt_state, acc, scalar, scalar).compile()
        if self.mixed:
            self._recast.lower(master, params).compile()
        full = self._place(zeros(B, T))
        self._mismatch.lower(full["sampler_logp"], full["sampler_logp"], full["response_mask"]).compile()
        if not all(p.fused for p in paths):
            self._row_norms.lower(full["sampler_logp"], full["sampler_logp"], full["response_mask"]).compile()

    def _committed(self, tree):
        """Uncommitted leaves (fresh arrays: optax's step counts, a copy of the weights) committed
        to the device, as the update step returns them: a jit's cache key holds each input's
        placement, so a first update on uncommitted leaves would compile every program again for
        the second (committed leaves pass through untouched)."""
        if self.mesh is not None:
            return tree
        device = jax.devices()[0]
        return jax.tree.map(lambda x: x if getattr(x, "committed", True) else jax.device_put(x, device), tree)

    def _zeros(self, params):
        """A float32 gradient accumulator laid out like `params` (an output that reads no input
        would otherwise be left uncommitted, and the first micro-batch would compile again)."""
        shardings = jax.tree.map(lambda x: x.sharding, params)
        key = (jax.tree.structure(params), tuple(jax.tree.leaves(shardings)))
        if key not in self._zeros_fns:
            self._zeros_fns[key] = jax.jit(
                lambda p: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p), out_shardings=shardings
            )
        return self._zeros_fns[key](params)

    def _scalar(self, x: float):
        """A float32 scalar committed to the device (replicated on a mesh)."""
        if self.mesh is None:
            return jax.device_put(np.float32(x), jax.devices()[0])
        return sharding.place(np.float32(x), NamedSharding(self.mesh, PartitionSpec()))

    @staticmethod
    def _micro_sum(xs):
        return functools.reduce(jnp.add, xs)

    # ------------------------------------------------------------------ scoring

    def score(
        self, params, tokens_BxT: np.ndarray, lengths_B: np.ndarray, kept_BxTxK=None, top_BxTxA=None, mask_BxT=None
    ):
        """Teacher-forced log-probs [B, T] (position t scores tokens[t + 1]) in length-sorted
        chunks of update.score_batch_size rows at their bucketed widths; 0 beyond a chunk's width.
        With the sampler's kept sets, renormalised over them; with top candidates' ids, also their
        log-probs ([B, T, A], -inf where none): then (logp, top_logp). `mask_BxT` (the response
        mask): where the head's window begins (update.head_window="response"; 0 outside it)."""
        if self.window_len and mask_BxT is None:
            raise ValueError("rl.update.head_window=response: score() needs the rows' response mask")
        mask_BxT = mask_BxT if self.window_len else None
        B, T = tokens_BxT.shape
        u = self.cfg.update
        s = min(u.score_batch_size, B)
        out = np.zeros((B, T), np.float32)
        top_out = None if top_BxTxA is None else np.full(top_BxTxA.shape, -np.inf, np.float32)
        pending = []
        for mb in buckets.plan(lengths_B, np.arange(B), s, self.widths(T), group=u.group_by_length):
            rows = np.concatenate([mb.rows, np.repeat(mb.rows[-1:], s - len(mb.rows))])  # fixed shape
            cut = [
                None if x is None else self._place(x[rows, : mb.width])
                for x in (tokens_BxT, kept_BxTxK, top_BxTxA, mask_BxT)
            ]
            pending.append((mb, self._score(params, *cut)))
        for mb, res in pending:
            res = distributed.to_host(res)
            logp, top = (res, None) if top_out is None else res
            out[mb.rows, : mb.width] = logp[: len(mb.rows)]
            if top_out is not None:
                top_out[mb.rows, : mb.width] = top[: len(mb.rows)]
        return out if top_out is None else (out, top_out)

    # ------------------------------------------------------------------ update

    def _compute_like(self, params):
        """The compute copy's shapes, dtypes and layout (params themselves when not mixed)."""
        if not self.mixed:
            return params
        dtype = jnp.dtype(self.model_cfg.dtype)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding), params)

    def __call__(self, params, ref_params, opt_state, batch: dict, *, compute=None):
        """One rollout batch (host arrays: tokens, response_mask, sampler_logp [B, T],
        advantages [B]) -> (params, opt_state, LearnerOutput), in four phases: the batch padded
        to the run's width and its path chosen, pi_old / pi_ref scored where the update does not
        compute them, the optimizer steps over minibatches of length-bucketed micro-batches, and
        the metrics with pi_old's log-probs."""
        u = self.cfg.update
        B, T_batch = batch["tokens"].shape
        if B % u.minibatch_size:
            raise ValueError(
                f"rollout batch of {B} responses must be a multiple of update.minibatch_size={u.minibatch_size}"
            )
        T = max(T_batch, self.max_len or 0)
        lengths = buckets.row_lengths(batch["response_mask"])
        if self.window_len:
            self._check_window(batch["response_mask"], lengths)
        params, ref_params, opt_state = self._committed((params, ref_params, opt_state))
        if u.compile_ahead:
            self.warm_up(params, ref_params, opt_state, B, T)
        # theta_old as the forwards read it: `compute` (the sampler's copy, donated when params
        # are) or cast here; the master itself when model.dtype is model.param_dtype
        policy = (
            params
            if not self.mixed
            else compute
            if compute is not None
            else precision.compute_copy(params, self.model_cfg)
        )
        widths = self.widths(T)
        path = self.choose(lengths, widths)
        host = self._padded(batch, T)
        norms_B, metrics, old_top, score_s = self._score_first(policy, ref_params, host, lengths, path)
        params, opt_state, steps, old_parts, positions = self._optimizer_steps(
            params, ref_params, opt_state, policy, host, lengths, widths, path, norms_B
        )
        metrics.update(self._step_metrics(steps, B))
        metrics["old_from_update"] = float(path.fused)
        if path.fused:
            old, old_top = self._old_from_update(host, old_parts, B, T)
        else:
            old = host["old_logp"]
        full = self._place({"old": old, "sampler": host["sampler_logp"], "mask": host["response_mask"]})
        metrics.update(
            {
                k: float(v)
                for k, v in distributed.to_host(self._mismatch(full["old"], full["sampler"], full["mask"])).items()
            }
        )
        old_top = None if old_top is None else old_top[:, :T_batch]
        return params, opt_state, LearnerOutput(metrics, old[:, :T_batch], old_top, score_s, positions)

    def _check_window(self, response_mask_BxT, lengths_B) -> None:
        """Every row's response positions inside the head's window (update.head_window="response"),
        else a clear error: positions outside it would lose their log-probs."""
        mask = np.asarray(response_mask_BxT, bool)
        spans_B = np.where(mask.any(axis=1), lengths_B - 1 - np.argmax(mask, axis=1), 0)
        if spans_B.max(initial=0) > self.window_len:
            raise ValueError(
                f"rl.update.head_window=response: a row has {int(spans_B.max())} response positions, more than "
                f"the head's window of {self.window_len} (rollout.max_new_tokens)"
            )

    def _padded(self, batch: dict, T: int) -> dict:
        """The batch's host arrays padded to width T (kept sets and top ids with -1: none), after
        checking it carries the records this update was built for."""
        for key, k, what in ((KEPT, self.kept_k, "kept sets"), (TOP, self.top_k, "top candidates")):
            if (key in batch) != bool(k):
                raise ValueError(
                    f"the batch {'carries' if key in batch else 'lacks'} the sampler's {what} "
                    f"(batch[{key!r}]) and this update was built for {key.split('_')[0]}_k={k}"
                )
        T_batch = batch["tokens"].shape[1]

        def pad(x):  # [B, T_batch, ...] -> [B, T, ...]
            if x.ndim == 1:
                return x
            widths = ((0, 0), (0, T - T_batch)) + ((0, 0),) * (x.ndim - 2)
            return np.pad(x, widths, constant_values=-1 if x.ndim == 3 else 0)

        return {k: pad(np.asarray(batch[k])) for k in (*TOKEN_INPUTS, "advantages", KEPT, TOP) if k in batch}

    def _score_first(self, policy, ref_params, host: dict, lengths, path):
        """pi_old (unfused path) and pi_ref (when the update does not compute it) scored before the
        update, into `host`; the rows' weight normalisers. Returns (norms_B or None, metrics,
        pi_old's top-candidate log-probs or None, seconds scoring)."""
        with_ref = self.cfg.loss.beta > 0
        norms_B, metrics, old_top, score_s = None, {}, None, 0.0
        if not path.fused or (with_ref and not path.ref_inside):
            t0 = time.perf_counter()
            kept, mask = host.get(KEPT), host["response_mask"]
            if not path.fused:
                host["old_logp"] = self.score(policy, host["tokens"], lengths, kept, host.get(TOP), mask)
                if TOP in host:
                    host["old_logp"], old_top = host["old_logp"]
            if with_ref and not path.ref_inside:
                host["ref_logp"] = self.score(ref_params, host["tokens"], lengths, kept, None, mask)
            score_s = time.perf_counter() - t0
        if not path.fused:
            full = self._place({k: host[k] for k in ("old_logp", "sampler_logp", "response_mask")})
            norms_B = np.asarray(
                distributed.to_host(self._row_norms(full["old_logp"], full["sampler_logp"], full["response_mask"]))
            )
            if weight_normalisation(self.cfg) == "global":
                metrics["ibr/normaliser"] = float(norms_B[0])
        return norms_B, metrics, old_top, score_s

    def _optimizer_steps(self, params, ref_params, opt_state, policy, host, lengths, widths, path, norms_B):
        """update.epochs passes over the minibatches: each micro-batch's numerator gradient
        accumulated, then one optimizer step dividing by the minibatch's denominator (counted
        tokens, or rows). Returns (params, opt_state, [(micro-batch metrics, step metrics)],
        the fused path's (micro-batch, pi_old log-probs, top) parts, positions run)."""
        cfg, u = self.cfg, self.cfg.update
        B = host["tokens"].shape[0]
        positions, old_parts, steps = 0, [], []
        for _ in range(u.epochs):
            for start in range(0, B, u.minibatch_size):
                acc, nums, parts = self._zeros(params), [], []
                for mb in self._plan(path, lengths, widths, start):
                    inputs, norm = self._micro_inputs(host, mb.rows, mb.width, norms_B, fused=path.fused)
                    acc, num, m, logp, top = self._micro(
                        policy, ref_params if path.ref_inside else None, acc, inputs, norm, fused=path.fused
                    )
                    nums.append(num)
                    parts.append(m)
                    positions += len(mb.rows) * mb.width
                    if path.fused:
                        old_parts.append((mb, logp, top))
                counted = "counted_tokens" if "counted_tokens" in parts[0] else "tokens"
                tokens = self._micro_sum([p[counted] for p in parts])
                denom = tokens if cfg.loss.aggregation == "token_mean" else self._scalar(u.minibatch_size)
                loss = self._micro_sum(nums)
                params, opt_state, applied = self._apply(params, opt_state, acc, loss, denom)
                policy = self._recast(params, policy) if self.mixed else params
                steps.append((parts, applied))
        return params, opt_state, steps, old_parts, positions

    def _step_metrics(self, steps, B: int) -> dict:
        """Token-weighted over micro-batches, then over optimizer steps (as make_update_fn)."""
        per_step = []
        for parts, applied in distributed.to_host(steps):
            stacked = {k: np.stack([np.asarray(p[k]) for p in parts]) for k in parts[0]}
            per_step.append({**{k: np.asarray(v) for k, v in _combine(stacked, stacked["tokens"]).items()}, **applied})
        stacked = {k: np.stack([s[k] for s in per_step]) for k in per_step[0]}
        metrics = {k: float(v) for k, v in reduce_steps(stacked).items()}
        metrics["steps"] = float(self.cfg.update.epochs * (B // self.cfg.update.minibatch_size))
        if self.cfg.loss.beta <= 0:
            metrics.pop("loss/kl_ref", None)  # no pi_ref computed: nothing to report
        return metrics

    def _old_from_update(self, host: dict, old_parts, B: int, T: int):
        """pi_old's log-probs [B, T] (and top candidates') gathered from the fused update's
        micro-batches."""
        old = np.zeros((B, T), np.float32)
        old_top = np.full(host[TOP].shape, -np.inf, np.float32) if TOP in host else None
        for mb, logp, top in old_parts:
            old[mb.rows, : mb.width] = np.asarray(distributed.to_host(logp))
            if top is not None:
                old_top[mb.rows, : mb.width] = np.asarray(distributed.to_host(top))
        return old, old_top


def _score_rows(
    model_cfg,
    temperature,
    chunk_tokens,
    params,
    tokens,
    kept_ids=None,
    gather_ids=None,
    response_mask=None,
    *,
    mesh=None,
    window_len=None,
):
    """log-probs [B, T]; with `gather_ids` also those tokens' ([B, T, A]): (logp, top). `mesh`: the
    activations stay split on B over it. `window_len` (update.head_window="response"): the head
    over that many positions from each row's first response position (`response_mask`'s)."""
    window = head_window(tokens.shape[1], window_len)
    starts = None if window is None else transformer.head_window_starts(response_mask, window)
    logp, _, *top = transformer.token_logprobs(
        params,
        model_cfg,
        tokens,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
        kept_ids=kept_ids,
        gather_ids=gather_ids,
        mesh=mesh,
        window=window,
        window_start=starts,
    )
    return (logp, top[0]) if top else logp


def _micro_step(
    model_cfg, cfg: RLConfig, params, ref_params, acc, mb, weight_norm, *, fused: bool, mesh=None, window_len=None
):
    """One micro-batch: (accumulated float32 gradient of the loss numerator, the numerator, the
    token metrics, the learner's log-probs, its log-probs of mb["top_ids"] or None). With
    `ref_params`, log pi_ref is teacher-forced here. `mesh`: the activations stay split on B over it.
    `window_len`: the head's window (update.head_window="response"; head_window)."""
    u = cfg.update
    if ref_params is not None:
        ref = _score_rows(
            model_cfg,
            u.temperature,
            u.chunk_tokens,
            ref_params,
            mb["tokens"],
            mb.get(KEPT),
            None,
            mb["response_mask"],
            mesh=mesh,
            window_len=window_len,
        )
        mb = dict(mb, ref_logp=jax.lax.stop_gradient(ref))
    (num, (metrics, logp, top)), grads = jax.value_and_grad(micro_batch_loss, has_aux=True)(
        params,
        mb,
        model_cfg,
        cfg,
        denominator=jnp.float32(1.0),
        weight_norm=weight_norm,
        old_from_forward=fused,
        mesh=mesh,
        window=head_window(mb["tokens"].shape[1], window_len),
    )
    acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
    return acc, num, metrics, logp, top


def _apply(optimizer, params, opt_state, acc, numerator, denominator):
    """Divide the accumulated numerator gradient by the minibatch's denominator and step."""
    d = jnp.maximum(denominator, 1e-8)
    loss = numerator / d
    params, opt_state, applied = apply_gradients(optimizer, params, opt_state, jax.tree.map(lambda g: g / d, acc), loss)
    return params, opt_state, {"loss": loss, **applied}
