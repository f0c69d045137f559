"""The device check's kernel steps: the Pallas decode attention against its jnp reference on the
device (max error beside a bound derived from the computation, plain and under shard_map), and its
bandwidth beside a device-to-device copy measured in the same process.

Error bound, per output element (u the unit roundoff of the input dtype, eps float32's, C slots,
H head dim; A[b, n, h] = sum_j p_j |v_jh|, the attention-weighted |v|, >= |o|):
  scores   |s_kernel - s| <= E = gamma_H * max_j sum_i |q_i k_ji| * scale + 4 eps (1 + max_j |s_j|)
           (float32 dot of exact bf16 products: gamma_H = H eps / (1 - H eps); exp's argument)
  o        the kernel rounds p to the input dtype for the p.v matmul (u A), both sides' scores move
           p / l by <= 2E each (4E A), float32 sums over C slots and S splits (2 (C + 16) eps A),
           and both outputs are rounded to the input dtype (u (|o_kernel| + |o_ref|)):
           tol_o = (1 + u) (u + 4E + 2 (C + 16) eps) A + 2 u |o_ref|
  lse      tol_lse = 2E + 2 (C + 16) eps + 2 eps |lse_ref|
The reference runs at matmul precision "highest" (a GPU would otherwise take its float32 p.v
in TF32). Rows with no live slot (fill 0) must give o = 0 and lse = -inf (the kernel's contract;
the reference divides 0 by 0 there).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from experiments.lib import kernel_timing
from sparserl_jax import kernels
from sparserl_jax.kernels.sharded import attention_specs
from sparserl_jax.model import sharding

F32_EPS = float(jnp.finfo(jnp.float32).eps) / 2  # unit roundoff of float32


def unit_roundoff(dtype) -> float:
    return float(jnp.finfo(dtype).eps) / 2


@functools.partial(jax.jit, static_argnames=("scale",))
def error_bounds(q, k, v, fill, o_ref, lse_ref, scale: float):
    """(tol_o [B, N, H], tol_lse [B, N]) of the module docstring, in float32."""
    B, N, H = q.shape
    K, C = k.shape[1], k.shape[2]
    u, eps = unit_roundoff(q.dtype), F32_EPS
    gamma_h = H * eps / (1 - H * eps)
    hi = jax.lax.Precision.HIGHEST
    q4 = q.astype(jnp.float32).reshape(B, K, N // K, H)
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
    live = (jnp.arange(C)[None, :] < fill[:, None])[:, None, None, :]
    s = jnp.einsum("bkgh,bkch->bkgc", q4, k32, precision=hi) * scale
    s_abs = jnp.einsum("bkgh,bkch->bkgc", jnp.abs(q4), jnp.abs(k32), precision=hi) * scale
    s = jnp.where(live, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(live, p, 0.0)
    a = jnp.einsum("bkgc,bkch->bkgh", p, jnp.abs(v32), precision=hi).reshape(B, N, H)
    s_max = jnp.max(jnp.where(live, s_abs, 0.0), axis=-1).reshape(B, N)
    e = gamma_h * s_max + 4 * eps * (1 + s_max)
    tol_o = (1 + u) * (u + 4 * e[..., None] + 2 * (C + 16) * eps) * a + 2 * u * jnp.abs(o_ref.astype(jnp.float32))
    tol_lse = 2 * e + 2 * (C + 16) * eps + 2 * eps * jnp.abs(jnp.where(jnp.isfinite(lse_ref), lse_ref, 0.0))
    return tol_o, tol_lse


def fills(B: int, C: int, seed: int) -> dict[str, np.ndarray]:
    """Fill levels from empty to full: every row empty, one slot, a ragged mix (0, 1, tile
    edges, C - 1, C and random levels), half and full."""
    edges = [0, 1, 15, 16, 17, 63, 64, 65, C // 2, C - 1, C]
    rng = np.random.default_rng(seed)
    ragged = np.array([edges[b] if b < len(edges) else rng.integers(0, C + 1) for b in range(B)])
    if B == 1:
        ragged = np.array([rng.integers(2, C)])
    return {
        "empty": np.zeros(B),
        "one": np.ones(B),
        "ragged": ragged,
        "half": np.full(B, C // 2),
        "full": np.full(B, C),
    }


def kernel_fn(
    impl: str,
    block_c: int | None,
    mesh: Mesh | None = None,
    B: int = 0,
    K: int = 0,
    *,
    platform: str | None = None,
    put: bool = True,
):
    """The jitted kernel call; with `mesh`, inside shard_map over it with the cache's layout
    (kernels/sharded.py's specs; on one device shard_attention itself would skip shard_map), its
    inputs first placed in that layout (`put`)."""

    def attend(q, k, v, fill):
        return kernels.decode_attention(q, k, v, fill, impl=impl, block_c=block_c, platform=platform)

    if mesh is None:
        return jax.jit(attend)
    q_spec, kv_spec, fill_spec = attention_specs(mesh, B, K)
    fn = jax.jit(
        jax.shard_map(
            attend,
            mesh=mesh,
            in_specs=(q_spec, kv_spec, kv_spec, fill_spec),
            out_specs=(q_spec, q_spec),
            check_vma=False,
        )
    )
    if not put:
        return fn
    shardings = [NamedSharding(mesh, s) for s in (q_spec, kv_spec, kv_spec, fill_spec)]
    return lambda *args: fn(*(jax.device_put(x, s) for x, s in zip(args, shardings)))


def one_device_mesh() -> Mesh:
    return sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])


def compare(o, lse, o_ref, lse_ref, tol_o, tol_lse, fill) -> dict:
    """Max errors and max error / bound over the live rows; the empty rows' contract."""
    o, o_ref = np.asarray(o, np.float32), np.asarray(o_ref, np.float32)
    lse, lse_ref = np.asarray(lse), np.asarray(lse_ref)
    tol_o, tol_lse = np.asarray(tol_o), np.asarray(tol_lse)
    live = np.asarray(fill) > 0
    out = {
        "rows": int(live.size),
        "live_rows": int(live.sum()),
        "empty_rows_ok": bool(np.all(o[~live] == 0) and np.all(np.isneginf(lse[~live]))),
    }
    if live.any():
        d_o, d_lse = np.abs(o[live] - o_ref[live]), np.abs(lse[live] - lse_ref[live])
        r_o, r_lse = d_o / tol_o[live], d_lse / tol_lse[live]
        i = np.unravel_index(np.nanargmax(r_o), r_o.shape)
        j = np.unravel_index(np.nanargmax(r_lse), r_lse.shape)
        out.update(
            max_err_o=float(np.nanmax(d_o)),
            max_ratio_o=float(np.nanmax(r_o)),
            err_o_at_worst=float(d_o[i]),
            tol_o_at_worst=float(tol_o[live][i]),
            max_err_lse=float(np.nanmax(d_lse)),
            max_ratio_lse=float(np.nanmax(r_lse)),
            err_lse_at_worst=float(d_lse[j]),
            tol_lse_at_worst=float(tol_lse[live][j]),
            finite=bool(np.isfinite(o[live]).all() and np.isfinite(lse[live]).all()),
        )
    return out


def numerics(shapes, batches, impl: str, block_c: int | None, record) -> dict:
    """Kernel vs reference at every (heads, batch) and fill level, plain and under shard_map on
    the one-device mesh. `shapes`: {label: (N, K, H, C, dtype)}."""
    mesh = one_device_mesh()
    ref = jax.jit(kernels.decode_attention_ref)
    rows, worst = [], {"o": 0.0, "lse": 0.0}
    for label, (N, K, H, C, dtype) in shapes.items():
        for B in batches:
            kq, kk, kv = jax.random.split(jax.random.key(B * 1000 + N), 3)
            q = jax.random.normal(kq, (B, N, H), dtype)
            k = jax.random.normal(kk, (B, K, C, H), dtype)
            v = jax.random.normal(kv, (B, K, C, H), dtype)
            plain, sharded = kernel_fn(impl, block_c), kernel_fn(impl, block_c, mesh, B, K)
            row = {"heads": label, "N": N, "K": K, "H": H, "C": C, "B": B, "dtype": jnp.dtype(dtype).name}
            for name, fill in fills(B, C, seed=B).items():
                fill = jnp.asarray(fill, jnp.int32)
                t0 = time.perf_counter()
                o, lse = jax.block_until_ready(plain(q, k, v, fill))
                row.setdefault("first_call_s", time.perf_counter() - t0)  # compile included
                o_s, lse_s = jax.block_until_ready(sharded(q, k, v, fill))
                with jax.default_matmul_precision("highest"):  # no TF32 in the reference's p.v on a GPU
                    o_r, lse_r = ref(q, k, v, fill)
                tol_o, tol_lse = error_bounds(q, k, v, fill, o_r, lse_r, scale=H**-0.5)
                for tag, (oo, ll) in (("plain", (o, lse)), ("shard_map", (o_s, lse_s))):
                    c = compare(oo, ll, o_r, lse_r, tol_o, tol_lse, fill)
                    row[f"{tag}/{name}"] = c
                    worst["o"] = max(worst["o"], c.get("max_ratio_o", 0.0))
                    worst["lse"] = max(worst["lse"], c.get("max_ratio_lse", 0.0))
                row[f"shard_map_identical/{name}"] = bool(
                    np.array_equal(np.asarray(o), np.asarray(o_s), equal_nan=True)
                    and np.array_equal(np.asarray(lse), np.asarray(lse_s), equal_nan=True)
                )
            rows.append(row)
            record({"rows": rows})
    return {"rows": rows, "worst_ratio": worst}


def numerics_summary(data: dict) -> tuple[list[dict], list[str], str]:
    """(checks, markdown lines, figure) of `numerics`."""
    rows = data["rows"]
    cases = [(r, key.split("/")[0], key.split("/")[1], c) for r in rows for key, c in r.items() if isinstance(c, dict)]
    bad = [
        f"{r['heads']} B={r['B']} {fill} {tag}"
        for r, tag, fill, c in cases
        if c.get("max_ratio_o", 0) > 1
        or c.get("max_ratio_lse", 0) > 1
        or not c["empty_rows_ok"]
        or not c.get("finite", True)
    ]
    w = data["worst_ratio"]
    checks = [
        {
            "name": "max |error| / bound over every shape, fill and path (o, lse)",
            "value": f"{w['o']:.3f}, {w['lse']:.3f}",
            "limit": "<= 1",
            "kind": "must",
            "passed": not bad,
        },
        {
            "name": "empty rows give o = 0, lse = -inf",
            "value": all(c["empty_rows_ok"] for *_, c in cases),
            "limit": "True",
            "kind": "must",
            "passed": all(c["empty_rows_ok"] for *_, c in cases),
        },
    ]
    lines = [
        "Per heads x batch, the worst over the fill levels (empty, one, ragged, half, full): the "
        "largest error, and the largest error / bound with that element's error and bound; the same "
        "under shard_map, and whether its output is bit-identical to the plain call's.",
        "",
        "| heads (N/K, H, C) | B | max err o | err / bound o (err, bound) | max err lse | "
        "err / bound lse (err, bound) | shard_map err / bound o, lse | identical | first call s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per = {
            tag: [c for key, c in r.items() if isinstance(c, dict) and key.startswith(tag + "/") and "max_ratio_o" in c]
            for tag in ("plain", "shard_map")
        }

        def worst(tag, key, per=per):
            return max((c[key] for c in per[tag]), default=0.0)

        def at(key, per=per):
            c = max(per["plain"], key=lambda c: c[f"max_ratio_{key}"], default=None)
            return (
                "-"
                if c is None
                else (f"{c[f'max_ratio_{key}']:.3f} ({c[f'err_{key}_at_worst']:.1e}, {c[f'tol_{key}_at_worst']:.1e})")
            )

        ident = all(v for key, v in r.items() if key.startswith("shard_map_identical/"))
        lines.append(
            f"| {r['heads']} ({r['N']}/{r['K']}, {r['H']}, {r['C']}) | {r['B']} | "
            f"{worst('plain', 'max_err_o'):.1e} | {at('o')} | {worst('plain', 'max_err_lse'):.1e} | "
            f"{at('lse')} | {worst('shard_map', 'max_ratio_o'):.3f}, "
            f"{worst('shard_map', 'max_ratio_lse'):.3f} | {'yes' if ident else 'no'} | "
            f"{r['first_call_s']:.1f} |"
        )
    if bad:
        lines += ["", f"Beyond the bound: {', '.join(bad[:12])}"]
    lines += ["", "Bound: experiments/device/gpu_kernel_check.py's docstring (unit roundoffs, no measured slack)."]
    figure = (
        f"{len(rows)} shapes x 5 fills, plain + shard_map: worst error/bound {w['o']:.2f} (o), "
        f"{w['lse']:.2f} (lse)" + (f"; {len(bad)} case(s) beyond" if bad else "")
    )
    return checks, lines, figure


def bandwidth(shapes, cases, impl: str, block_c: int | None, copy_mib: int, timing: dict, calls: int, record) -> dict:
    """Bytes the kernel must read per call (live K/V slots + q) over its time, against the copy
    bandwidth (bytes read + written by x + 1 over `copy_mib` MiB) measured first. One program
    holds `calls` kernel calls (each on its own copy of fill, so none is merged away): a call of a
    few microseconds is timed without the host's dispatch in it."""
    copy_bps = kernel_timing.copy_bandwidth(copy_mib, **timing)
    rows = []
    record({"copy_GBps": copy_bps / 1e9, "rows": rows})

    def many(q, k, v, fills):
        return [kernels.decode_attention(q, k, v, fills[i], impl=impl, block_c=block_c) for i in range(calls)]

    fn = jax.jit(many)
    for label, B, fill_frac in cases:
        N, K, H, C, dtype = shapes[label]
        q, k, v, fill = kernel_timing.make_inputs(B, N, K, C, H, jnp.dtype(dtype), fill_frac, False, 0)
        seconds = kernel_timing.time_fn(fn, (q, k, v, jnp.stack([fill] * calls)), **timing) / calls
        live = int(jnp.minimum(fill, C).sum())
        itemsize = jnp.dtype(dtype).itemsize
        nbytes = 2 * live * K * H * itemsize + q.size * itemsize
        rows.append(
            {
                "heads": label,
                "B": B,
                "N": N,
                "K": K,
                "H": H,
                "C": C,
                "fill_frac": fill_frac,
                "bytes": nbytes,
                "us": seconds * 1e6,
                "GBps": nbytes / seconds / 1e9,
                "frac_of_copy": nbytes / seconds / copy_bps,
            }
        )
        record({"copy_GBps": copy_bps / 1e9, "rows": rows})
    return {
        "copy_GBps": copy_bps / 1e9,
        "copy_MiB": copy_mib,
        "timing": {**timing, "calls_per_program": calls},
        "rows": rows,
    }


def bandwidth_summary(data: dict, goal: float) -> tuple[list[dict], list[str], str]:
    rows = data["rows"]
    low = min(r["frac_of_copy"] for r in rows)
    checks = [
        {
            "name": f"kernel read bandwidth / copy bandwidth, every shape (goal >= {goal:.0%})",
            "value": f"min {low:.1%}",
            "limit": f">= {goal:.0%}",
            "kind": "goal",
            "passed": low >= goal,
        }
    ]
    lines = [
        f"Copy bandwidth (x + 1 over {data['copy_MiB']} MiB float32, bytes read + written / time): "
        f"{data['copy_GBps']:.1f} GB/s. Kernel: bytes it must read (K and V of the live slots, "
        f"and q) / median time per call ({data['timing']}).",
        "",
        "| heads (N/K, H, C) | B | fill | MB read | us / call | GB/s | % of copy |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['heads']} ({r['N']}/{r['K']}, {r['H']}, {r['C']}) | {r['B']} | {r['fill_frac']:.0%} | "
            f"{r['bytes'] / 1e6:.1f} | {r['us']:.1f} | {r['GBps']:.1f} | {r['frac_of_copy']:.1%} |"
        )
    best = max(rows, key=lambda r: r["frac_of_copy"])
    figure = (
        f"{low:.0%}-{best['frac_of_copy']:.0%} of the copy's {data['copy_GBps']:.0f} GB/s "
        f"(best {best['GBps']:.0f} GB/s at {best['heads']} B={best['B']})"
    )
    return checks, lines, figure
