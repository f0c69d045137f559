"""Hugging Face safetensors checkpoints <-> our params pytree (Qwen2/Qwen2.5, Llama 3.x, Qwen3).

Every parameter is one HF tensor seen through a reshape and a transpose (`HFTensor`): our
q [D, N, H] is q_proj.weight [N*H, D] viewed as [N, H, D] and transposed. Files are read and
written with the `safetensors` library (numpy backend; BF16 arrives as ml_dtypes.bfloat16). Loading
reads each device shard from its slice of the file (safe_open(...).get_slice), cast to the target
dtype one tensor at a time: no float32 host copy of the whole model is ever made, and with
shardings no device ever holds more of a tensor than its own block (load_params).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes  # registers the "bfloat16" numpy dtype that safetensors' numpy backend looks up
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from sparserl_jax.model.config import ModelConfig
from sparserl_jax.model.hf_config import (
    DTYPES,
    config_from_hf,
    config_to_hf,
    generation_config_to_hf,
)
from sparserl_jax.model.transformer import Params

# safetensors dtypes this module reads and writes (all float; quantized checkpoints are refused).
ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One parameter: ours = hf_tensor.reshape(split).transpose(perm), at `path` in params, where
    `axes` holds the sizes each HF axis splits into (q_proj.weight [N*H, D]: ((N, H), (D,)))."""

    name: str
    path: tuple
    axes: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(sizes) for sizes in self.axes)

    @property
    def split(self) -> tuple[int, ...]:
        return sum(self.axes, ())

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.split[axis] for axis in self.perm)

    def read(self, tensor, index: tuple[slice, ...] = ()) -> np.ndarray:
        """The block `index` (default: all) of our array, read from the safetensors slice `tensor`
        (safe_open(...).get_slice): only the HF rows/columns covering the block are read; an HF axis
        split in several (N*H) is read in whole units of its outer part (heads), then cut."""
        src = [slice(None)] * len(self.split)
        for our_axis, idx in enumerate(index):
            src[self.perm[our_axis]] = idx
        hf_index, shape, cut, first = [], [], [], 0
        for outer, *inner in self.axes:
            start, stop, _ = src[first].indices(outer)
            hf_index.append(slice(start * math.prod(inner), stop * math.prod(inner)))
            shape += [stop - start, *inner]
            cut += [slice(None), *src[first + 1 : first + 1 + len(inner)]]
            first += 1 + len(inner)
        return tensor[tuple(hf_index)].reshape(shape)[tuple(cut)].transpose(self.perm)

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        return ours.transpose(np.argsort(self.perm)).reshape(self.hf_shape)


