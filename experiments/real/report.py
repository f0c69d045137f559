"""Tables and figures of the real-model measurements: results.md (the exact command, the
settings, the tables beside the tiny model's and the papers' numbers), results.json (every number)
and <name>.png, sized to be read at paper-column width."""

from __future__ import annotations

import json
import os
import shlex
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from experiments.lib import figprov  # the provenance sentence every results.md carries
from experiments.lib.figplot import POLICY_COLOURS, check_print_size, width_note  # the figures' shared style
from experiments.real import refs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

plt.rcParams.update({"font.size": 8, "axes.titlesize": 8, "legend.fontsize": 7})


def command(argv) -> str:
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO) if argv is None else "experiments/real/mismatch.py"
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join(["python", script, *args])


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _sci(x: float) -> str:
    return f"{x:.2e}"


def _header(data: dict) -> str:
    s = data["settings"]
    return (
        f"Model: `{os.path.basename(os.path.normpath(s['checkpoint']))}` (float32). {s['prompts']} "
        f"chat prompts (experiments/real/prompts.py, the checkpoint's chat template), responses "
        f"sampled at temperature 1.0 up to {s['max_new']} tokens, seed {s['seed']}. Wall time "
        f"{data['wall_s']:.0f} s on {data['cores']} single-core worker process(es)."
    )


MISMATCH_COLS = (
    "| rollouts | KV saving | k1 KL | k3 KL | KL(dense ‖ sampler) | SARS token reject | "
    "SARS veto | mean length | at cap |",
    "|---|---|---|---|---|---|---|---|---|",
)


def _mismatch_row(r: dict) -> str:
    return (
        f"| {r['arm']['name']} | {_pct(r['kv_saving'])} | {_sci(r['kl_k1'])} | {_sci(r['kl_k3'])} | "
        f"{_sci(r['kl_dense_sparse'])} | {_pct(r['token_reject'])} | {_pct(r['veto'])} | "
        f"{np.mean(r['lengths']):.1f} | {_pct(r['truncated'])} |"
    )


ESTIMATORS = (
    "k1 = mean(-log xi) and k3 = mean(xi - 1 - log xi) over the sampler's response tokens, xi = "
    "pi_dense / pi_sampler (the dense model teacher-forced over the sampler's tokens; the sampler's "
    "log-probs recorded while sampling): both estimate KL(pi_sampler ‖ pi_dense), what the update "
    "logs as mismatch/kl_k1, kl_k3. KL(dense ‖ sampler) = mean(xi log xi), the importance-weighted "
    "estimate of the other direction. SARS at the project's defaults (rl.corrections): a token is "
    "rejected when xi is outside [0.5, 1.5], a response vetoed when min xi < 1e-4."
)


