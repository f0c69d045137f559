"""The trainer's three device programs at a config's real shapes, built for compiling on a mesh of
TPU topology devices from abstract inputs (jax.ShapeDtypeStruct with their shardings: nothing is
allocated): the learner's micro-batch gradient program (rl/bucketed.py, at the run's widest
width, on the path the trainer takes for a full-width batch), its scoring pass (pi_old teacher-
forced in chunks of rl.update.score_batch_size rows) and one rollout call of the sampler
(rollout/sampler.py generate: prefill, then the decode loop) over rollout.rows_per_call rows, with
the decode attention's Pallas kernel built for TPU as a TPU run would pick it. Each comes with what
the trainer holds on the chip beside its arguments (exact, from eval_shape) and the dry run's phase
for it (sparserl_jax/dryrun.py), so that XLA's plan and the dry run's can be put side by side.

Imports JAX: a script sets the environment (tpu_topology.set_environment) before importing this.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.device import tpu_table, tpu_topology
from experiments.device.gpu_sizes import HERE, REAL
from experiments.device.tpu_topology import Topology
from sparserl_jax import components, dryrun
from sparserl_jax.config import TrainConfig, load_config
from sparserl_jax.mesh_axes import AXES, BATCH
from sparserl_jax.model import sharding
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rl.bucketed import KEPT, TOP, BucketedUpdate
from sparserl_jax.rl.optim import make_optimizer
from sparserl_jax.rollout import on_mesh
from sparserl_jax.rollout.sampler import generate_jit
from sparserl_jax.rollout.sampling import kept_width

# A tree from before model.attention="auto" (model/attention.py) and rollout.mesh (rollout/layout.py),
# e.g. commit 509054d, the table's "before" rows: its attention is the config's and it decodes on
# the training layout; rollout.agreement_k is then a number.
try:
    from sparserl_jax.model.attention import auto_implementation
except ImportError:
    auto_implementation = None
try:
    from sparserl_jax.model.precision import auto_accumulation
except ImportError:  # a tree from before model.dot_accumulation
    auto_accumulation = None
try:
    from sparserl_jax.model.precision import auto_dtype
except ImportError:  # a tree from before model.dtype=auto (whose configs cannot say auto)
    auto_dtype = None
try:
    from sparserl_jax.rollout.layout import rollout_mesh
except ImportError:
    rollout_mesh = None
agreement_candidates = getattr(components, "agreement_candidates", lambda cfg: cfg.rollout.agreement_k)

PROGRAMS = ("update", "score", "decode")
CONFIGS = ("qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "llama-3.2-1b-instruct")  # the authors' configs
MESH_DIR = os.path.join(REAL, "mesh")  # the mesh overlays: <name>.yaml (1gpu, 8gpu, tpu_pod, ...)
QUICK = "toy"  # --quick's: the smoke config's tiny model (bfloat16, head_dim 128: a TPU tile), 2 rows a chip
# rows a micro-batch, scoring chunk and sampler call holds, scaled with the mesh's data x fsdp
PER_DEVICE_ROWS = ("rl.update.micro_batch_size", "rl.update.score_batch_size", "rollout.rows_per_call")
QUICK_OVERRIDES = (
    "rollout.prompts=4",
    "rollout.samples=4",
    "rollout.rows_per_call=0",
    "rl.update.minibatch_size=8",
    "rl.update.micro_batch_size=8",
    "rl.update.score_batch_size=8",
    "model.dtype=bfloat16",
    "model.arch.head_dim=128",
)


@dataclasses.dataclass(frozen=True)
class Setup:
    """One config on one topology: its resolved TrainConfig (the mesh overlay scaled to the
    topology's chips), model, the arch file it came from, the overrides applied and the
    model.attention the config names (the model's is what a TPU compiles for it)."""

    name: str
    cfg: TrainConfig
    model: ModelConfig
    arch: str | None
    overrides: tuple[str, ...]
    attention_setting: str


@dataclasses.dataclass(frozen=True)
class Program:
    """A jitted program with abstract inputs: `fn.lower(*args, **kwargs)`. `held_beside`: per-chip
    bytes the trainer holds while it runs that are not among its arguments; `rows`: the rows it
    runs (rows per chip: rows / (data x fsdp)); `width`: their token width; `facts`: what else
    identifies it (path, widths, cache slots)."""

    name: str
    fn: Callable
    args: tuple
    kwargs: dict
    held_beside: dict[str, int]
    rows: int
    width: int
    facts: dict


def devices(topology: Topology) -> list:
    """The topology's TPU devices (compile targets only), libtpu's order. One chip needs its host
    bounds named (libtpu's default host, 2x2x1 chips, does not divide a 1x1x1 grid)."""
    one_chip = {"chips_per_host_bounds": (1, 1, 1)} if topology.chips == 1 else {}
    return list(topologies.get_topology_desc(topology.name, "tpu", **one_chip).devices)


def overlay_paths(name: str, mesh: str) -> tuple[list[str], str | None]:
    """The config files (the config, then the mesh overlay) and the arch of a config name."""
    if name == QUICK:
        return [os.path.join(HERE, "configs", "smoke.yaml")], None
    if name not in CONFIGS:
        raise ValueError(f"--configs {name!r}: expected one of {(*CONFIGS, QUICK)}")
    if mesh not in meshes():
        raise ValueError(f"--mesh {mesh!r}: expected one of {meshes()} (experiments/configs/real/mesh/)")
    return (
        [os.path.join(REAL, f"{name}.yaml"), os.path.join(MESH_DIR, f"{mesh}.yaml")],
        os.path.join(REAL, "arch", f"{name}.json"),
    )


def meshes() -> tuple[str, ...]:
    """The mesh overlays' names (experiments/configs/real/mesh/<name>.yaml)."""
    return tuple(sorted(f.removesuffix(".yaml") for f in os.listdir(MESH_DIR) if f.endswith(".yaml")))


def scaled_overrides(cfg: TrainConfig, chips: int) -> list[str]:
    """Overrides that put an overlay written for another device count on `chips` chips: its
    tensor axis kept, fsdp taking the rest (data 1), and the rows of a micro-batch, a scoring
    chunk and a sampler call scaled so that each device holds as many as the overlay gives it."""
    data, fsdp, tensor = dryrun.axis_sizes(cfg, None).values()
    if data * fsdp * tensor == chips:
        return []
    if chips % tensor:
        raise ValueError(f"mesh.tensor={tensor} does not divide the topology's {chips} chips")
    new_dp, old_dp = chips // tensor, data * fsdp
    out = ["mesh.data=1", f"mesh.fsdp={new_dp}"]
    values = {
        "rl.update.micro_batch_size": cfg.rl.update.micro_batch_size,
        "rl.update.score_batch_size": cfg.rl.update.score_batch_size,
        "rollout.rows_per_call": cfg.rollout.rows_per_call,
    }
    for key in PER_DEVICE_ROWS:
        if values[key]:  # rows_per_call 0: every row in one call, whatever the mesh
            out.append(f"{key}={max(1, values[key] * new_dp // old_dp)}")
    return out


def setup(
    name: str, topology: Topology, *, mesh: str = "8gpu", attention: str | None = None, overrides: Sequence[str] = ()
) -> Setup:
    """`name` on `topology`: the overlay scaled to its chips (scaled_overrides), then `attention`
    (model.attention) and `overrides` (key=value, last wins). model.attention=auto is resolved for
    a TPU here, as is model.dot_accumulation=auto: both resolve at trace time from JAX's backend,
    which is this CPU's."""
    files, arch = overlay_paths(name, mesh)
    quick = [*QUICK_OVERRIDES, "mesh.data=1", f"mesh.fsdp={topology.chips}"] if name == QUICK else []
    base = load_config(files, quick)
    extra = [*quick, *scaled_overrides(base, topology.chips)]
    if attention is not None:
        extra.append(f"model.attention={attention}")
    extra += list(overrides)
    cfg = load_config(files, extra)
    if cfg.model.dtype == "auto":  # read at trace time from JAX's backend, this CPU's
        extra.append(f"model.dtype={auto_dtype('tpu')[0]}")
        cfg = load_config(files, extra)
    model, _ = dryrun.model_config(cfg, arch)
    setting = model.attention
    resolved = []
    if setting == "auto" and auto_implementation is not None:
        resolved.append(f"model.attention={auto_implementation('tpu', model.dtype)}")
    if getattr(model, "dot_accumulation", None) == "auto" and auto_accumulation is not None:
        resolved.append(f"model.dot_accumulation={auto_accumulation('tpu')}")
    if resolved:
        extra += resolved
        cfg = load_config(files, extra)
        model, _ = dryrun.model_config(cfg, arch)
    return Setup(name, cfg, model, arch, tuple(extra), setting)


def make_mesh(s: Setup, devs: Sequence) -> Mesh:
    return sharding.make_mesh(s.cfg.mesh, devs)


def dry_run(s: Setup, topology: Topology) -> dict:
    """The dry run's report for the setup on the topology's chips."""
    return dryrun.dry_run(s.cfg, arch=s.arch, devices=topology.chips, device_memory_gib=topology.hbm_gib)


def row_dry_run(row: dict) -> dict:
    """A table row's dry-run columns (tpu_table.dry_run_columns) by this checkout's dry run, from
    the setup the row was compiled with: config, mesh overlay, topology, attention, overrides."""
    topology = tpu_topology.parse(row["topology"])
    s = setup(
        row["config"],
        topology,
        mesh=row.get("mesh_overlay", "8gpu"),
        attention=row["attention_requested"],
        overrides=row["overrides"],
    )
    return tpu_table.dry_run_columns(row["program"], dry_run(s, topology), row.get("chip_bytes"))


# ----------------------------------------------------------------------------- abstract inputs


def _sds(shape, dtype, mesh: Mesh, spec: P) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=NamedSharding(mesh, spec))


def _rows(shape, dtype, mesh: Mesh) -> jax.ShapeDtypeStruct:
    """A [rows, ...] input placed as the trainer places it (BucketedUpdate._place,
    sharding.shard_batch): split over data x fsdp where they divide the rows, else replicated."""
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    return _sds(shape, dtype, mesh, P(BATCH) if shape[0] % dp == 0 else P())


def abstract_params(m: ModelConfig, mesh: Mesh, dtype: str) -> Any:
    """The params' shapes in `dtype`, laid out by the partition rules on `mesh`."""
    shapes = sharding.abstract_params(m)
    shardings = sharding.param_shardings(shapes, mesh)
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype), sharding=sh), shapes, shardings)