def hf_tensors(cfg: ModelConfig) -> list[HFTensor]:
    """The HF tensors of a checkpoint for `cfg`, with their place and layout in our params."""
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    F, V = cfg.d_ff, cfg.vocab_size

    def same(name, path, *shape):
        return HFTensor(name, path, tuple((n,) for n in shape), tuple(range(len(shape))))

    def linear(name, path, n_out, n_in):  # nn.Linear weight [out, in] -> ours [in, out]
        return HFTensor(name, path, ((n_out,), (n_in,)), (1, 0))

    specs = [same("model.embed_tokens.weight", ("embed",), V, D)]
    for i in range(cfg.n_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."

        def at(key: str, i: int = i) -> tuple:
            return ("layers", i, key)

        specs += [
            same(p + "input_layernorm.weight", at("attn_norm"), D),
            HFTensor(a + "q_proj.weight", at("q"), ((N, H), (D,)), (2, 0, 1)),
            HFTensor(a + "k_proj.weight", at("k"), ((K, H), (D,)), (2, 0, 1)),
            HFTensor(a + "v_proj.weight", at("v"), ((K, H), (D,)), (2, 0, 1)),
            HFTensor(a + "o_proj.weight", at("o"), ((D,), (N, H)), (1, 2, 0)),
        ]
        if cfg.qkv_bias:
            specs += [
                HFTensor(a + "q_proj.bias", at("q_bias"), ((N, H),), (0, 1)),
                HFTensor(a + "k_proj.bias", at("k_bias"), ((K, H),), (0, 1)),
                HFTensor(a + "v_proj.bias", at("v_bias"), ((K, H),), (0, 1)),
            ]
        if cfg.qk_norm:
            specs += [
                same(a + "q_norm.weight", at("q_norm"), H),
                same(a + "k_norm.weight", at("k_norm"), H),
            ]
        specs += [
            same(p + "post_attention_layernorm.weight", at("mlp_norm"), D),
            linear(p + "mlp.gate_proj.weight", at("gate"), F, D),
            linear(p + "mlp.up_proj.weight", at("up"), F, D),
            linear(p + "mlp.down_proj.weight", at("down"), D, F),
        ]
    specs.append(same("model.norm.weight", ("final_norm",), D))
    if not cfg.tie_embeddings:
        specs.append(linear("lm_head.weight", ("lm_head",), V, D))
    return specs


def _params_tree(cfg: ModelConfig, specs: list[HFTensor]) -> dict:
    """A params-shaped pytree whose leaves are the HFTensor specs."""
    tree: dict = {"layers": [{} for _ in range(cfg.n_layers)]}
    for spec in specs:
        node = tree
        for key in spec.path[:-1]:
            node = node[key]
        node[spec.path[-1]] = spec
    return tree


# ----------------------------------------------------------------------------- reading


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard files that do not exist: {missing}")
        return [directory / n for n in names]
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        present = sorted(p.name for p in directory.iterdir())[:20]
        raise FileNotFoundError(
            f"{directory} has no model.safetensors, {INDEX_FILE} or other *.safetensors file (it holds {present})"
        )
    return found


_Tensors = dict[str, tuple[Path, object]]  # tensor name -> (file, safetensors slice)


def _open_tensors(directory: Path) -> _Tensors:
    """Every tensor of the directory's files (each slice keeps its file's memory map alive;
    nothing is read yet)."""
    tensors = {}
    for file in _safetensors_files(directory):
        try:
            f = safe_open(file, framework="numpy")
        except SafetensorError as err:
            raise ValueError(f"{file} is not a readable safetensors file: {err}") from err
        tensors.update((name, (file, f.get_slice(name))) for name in f.keys())
    return tensors


def _check(cfg: ModelConfig, specs: list[HFTensor], tensors: _Tensors, directory: Path) -> None:
    """Every expected tensor present with the shape config.json implies; nothing unexpected."""
    for spec in specs:
        if spec.name not in tensors:
            raise ValueError(
                f"{directory}: tensor {spec.name!r} is missing (config.json: "
                f"family={cfg.family}, n_layers={cfg.n_layers}, "
                f"tie_word_embeddings={cfg.tie_embeddings})"
            )
        file, tensor = tensors[spec.name]
        shape = tuple(tensor.get_shape())
        if shape != spec.hf_shape:
            raise ValueError(f"{file}: tensor {spec.name!r} has shape {shape}, but config.json implies {spec.hf_shape}")
        if tensor.get_dtype() not in ST_DTYPES:
            raise ValueError(
                f"{file}: tensor {spec.name!r} has dtype {tensor.get_dtype()}: expected one of {tuple(ST_DTYPES)}"
            )
    expected = {spec.name for spec in specs}
    # Ignored, as transformers ignores them: RoPE buffers of old exports, and a stored
    # lm_head of a tied model (transformers ties it to the embedding).
    extra = [
        name
        for name in tensors
        if name not in expected
        and not name.endswith(".rotary_emb.inv_freq")
        and not (cfg.tie_embeddings and name == "lm_head.weight")
    ]
    if extra:
        raise ValueError(
            f"{directory}: {len(extra)} unexpected tensors this {cfg.family} model has no "
            f"slot for, e.g. {sorted(extra)[:8]} (the weights belong to a different "
            "architecture than config.json says)"
        )


def load_config(path: str | os.PathLike, dtype: str | None = None) -> ModelConfig:
    """ModelConfig of a checkpoint directory (config.json, and generation_config.json if any)."""
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint directory {directory} has no config.json")
    hf = json.loads((directory / "config.json").read_text())
    gen_file = directory / "generation_config.json"
    generation = json.loads(gen_file.read_text()) if gen_file.is_file() else None
    if dtype is not None:
        dtype = jnp.dtype(dtype).name
    return config_from_hf(hf, generation, dtype)


def load_params(
    path: str | os.PathLike,
    dtype: str | None = None,
    shardings=None,
) -> tuple[ModelConfig, Params]:
    """Load a HF checkpoint directory as (ModelConfig, params) in `dtype` (default: the checkpoint's
    float32/bfloat16, else float32).

    `shardings`: None (every tensor whole on the default device), one jax.sharding.Sharding for
    every array, or a pytree of Shardings with the structure of params (build it from
    `load_config(path)` first: model/sharding.py param_shardings of abstract_params). With
    shardings, each of this process's devices gets only its block, read from its slice of the
    file (jax.make_array_from_callback): a process reads only the rows and columns its own
    devices hold, and no device ever holds a whole sharded tensor. The one staging buffer is on
    the host, one tensor at a time: this process's distinct blocks of the tensor being placed
    (a block replicated on several devices is read once), in `dtype`, plus the block being read
    in the file's dtype while it is cast; at most one tensor's bytes in `dtype`, freed before the
    next tensor is read.
    """
    directory = Path(path)
    cfg = load_config(directory, dtype)
    tensors = _open_tensors(directory)
    specs = hf_tensors(cfg)
    _check(cfg, specs, tensors, directory)
    target = jnp.dtype(cfg.dtype)
    skeleton = _params_tree(cfg, specs)

    def read(spec: HFTensor, index=()) -> np.ndarray:
        return np.array(spec.read(tensors[spec.name][1], index), dtype=target, order="C")

    if shardings is None:
        return cfg, jax.tree.map(lambda spec: jax.device_put(read(spec)), skeleton)
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, skeleton)
    if jax.tree.structure(shardings) != jax.tree.structure(skeleton):
        raise ValueError(
            "load_params(shardings=...) must be one Sharding or a pytree with the structure "
            f"of the params: expected {jax.tree.structure(skeleton)}, "
            f"got {jax.tree.structure(shardings)}"
        )

    def build(spec: HFTensor, sharding) -> jax.Array:
        blocks: dict[tuple, np.ndarray] = {}  # the staging buffer: this tensor's blocks, by index

        def block(index: tuple[slice, ...]) -> np.ndarray:
            key = tuple((s.start, s.stop, s.step) for s in index)  # slices are unhashable before 3.12
            if key not in blocks:
                blocks[key] = read(spec, index)
            return blocks[key]

        return jax.make_array_from_callback(spec.shape, sharding, block)

    return cfg, jax.tree.map(build, skeleton, shardings)


