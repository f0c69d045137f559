"""The compiled decode loop does no per-step copies: read from the optimized HLO of a tiny model.

Inside the loop body of the sampler's decode scan, no weight (a loop-invariant float array of
rank >= 2) is copied or transposed, and every KV buffer (keys, values, positions) is updated in
place: the new carried value is a dynamic-update-slice or scatter whose operand is the carried
buffer itself, with no copy of that buffer in the body. Checked at batch 1 (where a one-row
scatter becomes a dynamic-update-slice) and batch 8. The donated cache of the sharded decode
step is aliased to its output. Compiled as a user's program is (the `user_compiler` fixture: XLA's
defaults in place of the suite's faster-compiling settings), since the fusions are its output.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from sparserl_jax import kvcache as kv
from sparserl_jax.model import sharding as shd
from sparserl_jax.model import transformer as tf
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rollout import sampler as smp

CFG = ModelConfig.tiny("qwen2", vocab_size=96)
PARAMS = tf.init_params(CFG, jax.random.key(0))
P, M = 8, 16
UPDATES = ("dynamic-update-slice", "scatter")


def _parse(text: str) -> dict[str, dict]:
    """Optimized HLO text -> {computation: {"insts": {name: inst}, "root": name, "params": [...]}},
    inst = dict(shape, op, operands, attrs)."""
    comps, cur = {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) \(.*\{$", line)
        if head:
            cur = comps[head.group(1)] = {"insts": {}, "root": None, "params": {}}
            continue
        m = re.match(r"^\s+(ROOT )?%(\S+) = (.*)$", line)
        if cur is None or not m:
            continue
        rest = re.sub(r"/\*[^*]*\*/", "", m.group(3))
        if rest.startswith("("):  # tuple shape: up to the matching parenthesis
            depth = 0
            for i, ch in enumerate(rest):  # noqa: B007  (i is read after the break)
                depth += {"(": 1, ")": -1}.get(ch, 0)
                if depth == 0:
                    break
            shape, rest = rest[: i + 1], rest[i + 2 :]
        else:
            shape, rest = rest.split(" ", 1)
        op, rest = rest.split("(", 1)
        depth, i = 1, 0
        while depth:
            depth += {"(": 1, ")": -1}.get(rest[i], 0)
            i += 1
        operands = re.findall(r"%([\w.\-]+)", rest[: i - 1])
        attrs = dict(re.findall(r"(\w+)=(%?[\w.\-]+)", rest[i:]))
        cur["insts"][m.group(2)] = dict(shape=shape, op=op, operands=operands, attrs=attrs)
        if op == "parameter":
            cur["params"][int(operands[0]) if operands else int(rest[: i - 1])] = m.group(2)
        if m.group(1):
            cur["root"] = m.group(2)
    return comps


def _decode_body(comps: dict, cache_shape: str) -> dict:
    """The body of the innermost while loop that carries the KV buffers (the decode scan)."""
    bodies = [
        comps[inst["attrs"]["body"].lstrip("%")]
        for comp in comps.values()
        for inst in comp["insts"].values()
        if inst["op"] == "while" and inst["shape"].count(cache_shape) >= 2 * CFG.n_layers
    ]
    inner = [
        b for b in bodies if not any(i["op"] == "while" and cache_shape in i["shape"] for i in b["insts"].values())
    ]
    assert len(inner) == 1, f"expected one decode loop, found {len(inner)}"
    return inner[0]


def _through_bitcasts(comp: dict, name: str) -> str:
    while comp["insts"][name]["op"] == "bitcast":
        name = comp["insts"][name]["operands"][0]
    return name


def _copies_of(comps: dict, body: dict, sources: set[str]) -> list[str]:
    """Copies and transposes in `body` (or inside the fusions it calls) of the values `sources`."""
    found = []
    for name, inst in body["insts"].items():
        args = [_through_bitcasts(body, a) for a in inst["operands"]]
        if inst["op"] in ("copy", "transpose") and args[0] in sources:
            found.append(f"{name} = {inst['op']}({args[0]})")
        if inst["op"] == "fusion":
            fused = comps[inst["attrs"]["calls"].lstrip("%")]
            params = {fused["params"][j] for j, a in enumerate(args) if a in sources}
            found += [f"{name}: {inner}" for inner in _copies_of(comps, fused, params)]
    return found


def _updated_in_place(comps: dict, body: dict, value: str, carried: str) -> bool:
    """`value` is a dynamic-update-slice/scatter (maybe fused) of the carried buffer itself."""
    inst = body["insts"][_through_bitcasts(body, value)]
    if inst["op"] in UPDATES:
        return _through_bitcasts(body, inst["operands"][0]) == carried
    if inst["op"] != "fusion":
        return False
    fused = comps[inst["attrs"]["calls"].lstrip("%")]
    root = fused["insts"][_through_bitcasts(fused, fused["root"])]
    if root["op"] not in UPDATES:
        return False
    param = _through_bitcasts(fused, root["operands"][0])
    j = next(j for j, p in fused["params"].items() if p == param)
    return _through_bitcasts(body, inst["operands"][j]) == carried


def _check_decode_loop(hlo: str, batch: int, capacity: int) -> None:
    comps = _parse(hlo)
    K, H = CFG.n_kv_heads, CFG.head_dim
    kv_shape, pos_shape = f"f32[{batch},{K},{capacity},{H}]", f"s32[{batch},{K},{capacity}]"
    body = _decode_body(comps, kv_shape)
    insts = body["insts"]
    gte = {
        n: int(i["attrs"]["index"])
        for n, i in insts.items()
        if i["op"] == "get-tuple-element" and insts[i["operands"][0]]["op"] == "parameter"
    }
    out = insts[body["root"]]["operands"]
    invariant = {n for n, idx in gte.items() if out[idx] == n}
    weights = {n for n in invariant if re.match(r"(f32|bf16)\[\d+,\d+", insts[n]["shape"])}
    assert len(weights) >= 7 * CFG.n_layers, f"weights not found among the loop carry: {weights}"
    assert not _copies_of(comps, body, weights), "weights copied in the decode loop"

    buffers = {n: idx for n, idx in gte.items() if insts[n]["shape"].split("{")[0] in (kv_shape, pos_shape)}
    assert len(set(buffers.values())) == 3 * CFG.n_layers
    for n, idx in buffers.items():
        assert _updated_in_place(comps, body, out[idx], n), f"KV buffer {idx} not updated in place"
    copies = _copies_of(comps, body, set(buffers))
    assert not copies, f"KV buffers copied in the decode loop: {copies}"


@pytest.mark.parametrize("batch", [1, 8])
def test_decode_loop_has_no_weight_copies_and_writes_the_cache_in_place(batch, user_compiler):
    cfg = smp.SamplerConfig(max_new_tokens=M, kv=kv.KVConfig(policy="none", buffer=M))
    prompts = jnp.ones((batch, P), jnp.int32)
    lengths = jnp.full((batch,), P, jnp.int32)
    hlo = smp.generate_jit.lower(PARAMS, CFG, prompts, lengths, jax.random.key(0), cfg)
    _check_decode_loop(hlo.compile(user_compiler).as_text(), batch, smp.cache_capacity(cfg.kv, P, M))


def test_sharded_decode_step_aliases_the_donated_cache(user_compiler):
    mesh = shd.make_mesh(shd.MeshConfig())
    cache = kv.cache_for(kv.KVConfig(), CFG, 2, P, capacity=P + M)
    tokens = jnp.ones((2,), jnp.int32)
    step = shd.sharded_decode_step(mesh, CFG, cache).lower(PARAMS, cache, tokens).compile(user_compiler)
    header = step.as_text().splitlines()[0]
    aliased = {int(p) for p in re.findall(r"\{\d+\}: \((\d+), \{\}, (?:may|must)-alias\)", header)}
    first = len(jax.tree_util.tree_leaves(PARAMS))
    assert aliased == set(range(first, first + len(jax.tree_util.tree_leaves(cache))))
    _, cache = step(PARAMS, cache, tokens)  # a fresh cache can be donated: no buffer shared
    assert cache.length.tolist() == [1, 1]