def persistent_bytes(s: Setup, mesh: Mesh) -> dict[str, int]:
    """Per-chip bytes of what the trainer holds between programs (exact, as the dry run counts
    them): the master, its compute copy (where model.dtype differs), pi_ref (a compute copy) and
    the optimizer state."""
    sizes = dict(mesh.shape)
    shapes = sharding.abstract_params(s.model)
    opt = jax.eval_shape(make_optimizer(s.cfg.rl.optim).init, shapes)
    mixed = s.model.dtype != s.model.param_dtype
    compute = dryrun.tree_bytes(shapes, sizes, dtype=s.model.dtype)
    return {
        "master": dryrun.tree_bytes(shapes, sizes),
        "compute copy": compute if mixed else 0,
        "pi_ref": compute,
        "optimizer state": dryrun.tree_bytes(opt, sizes),
    }


def _beside(held: dict[str, int], arguments: Sequence[str], mixed: bool) -> dict[str, int]:
    """The persistent buffers not among a program's `arguments` ("compute copy" is the master
    itself where the dtypes are one)."""
    args = set(arguments) | ({"master"} if not mixed and "compute copy" in arguments else set())
    return {k: v for k, v in held.items() if k not in args and v}


# ----------------------------------------------------------------------------- the programs


def update_program(s: Setup, mesh: Mesh) -> tuple[Program, BucketedUpdate]:
    """The learner's micro-batch gradient program (BucketedUpdate's, as warm_up compiles it) at
    the run's widest width: the compute copy, pi_ref where it is teacher-forced inside, the
    float32 gradient accumulator (donated) and rl.update.micro_batch_size rows."""
    cfg, m, r, u = s.cfg, s.model, s.cfg.rollout, s.cfg.rl.update
    T = cfg.data.max_prompt_len + r.max_new_tokens
    kept_k = kept_width(r.top_k) if r.filters else 0
    top_k = agreement_candidates(cfg)
    bu = BucketedUpdate(
        m,
        cfg.rl,
        make_optimizer(cfg.rl.optim),
        max_len=T,
        mesh=mesh,
        donate=u.donate,
        kept_k=kept_k,
        top_k=top_k,
        response_len=r.max_new_tokens,
    )
    widths = bu.widths(T)
    W, rows = widths[-1], u.micro_batch_size
    path = bu.choose(np.full(r.rows, T), widths)  # a batch of full-width rows
    params = abstract_params(m, mesh, m.dtype)
    acc = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding), params)
    mb = {
        "tokens": _rows((rows, W), jnp.int32, mesh),
        "response_mask": _rows((rows, W), bool, mesh),
        "sampler_logp": _rows((rows, W), jnp.float32, mesh),
        "advantages": _rows((rows,), jnp.float32, mesh),
    }
    if kept_k:
        mb[KEPT] = _rows((rows, W, kept_k), jnp.int32, mesh)
    if top_k and path.fused:
        mb[TOP] = _rows((rows, W, top_k), jnp.int32, mesh)
    if not path.fused:
        mb["old_logp"] = _rows((rows, W), jnp.float32, mesh)
    with_ref = cfg.rl.loss.beta > 0
    if with_ref and not path.ref_inside:
        mb["ref_logp"] = _rows((rows, W), jnp.float32, mesh)
    norm = None if path.fused else _rows((rows,), jnp.float32, mesh)
    ref = params if path.ref_inside else None
    mixed = m.dtype != m.param_dtype
    arguments = ["compute copy"] + (["pi_ref"] if ref is not None else [])
    held = _beside(persistent_bytes(s, mesh), arguments, mixed)
    facts = {"path": dataclasses.asdict(path), "widths": list(widths), "kept_k": kept_k, "top_k": top_k}
    program = Program("update", bu._micro, (params, ref, acc, mb, norm), {"fused": path.fused}, held, rows, W, facts)
    return program, bu