# ----------------------------------------------------------------------------- writing


def _named_leaves(cfg: ModelConfig, params: Params, specs: list[HFTensor]) -> list[jax.Array]:
    """The params leaf of each spec, after checking that params match `cfg` exactly."""
    found = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        found[tuple(getattr(k, "key", getattr(k, "idx", None)) for k in key_path)] = leaf
    show = lambda path: "/".join(map(str, path))  # noqa: E731
    wanted = {spec.path for spec in specs}
    extra = [show(p) for p in found if p not in wanted]
    if extra:
        raise ValueError(
            f"params hold {extra[:8]}, which cfg ({cfg.family}, "
            f"tie_embeddings={cfg.tie_embeddings}, qkv_bias={cfg.qkv_bias}, "
            f"qk_norm={cfg.qk_norm}) has no HF tensor for"
        )
    leaves = []
    for spec in specs:
        if spec.path not in found:
            raise ValueError(f"params lack {show(spec.path)!r} ({spec.name}), which cfg requires")
        leaf = found[spec.path]
        if tuple(leaf.shape) != spec.shape:
            raise ValueError(f"params {show(spec.path)!r} has shape {tuple(leaf.shape)}, but cfg implies {spec.shape}")
        if np.dtype(leaf.dtype) not in ST_DTYPES.values():
            raise ValueError(f"params {show(spec.path)!r} has dtype {leaf.dtype}: expected a float dtype")
        leaves.append(leaf)
    return leaves