def eviction_markdown(data: dict) -> str:
    s = data["settings"]
    rows = data["rows"]
    lines = [
        _header(data),
        "",
        f"KV eviction: budget B in {s['budgets']}, buffer {s['buffer']} (a compression every "
        f"{s['buffer']} decode steps keeps the top B entries per layer and KV head), window 8, "
        "per-head selection, prompt kept whole until the first compression "
        "(kv.compress_prompt=false, the authors'). KV saving = 1 - kept entries / dense "
        "entries behind each generated token's logits.",
        "",
        ESTIMATORS,
        "",
        *MISMATCH_COLS,
    ]
    lines += [_mismatch_row(r) for r in rows]
    by = {r["arm"]["name"]: r for r in rows}
    tiny = refs.tiny_policies()
    lines += [
        "",
        "Side by side with the tiny model (its numbers are training-time means over seeds "
        "from the committed results named in the source column; k3 KL from the naive-sparse "
        "arm, SARS rejections from the Sparse-RL arm):",
        "",
        "| policy | real k3 KL at B = "
        + " / ".join(map(str, s["budgets"]))
        + " | real token reject | real veto | real KV saving | tiny k3 KL | tiny token reject | "
        "tiny response reject | tiny KV saving | tiny source |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for pol in s["policies"]:
        cells = [by.get(f"{pol}@{b}") for b in s["budgets"]]
        real = [
            " / ".join(f(c) if c else "-" for c in cells)
            for f in (
                lambda c: _sci(c["kl_k3"]),
                lambda c: _pct(c["token_reject"]),
                lambda c: _pct(c["veto"]),
                lambda c: _pct(c["kv_saving"]),
            )
        ]
        for name, t in [(k, v) for k, v in tiny.items() if k.split(" ")[0] == pol] or [(pol, {})]:
            g = lambda k, f: f(t[k]) if k in t else "-"  # noqa: E731, B023
            lines.append(
                f"| {name} | {' | '.join(real)} | {g('kl_k3', _sci)} | "
                f"{g('token_reject', _pct)} | {g('seq_reject', _pct)} | {g('kv_saving', _pct)} | "
                f"{t.get('source', '-')} |"
            )
    lines += ["", f"Papers: {refs.PAPER_SPARSE_RL}."]
    return "\n".join(lines)


def eviction_figure(data: dict):
    s, rows = data["settings"], data["rows"]
    by = {r["arm"]["name"]: r for r in rows}
    fig, axes = plt.subplots(3, 1, figsize=(3.4, 6.0), sharex=True)
    panels = (
        ("kl_k3", "mismatch k3 KL per token (nats)", 1.0),
        ("token_reject", "SARS token reject (%)", 100.0),
        ("kv_saving", "KV saving (%)", 100.0),
    )
    for ax, (key, label, scale) in zip(axes, panels):
        for pol in s["policies"]:
            pts = [(b, by[f"{pol}@{b}"][key] * scale) for b in s["budgets"] if f"{pol}@{b}" in by]
            ax.plot([b for b, _ in pts], [v for _, v in pts], "o-", label=pol, color=POLICY_COLOURS.get(pol, "black"))
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend(ncol=2)
    axes[0].set_title(
        f"Eviction mismatch vs dense, SmolLM2-135M\n{s['prompts']} prompts, up to {s['max_new']} tokens (dense: k3 = 0)"
    )
    axes[-1].set_xscale("log", base=2)
    axes[-1].set_xticks(s["budgets"], [str(b) for b in s["budgets"]])
    axes[-1].set_xlabel(f"KV budget B (entries per layer, head)\nbuffer {s['buffer']}")
    return fig


def quantization_markdown(data: dict) -> str:
    s = data["settings"]
    lines = [
        _header(data),
        "",
        "Quantized rollouts through sparserl_jax.quant (impl native: W8A8 runs an int8 dot with "
        "int32 accumulation or a float8 e4m3 dot, activations per token; W8A16 upcasts the "
        "weights inside the dot; weights per output channel; embedding and lm_head full "
        f"precision). s = {s['invariant_s']:g}: QuRL's invariant scaling (attention RMSNorm x s, "
        "q/k/v / s) applied to the dense weights first, so pi_dense is the scaled full-precision "
        "model, as in training.",
        "",
        ESTIMATORS,
        "",
        *MISMATCH_COLS,
    ]
    lines += [_mismatch_row(r) for r in data["rows"]]
    tiny = refs.tiny_quant()
    if tiny:
        by = {r["arm"]["name"]: r for r in data["rows"]}
        real = lambda n: _sci(by[n]["kl_k3"]) if n in by else "-"  # noqa: E731
        lines += [
            "",
            "Side by side (k3 KL per token; tiny: fig_qurl, int8 W8A8, mean over its 50 "
            "training iterations and 3 seeds):",
            "",
            "| rollouts | real model | tiny model |",
            "|---|---|---|",
            f"| full precision | {real('full precision')} | {_sci(tiny.get('fp', float('nan')))} |",
            f"| int8 W8A8 | {real('int8 w8a8')} | {_sci(tiny.get('int8_naive', float('nan')))} |",
            f"| int8 W8A8, s = 1.5 | {real('int8 w8a8 s=1.5')} | "
            f"{_sci(tiny.get('int8_acr_invariant_scaling', float('nan')))} |",
        ]
    u0 = data["updates"][0]
    lines += [
        "",
        f"Update masking (QuRL Eq. 10-12): one optimizer step of the project's update "
        f"(rl.mode=qurl: TIS weights min(rho, 2) + ACR, clipped GRPO surrogate, k3 KL 1e-4; "
        f"AdamW lr {u0['lr']:g}, betas (0.9, 0.98), weight decay 0.1, grad-norm clip 1) on "
        f"{u0['rows']} int8 W8A8 rollouts of the first {u0['rows']} prompts, advantage = "
        "batch-standardised negative response length (brevity reward). Fraction of the "
        "quantized codes (per-output-channel absmax) that differ before vs after the step:",
        "",
        "| invariant scaling | fp32 weights changed | int8 codes: q/k/v | int8: o, gate/up/down | "
        "int8: all | fp8 codes: q/k/v | fp8: o, gate/up/down | fp8: all | grad norm |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for u in data["updates"]:
        c = u["codes_changed"]
        inv = u["arm"]["invariant_s"]
        lines.append(
            f"| {f's = {inv:g}' if inv else 'off'} | {_pct(u['weights_changed'])} | "
            + " | ".join(f"{100 * c[f][g]:.3f}%" for f in ("int8", "fp8") for g in ("qkv", "o_mlp", "all"))
            + f" | {u['grad_norm']:.3g} |"
        )
    lines += ["", f"Papers: {refs.PAPER_QURL}."]
    return "\n".join(lines)


def quantization_figure(data: dict):
    rows = [r for r in data["rows"] if r["arm"]["quant"] != "none"]  # full precision: k3 = 0
    fig, axes = plt.subplots(2, 1, figsize=(3.4, 5.4))
    names = [r["arm"]["name"] for r in rows]
    axes[0].barh(np.arange(len(rows)), [r["kl_k3"] for r in rows], color="C0")
    axes[0].set_yticks(np.arange(len(rows)), names)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("mismatch k3 KL per token (nats)")
    axes[0].set_title("Quantized rollouts vs full precision\nSmolLM2-135M (full precision: k3 = 0)")
    groups = ("qkv", "o_mlp")
    x = np.arange(4)
    width = 0.38
    for i, u in enumerate(data["updates"]):
        c = u["codes_changed"]
        vals = [100 * c[f][g] for f in ("int8", "fp8") for g in groups]
        inv = u["arm"]["invariant_s"]
        axes[1].bar(x + (i - 0.5) * width, vals, width, label=f"s = {inv:g}" if inv else "no scaling")
    axes[1].set_xticks(x, ["int8\nq/k/v", "int8\no, MLP", "fp8\nq/k/v", "fp8\no, MLP"])
    axes[1].set_ylabel("codes changed by one step (%)")
    axes[1].set_title(f"Update masking: codes moved by\none AdamW step at lr {data['updates'][0]['lr']:g}")
    axes[1].legend()
    return fig


PERCENTILES = (10, 25, 50, 75, 90, 95, 99)


def lengths_markdown(data: dict) -> str:
    s, r = data["settings"], data["run"]
    lens = np.asarray(r["lengths"])
    q = np.percentile(lens, PERCENTILES)
    lines = [
        _header(data),
        "",
        "Response lengths of the dense sampler (tokens, EOS included):",
        "",
        "| mean | " + " | ".join(f"p{p}" for p in PERCENTILES) + " | max | at cap | p95 / p50 |",
        "|---" * (len(PERCENTILES) + 4) + "|",
        f"| {lens.mean():.1f} | "
        + " | ".join(f"{v:.0f}" for v in q)
        + f" | {lens.max()} | {_pct(np.mean(lens >= s['max_new']))} | {q[5] / max(q[2], 1):.2f} |",
        "",
        f"Static sampler (batches of Q = {r['slots']} prompts, each decoded until its longest "
        f"response ends) vs the slot engine (Q = {r['slots']} slots refilled as responses end, "
        f"segments of {r['segment_chunks']} x {s['buffer']} steps), one pinned process, "
        f"median of {r['repeats']} timed call(s) each after a warm-up; "
        f"{_pct(r['same_responses'])} of the responses are token-identical between the two. "
        "Relative numbers (ratios of one interleaved run):",
        "",
        "| | static sampler | slot engine |",
        "|---|---|---|",
        f"| tokens/s relative to static | 1.00 | {r['engine_over_static']:.2f} |",
        f"| bubble (slot-steps idle) | {_pct(r['static_bubble'])} | {_pct(r['engine_bubble_slots'])} "
        f"({_pct(r['engine_bubble_slots_until_drain'])} until the queue empties) |",
        f"| bubble (wall, SortedRL Eq. 4) | {_pct(r['static_bubble'])} (equal step times) | "
        f"{_pct(r['engine_bubble_wall'])} ({_pct(r['engine_bubble_wall_until_drain'])} until the "
        "queue empties) |",
    ]
    tiny = refs.tiny_sorted()
    if tiny:
        lines += [
            "",
            f"Tiny model (`{tiny['command']}`, experiments/results/bench_sorted.md: forced "
            "long-tailed lengths, 256 requests on 16 slots): static bubble "
            f"{_pct(tiny['static_bubble'])}, engine {_pct(tiny['engine_bubble_slots'])} "
            f"({_pct(tiny['engine_bubble_slots_until_drain'])} until the queue empties), engine "
            f"{tiny['speedup']:.2f}x static tokens/s.",
        ]
    lines += ["", f"Paper: {refs.PAPER_SORTED_RL}."]
    return "\n".join(lines)


def lengths_figure(data: dict):
    """Two rows at paper width: the length histogram (the responses at the cap in their own colour,
    percentiles below the cap as lines, those at the cap named in the legend), then the bubble
    ratios (percent of slot-steps or wall time idle) and the engine's throughput relative to the
    static sampler (one dot per timed repeat), each on its own axis."""
    s, r = data["settings"], data["run"]
    lens, cap = np.asarray(r["lengths"]), s["max_new"]
    fig = plt.figure(figsize=(7.0, 5.4), layout="constrained")
    grid = fig.add_gridspec(2, 2, height_ratios=[1.1, 1.0])
    ax = fig.add_subplot(grid[0, :])
    edges = np.linspace(0, cap, 17)
    counts, _ = np.histogram(lens[lens < cap], bins=edges)
    ax.bar(
        edges[:-1],
        counts,
        width=np.diff(edges),
        align="edge",
        color="C0",
        edgecolor="white",
        label="responses that ended (EOS)",
    )
    at_cap = int(np.sum(lens >= cap))
    ax.bar(
        [cap],
        [at_cap],
        width=np.diff(edges)[0] * 0.6,
        color="C3",
        label=f"at the cap ({cap} tokens): {at_cap} of {len(lens)}",
    )
    pct = {p: float(np.percentile(lens, p)) for p in (50, 90, 99)}
    for (p, v), ls in zip(pct.items(), ("--", ":", "-.")):
        if v < cap:
            ax.axvline(v, color="k", ls=ls, lw=1, label=f"p{p} = {v:.0f}")
    capped = [f"p{p}" for p, v in pct.items() if v >= cap]
    if capped:
        ax.plot([], [], " ", label=f"{' = '.join(capped)} = the cap")
    ax.set_xlim(0, cap + np.diff(edges)[0])
    ax.set_xlabel("response length (tokens, EOS included)")
    ax.set_ylabel("responses")
    ax.set_title(f"Response lengths: {len(lens)} chat prompts, temperature 1.0, cap {cap}", fontsize=9)
    ax.legend(loc="upper left", frameon=False)
    ax = fig.add_subplot(grid[1, 0])
    kinds = [
        ("slot-steps", "static_bubble", "engine_bubble_slots", "engine_bubble_slots_until_drain"),
        ("wall (Eq. 4)", "static_bubble", "engine_bubble_wall", "engine_bubble_wall_until_drain"),
    ]
    x = np.arange(len(kinds))
    for i, (label, colour, idx) in enumerate(
        (
            ("static sampler", "0.55", 1),
            ("slot engine, whole run", "C1", 2),
            ("slot engine, until the queue empties", "C2", 3),
        )
    ):
        ax.bar(x + (i - 1) * 0.27, [100 * r[k[idx]] for k in kinds], 0.27, color=colour, label=label)
    ax.set_xticks(x, [k[0] for k in kinds])
    ax.set_ylim(0, 100)
    ax.set_ylabel("bubble: idle share (%)")
    ax.set_title("Bubble ratio (lower is better)", fontsize=9)
    ax.legend(loc="upper right", frameon=False, fontsize=7)
    ax = fig.add_subplot(grid[1, 1])
    ratios = np.asarray(r["static_s"]) / np.asarray(r["engine_s"])  # same tokens: time ratio = throughput ratio
    ax.bar([0, 1], [1.0, r["engine_over_static"]], 0.5, color=["0.55", "C1"])
    ax.plot(
        np.ones_like(ratios) + np.linspace(-0.08, 0.08, len(ratios)),
        ratios,
        "k.",
        ms=4,
        label=f"each of {len(ratios)} timed repeats",
    )
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_xticks([0, 1], ["static sampler", "slot engine"])
    ax.set_ylim(0, max(1.5, 1.15 * float(ratios.max())))
    ax.set_ylabel("tokens / s relative to static (x)")
    ax.set_title(f"Throughput (median of {r['repeats']} repeats)", fontsize=9)
    ax.legend(loc="upper left", frameon=False, fontsize=7)
    fig.suptitle(
        f"SmolLM2-135M rollouts: length tail, and the slot engine vs static batches (Q = {r['slots']})", fontsize=10
    )
    return fig


def lengths_caption(data: dict) -> str:
    r = data["run"]
    return (
        f"Figure: top, the dense sampler's response lengths (16 bins up to the cap; red: the "
        f"responses cut at the cap; lines: percentiles below the cap). Bottom left: the share of "
        f"slot-steps (or of wall time, SortedRL Eq. 4) in which a slot decodes nothing, for the "
        f"static sampler (batches of Q = {r['slots']}) and the slot engine, over the whole run and "
        f"until its request queue empties. Bottom right: the engine's tokens per second relative "
        f"to the static sampler's on the same responses: bar, the ratio of the medians of "
        f"{r['repeats']} interleaved timed calls each; dots, the ratio within each repeat."
    )


def eviction_caption(data: dict) -> str:
    s = data["settings"]
    return (
        f"Figure: for each eviction policy (a line, in its colour of every figure) at each KV budget B "
        f"(log2 axis; buffer {s['buffer']}): top, the mismatch k3 KL per response token between the "
        "sparse sampler and the dense model (log axis; the dense cache's is 0, not drawn); middle, the "
        "share of response tokens SARS rejects; bottom, the KV saving. One evaluation of "
        f"{s['prompts']} prompts with one sampling seed per point: no spread, no error bars."
    )


def quantization_caption(data: dict) -> str:
    return (
        "Figure: top, the mismatch k3 KL per response token of each quantized rollout setting against "
        "full precision (full precision: 0, not drawn); bottom, the share of quantized weight codes "
        "(int8 and fp8; q/k/v projections, then o and the MLP) that one AdamW step at lr "
        f"{data['updates'][0]['lr']:g} moves, without invariant scaling and with it (one bar each). One "
        "measurement each (one sampling seed, one step): no error bars."
    )


def _bins(r: dict) -> dict[int, dict]:
    return {int(b): v for b, v in r["bins"].items()}


def at_equal_mismatch(fixed: list[dict], k3: float) -> dict | None:
    """The fixed budgets' KV saving and agreement p5 at mean mismatch `k3`, linear in k3 between the
    two budgets around it (rows: 'kl_k3', 'kv_saving', 'agreement_p5', 'arm' with 'budget'); None
    when `k3` lies outside the budgets' range."""
    pts = sorted(fixed, key=lambda r: r["kl_k3"])
    for lo, hi in zip(pts, pts[1:]):
        if lo["kl_k3"] <= k3 <= hi["kl_k3"]:
            t = (k3 - lo["kl_k3"]) / max(hi["kl_k3"] - lo["kl_k3"], 1e-30)
            return {
                "kv_saving": lo["kv_saving"] + t * (hi["kv_saving"] - lo["kv_saving"]),
                "agreement_p5": lo["agreement_p5"] + t * (hi["agreement_p5"] - lo["agreement_p5"]),
                "between": (lo["arm"]["budget"], hi["arm"]["budget"]),
            }
    return None


def equal_mismatch_sentence(fixed: list[dict], sched: dict) -> str:
    """The schedule against the fixed budgets at its own mean mismatch (at_equal_mismatch)."""
    eq = at_equal_mismatch(fixed, sched["kl_k3"])
    if eq is None:
        return f"The schedule's k3 {_sci(sched['kl_k3'])} lies outside the fixed budgets' range: no equal-mismatch comparison."
    lo, hi = eq["between"]
    return (
        f"At the schedule's mean mismatch (k3 {_sci(sched['kl_k3'])}), the fixed budgets (linear in k3 between "
        f"{lo} and {hi}) save {_pct(eq['kv_saving'])} at agreement p5 {eq['agreement_p5']:.4f}; the schedule saves "
        f"{_pct(sched['kv_saving'])} at {sched['agreement_p5']:.4f}."
    )


def tail_markdown(data: dict) -> str:
    s, rows, tau = data["settings"], data["rows"], data["tau"]
    every = s["every"]
    lines = [
        _header(data),
        "",
        f"KV eviction: `{s['policy']}`, buffer {s['buffer']}, window 8, per-head selection, prompt kept whole until "
        "the first compression. Agreement: Sparrow's per-token acceptance rate sum_v min(p_sampler(v), p_dense(v)) "
        "(1 - total variation) over the sampler's 20 most probable tokens (`rl/diagnostics.py agreement`; a lower "
        "bound, the logged upper bound in the last column), p5 its 5th percentile over the response tokens. "
        f"tau = {tau:.4f}, the pooled p5 of the reference budget {s['reference']}. Schedule (kv.budget_schedule, one "
        f"entry per {every} tokens seen, prompt included): {data['schedule']}, "
        + (
            f"calibrated bin by bin with the earlier bins' budgets in force, each bin's budget kept only where it "
            f"and every later bin hold their target ({data['trials']} candidate runs)."
            if data.get("calibration") == "sequential"
            else "each bin's budget taken from the fixed budgets' percentile there (Sparrow's way)."
        ),
        "",
        "| rollouts | KV saving | agreement mean | agreement p5 | p5 upper bound | k3 KL | xi p5 | SARS token reject "
        "| mean length |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['arm']['name']} | {_pct(r['kv_saving'])} | {r['agreement_mean']:.4f} | {r['agreement_p5']:.4f} "
            f"| {r['agreement_upper_p5']:.4f} | {_sci(r['kl_k3'])} | {r['xi_p5']:.3f} | {_pct(r['token_reject'])} "
            f"| {r['mean_length']:.1f} |"
        )
    bins = sorted({b for r in rows for b in _bins(r)})
    lines += [
        "",
        "Agreement p5 by bin of tokens seen (tokens in the bin; a bin below tau is marked *):",
        "",
        "| rollouts | " + " | ".join(f"{b * every}-{(b + 1) * every - 1}" for b in bins) + " |",
        "|---|" + "---|" * len(bins),
    ]
    for r in rows:
        cells = []
        for b in bins:
            v = _bins(r).get(b)
            cells.append("" if v is None else f"{v['p5']:.3f}{'*' if v['p5'] < tau else ''} ({v['tokens']})")
        lines.append(f"| {r['arm']['name']} | " + " | ".join(cells) + " |")
    sched, ref = rows[-1], next(r for r in rows if r["arm"]["budget"] == s["reference"] and not r["arm"]["schedule"])
    below = [b for b, v in _bins(sched).items() if v["p5"] < tau]
    lines += [
        "",
        f"Outcome (one seed, measured): the schedule saves {_pct(sched['kv_saving'])} of the KV against "
        f"{_pct(ref['kv_saving'])} for the fixed budget {s['reference']}, at pooled agreement p5 "
        f"{sched['agreement_p5']:.4f} against {ref['agreement_p5']:.4f} (tau) and k3 {_sci(sched['kl_k3'])} against "
        f"{_sci(ref['kl_k3'])}; its p5 is below tau in {len(below)} of {len(_bins(sched))} bins"
        + (f" ({', '.join(f'{b * every}-{(b + 1) * every - 1}' for b in sorted(below))})" if below else "")
        + ". "
        + equal_mismatch_sentence([r for r in rows if not r["arm"]["schedule"]], sched)
        + " Sparrow reports a 2.2x / 2.4x / 2.0x rollout speedup on Qwen3-1.7B / 4B / 8B at a 0.86 p5 threshold, "
        "with 37K-token generations in 2K-token bins; this is a 135M model at 128 tokens.",
    ]
    return "\n".join(lines)


def tail_figure(data: dict):
    s, rows, tau = data["settings"], data["rows"], data["tau"]
    every = s["every"]
    fig, axes = plt.subplots(2, 1, figsize=(3.4, 5.6))
    cmap = plt.get_cmap("viridis")
    fixed = [r for r in rows if not r["arm"]["schedule"]]
    for i, r in enumerate(fixed):
        bins = sorted(_bins(r))
        axes[0].plot(
            [(b + 0.5) * every for b in bins],
            [_bins(r)[b]["p5"] for b in bins],
            "o-",
            ms=3,
            color=cmap(i / max(len(fixed) - 1, 1)),
            label=f"fixed {r['arm']['budget']}",
        )
    sched = rows[-1]
    bins = sorted(_bins(sched))
    axes[0].plot(
        [(b + 0.5) * every for b in bins],
        [_bins(sched)[b]["p5"] for b in bins],
        "s-",
        color="tab:red",
        lw=2,
        ms=4,
        label="schedule",
    )
    axes[0].axhline(tau, color="black", ls="--", lw=1, label=f"tau = {tau:.3f}")
    axes[0].set_xlabel("tokens seen, prompt included (bin centre)")
    axes[0].set_ylabel("agreement p5 in the bin")
    fig.legend(*axes[0].get_legend_handles_labels(), fontsize=7, ncol=3, loc="lower center")
    fig.set_layout_engine("tight", rect=(0, 0.08, 1, 1))
    axes[0].grid(alpha=0.3)
    model = os.path.basename(os.path.normpath(s["checkpoint"]))
    axes[0].set_title(f"Agreement tail through the generation\n{model}, {s['policy']}, {s['prompts']} prompts")
    for i, r in enumerate(fixed):
        axes[1].plot(100 * r["kv_saving"], r["agreement_p5"], "o", color=cmap(i / max(len(fixed) - 1, 1)))
        axes[1].annotate(
            f"{r['arm']['budget']}: k3 {r['kl_k3']:.2g}",
            (100 * r["kv_saving"], r["agreement_p5"]),
            fontsize=7,
            xytext=(3, 3),
            textcoords="offset points",
        )
    axes[1].plot(100 * sched["kv_saving"], sched["agreement_p5"], "s", color="tab:red", ms=6)
    axes[1].annotate(
        f"schedule: k3 {sched['kl_k3']:.2g}",
        (100 * sched["kv_saving"], sched["agreement_p5"]),
        fontsize=7,
        xytext=(3, -10),
        textcoords="offset points",
        color="tab:red",
    )
    axes[1].axhline(tau, color="black", ls="--", lw=1)
    axes[1].set_xlabel("KV saving (%)")
    axes[1].set_ylabel("agreement p5 (all response tokens)")
    axes[1].grid(alpha=0.3)
    return fig


def tail_caption(data: dict) -> str:
    return (
        "Top: the 5th percentile of the per-token agreement in each bin of tokens seen, per fixed budget (circles) "
        "and for the schedule (red squares); dashed: tau. Bottom: KV saving against the pooled 5th percentile, "
        "each point labelled with its budget and mean k3 KL (nats per token). One seed, no bands."
    )


CAPTIONS = {
    "lengths": lengths_caption,
    "eviction": eviction_caption,  # every figure's marks defined
    "quantization": quantization_caption,
    "tail": tail_caption,
}
RENDER = {
    "eviction": (eviction_markdown, eviction_figure, "Eviction mismatch (Sparse-RL)"),
    "quantization": (quantization_markdown, quantization_figure, "Quantization mismatch (QuRL)"),
    "lengths": (lengths_markdown, lengths_figure, "Response lengths and the slot engine (SortedRL)"),
    "tail": (tail_markdown, tail_figure, "Agreement tail and a budget schedule (Sparrow)"),
}


def write(name: str, out_dir: str, data: dict, argv=None, cmd: str | None = None) -> None:
    """results.md, results.json and <name>.png under out_dir (`cmd`: the command line recorded,
    default this process's)."""
    markdown, figure, title = RENDER[name]
    os.makedirs(out_dir, exist_ok=True)
    cmd = cmd or command(argv)
    md = markdown(data)
    fig = figure(data)
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    check_print_size(fig, name)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        prov = figprov.provenance_line(data, os.path.join(out_dir, "results.json"))
        f.write(f"# Real model: {title}\n\nCommand: `{cmd}`\n\n{prov}\n\n{md}\n\n![{name}]({name}.png)\n")
        if name in CAPTIONS:
            f.write(f"\n{CAPTIONS[name](data)}\n")
        if width_note({name: fig}):
            f.write(f"\n{width_note({name: fig})}\n")
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"command": cmd, **data}, f, indent=1)
    fig.savefig(os.path.join(out_dir, f"{name}.png"), dpi=200)
    plt.close(fig)
    print(md)


def rerender(out_dir: str) -> None:
    """Write results.md and the figure again from results.json (same numbers, same command)."""
    with open(os.path.join(out_dir, "results.json")) as f:
        data = json.load(f)
    cmd = data.pop("command")
    name = next(n for n in RENDER if cmd.split()[2:3] == [n])
    write(name, out_dir, data, cmd=cmd)