def score_program(s: Setup, mesh: Mesh, bu: BucketedUpdate) -> Program:
    """The scoring pass's program (BucketedUpdate's): log pi_old of rl.update.score_batch_size
    rows at the widest width, with the kept sets and top candidates the run's rows carry."""
    cfg, m = s.cfg, s.model
    T = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    W = bu.widths(T)[-1]
    rows = min(cfg.rl.update.score_batch_size, cfg.rollout.rows)
    kept = _rows((rows, W, bu.kept_k), jnp.int32, mesh) if bu.kept_k else None
    top = _rows((rows, W, bu.top_k), jnp.int32, mesh) if bu.top_k else None
    held = _beside(persistent_bytes(s, mesh), ["compute copy"], m.dtype != m.param_dtype)
    mask = _rows((rows, W), bool, mesh) if bu.window_len else None  # where the head's window begins
    args = (abstract_params(m, mesh, m.dtype), _rows((rows, W), jnp.int32, mesh), kept, top, mask)
    return Program("score", bu._score, args, {}, held, rows, W, {"kept_k": bu.kept_k, "top_k": bu.top_k})


def decode_program(s: Setup, mesh: Mesh) -> Program:
    """One sampler call as the trainer makes it on its rollout layout (rollout.mesh,
    rollout/layout.py): rollout.rows_per_call rows (all rows when 0) of data.max_prompt_len prompt
    tokens, prefill and the decode loop to rollout.max_new_tokens over the config's KV cache, with
    the decode attention's kernel and the agreement's top-k built for TPU. On the training layout
    the sampler is partitioned by XLA over the training mesh (rollout/on_mesh.py
    generate_on_mesh); on a per-device layout (data, tensor:N) it runs under shard_map on the
    rollout mesh with the weights in their rollout places (generate_per_device), a copy of the
    compute weights beside the training one."""
    cfg, m, r = s.cfg, s.model, s.cfg.rollout
    tokens = types.SimpleNamespace(eos_token_ids=m.eos_token_ids, pad_token_id=m.pad_token_id)
    scfg = components.sampler_config(
        cfg, tokens, replay_filters=r.filters, agreement_k=agreement_candidates(cfg), record_prompt_kept=r.question_kv
    )
    scfg = dataclasses.replace(scfg, attn_platform="tpu")
    rows, width = r.call_rows, cfg.data.max_prompt_len
    layout = getattr(r, "mesh", "train")
    rm = rollout_mesh(layout, mesh) if rollout_mesh is not None else None
    facts = {"max_new_tokens": r.max_new_tokens, "kv_policy": cfg.kv.policy, "layout": layout}
    held = persistent_bytes(s, mesh)
    mixed = m.dtype != m.param_dtype
    if rm is not None and rm.per_device:
        shapes = sharding.abstract_params(m)
        params = jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, jnp.dtype(m.dtype), sharding=sh),
            shapes,
            rm.param_shardings(shapes),
        )
        manual = AXES if rm.layout.kind == "data" else BATCH
        fn = on_mesh._per_device_program(m, scfg, rm.mesh, tuple(manual))
        per_row = _rows((rows,), jnp.int32, rm.mesh)  # prompt lengths, request ids
        key = jax.ShapeDtypeStruct((), _key_dtype(), sharding=NamedSharding(rm.mesh, P()))
        args = (params, _rows((rows, width), jnp.int32, rm.mesh), per_row, per_row, key)
        facts["rollout_mesh"] = dict(rm.mesh.shape)
        return Program("decode", fn, args, {}, _beside(held, [], mixed), rows, width, facts)
    key = jax.ShapeDtypeStruct((), _key_dtype(), sharding=NamedSharding(mesh, P()))
    per_row = _rows((rows,), jnp.int32, mesh)  # prompt lengths, request ids
    scfg = dataclasses.replace(scfg, mesh=mesh)
    args = (abstract_params(m, mesh, m.dtype), m, _rows((rows, width), jnp.int32, mesh), per_row, key, scfg, per_row)
    return Program("decode", generate_jit, args, {}, _beside(held, ["compute copy"], mixed), rows, width, facts)


def _key_dtype():
    return jax.eval_shape(jax.random.key, 0).dtype


def programs(s: Setup, mesh: Mesh, names: Sequence[str]) -> dict[str, Callable[[], Program]]:
    """{name: build()} for each of `names` (PROGRAMS), built when called."""
    for name in names:
        if name not in PROGRAMS:
            raise ValueError(f"--programs {name!r}: expected some of {PROGRAMS}")
    update = functools.cache(lambda: update_program(s, mesh))
    builders = {
        "update": lambda: update()[0],
        "score": lambda: score_program(s, mesh, update()[1]),
        "decode": lambda: decode_program(s, mesh),
    }
    return {name: builders[name] for name in names}


def hidden_widths(m: ModelConfig, mesh: Mesh) -> set[int]:
    """The residual and MLP widths (d_model, d_ff) whole and divided by every product of the mesh's
    axes that divides them: the widths an activation's last dim can have on a chip."""
    sizes = [n for n in mesh.shape.values() if n > 1]
    splits = {math.prod(c) for k in range(len(sizes) + 1) for c in itertools.combinations(sizes, k)}
    return {w // n for w in (m.d_model, m.d_ff) for n in splits if w % n == 0}