def _host(x: jax.Array) -> np.ndarray:
    """The whole array on the host (gathered from every process when it spans several)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def _write_safetensors(file: Path, specs: list[HFTensor], leaves: list, write: bool, dtype: np.dtype) -> None:
    """One safetensors file of `dtype` tensors (at most max_shard_bytes on the host at once). With
    write=False (processes other than 0) it only joins the cross-process gathers."""
    if not write:
        for leaf in leaves:
            if not leaf.is_fully_addressable:
                _host(leaf)
        return
    tensors = {
        spec.name: np.ascontiguousarray(spec.to_hf(_host(leaf)).astype(dtype, copy=False))
        for spec, leaf in zip(specs, leaves, strict=True)
    }
    tmp = file.with_name(file.name + ".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})  # "pt": transformers refuses other formats
    os.replace(tmp, file)


def save_params(
    path: str | os.PathLike,
    cfg: ModelConfig,
    params: Params,
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: str | None = None,
) -> None:
    """Write a HF checkpoint directory: config.json, generation_config.json, model.safetensors (or
    model-0000i-of-0000n.safetensors + index when larger than `max_shard_bytes`), and the tokenizer
    files of `tokenizer_dir`. Tensors are written in `dtype` (float32 or bfloat16, each cast on the
    host; default: the params' own, e.g. a run's float32 master weights). Stale model*.safetensors
    files and index in `path` are removed first. Multi-host: every process calls it; process 0
    writes."""
    directory = Path(path)
    specs = hf_tensors(cfg)
    leaves = _named_leaves(cfg, params, specs)
    tokenizer_files = _tokenizer_files(tokenizer_dir)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {DTYPES} (or None: the params' own)")
    np_dtype = np.dtype(jnp.dtype(dtype or leaves[0].dtype))
    dtype = np_dtype.name
    nbytes = lambda leaf: leaf.size * np_dtype.itemsize  # noqa: E731
    write = jax.process_index() == 0

    shards: list[list[int]] = [[]]
    size = 0
    for i, leaf in enumerate(leaves):
        if shards[-1] and size + nbytes(leaf) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes(leaf)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    hf_cfg = config_to_hf(cfg, dtype=dtype if dtype in DTYPES else None)
    if write:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in [*directory.glob("model*.safetensors"), directory / INDEX_FILE]:
            stale.unlink(missing_ok=True)
        (directory / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
        (directory / "generation_config.json").write_text(json.dumps(generation_config_to_hf(cfg), indent=2) + "\n")
    for name, idx in zip(names, shards, strict=True):
        _write_safetensors(directory / name, [specs[i] for i in idx], [leaves[i] for i in idx], write, np_dtype)
    if not write:
        return
    if n > 1:
        weight_map = {specs[i].name: name for name, idx in zip(names, shards, strict=True) for i in idx}
        total = sum(nbytes(leaf) for leaf in leaves)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    for src in tokenizer_files:
        dst = directory / src.name
        if not dst.exists() or not src.samefile(dst):
            shutil.copyfile(src, dst)


def _tokenizer_files(tokenizer_dir: str | os.PathLike | None) -> list[Path]:
    if tokenizer_dir is None:
        return []
    src = Path(tokenizer_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"tokenizer_dir={src} does not exist")
    files = [src / name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not files:
        raise FileNotFoundError(f"tokenizer_dir={src} holds none of the tokenizer files {TOKENIZER_FILES}")
    return files
