"""Figure style at paper-column width and the plotting helpers figure scripts share: one column is
COLUMN_W (3.5 in) wide; a figure wider than that is a two-column figure (at most TWO_COLUMN_W, 7 in)
and results.md says so under its caption (`width_note`); no text below MIN_FONT_PT (7 pt) at that
print size (`save_figure` refuses a figure with smaller text). One colour per arm across every
figure (`ARM_COLOURS`, `arm_colours`) and per eviction policy (`POLICY_COLOURS`). Helpers: mean ±
std curves over runs, bands clipped to a metric's range, a symmetric-log axis, the ablation layout,
one legend below the panels, titles saying what was run, bars of runs and heatmaps of per-run cells.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterable, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.axis
import matplotlib.pyplot as plt
import matplotlib.text
import numpy as np
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator

from experiments.lib.figruns import DEFAULT_CONFIG
from experiments.lib.figstats import mean_std
from sparserl_jax.config import TrainConfig

# Paper-column figures: one column COLUMN_W wide (a panel of a two-column figure too), a two-column
# figure at most TWO_COLUMN_W, no text below MIN_FONT_PT at the size the PNG is printed.
COLUMN_W = PANEL_W = 3.5
TWO_COLUMN_W = 7.0
MIN_FONT_PT = 7.0
DPI = 150
plt.rcParams.update(
    {
        "font.size": 8,
        "axes.titlesize": 8,
        "axes.labelsize": 8,
        "xtick.labelsize": 7,
        "ytick.labelsize": 7,
        "legend.fontsize": 7,
        "figure.titlesize": 8,
    }
)

# One colour per arm across every figure (the three arms of the Sparse-RL paper first, as the
# real-model collapse study draws them), and one per eviction policy ("none": the dense cache).
ARM_COLOURS = {
    "dense": "tab:blue",
    "naive_sparse": "tab:red",
    "sparse_rl": "tab:green",
    "sars_only": "tab:cyan",
    "ibr_only": "tab:pink",
    "sparse_rl_sequence": "darkgreen",
    "sparse_rl_geometric": "yellowgreen",
    "int8_naive": "tab:orange",
    "int8_tis": "teal",
    "qurl": "tab:purple",
    "qurl_invariant": "indigo",
    "sparse_int8_acr": "tab:olive",
    "sparse_int8_sparse_rl_acr": "darkolivegreen",
    "sorted_on_policy": "tab:brown",
    "sorted_on_policy_hold": "rosybrown",
    "sorted_partial": "#e6ab02",
    "stacked": "tab:gray",
}
POLICY_COLOURS = {
    "none": ARM_COLOURS["dense"],
    "streaming": "tab:orange",
    "h2o": "tab:purple",
    "snapkv": "tab:cyan",
    "rkv": "tab:olive",
    "random": "tab:gray",
}


def arm_colours(names: Iterable[str], roles: dict[str, str] | None = None) -> dict[str, str]:
    """Each arm's colour from ARM_COLOURS, by its own name or the palette name `roles` gives it (a
    figure's "none" correction is naive sparse, "fp" rollouts are dense ...); an arm the palette
    does not name gets black."""
    roles = roles or {}
    return {n: ARM_COLOURS.get(roles.get(n, n), "black") for n in names}


# ----------------------------------------------------------------------------- figure style

BAND_CAPTION = (
    "Lines and bars: mean over runs (warm starts x seeds); shaded bands and error bars: "
    "± one sample standard deviation over runs (none with one run), clipped to the "
    "metric's range."
)


def seeds_caption(marks: str, seeds: Sequence[int], note: str = "") -> str:
    """A caption's sentence on `marks` (points or bars) that are means over seeds with ± one std
    error bars, and the seeds."""
    return (
        f"{marks}: mean over seeds; error bars: ± one sample standard deviation over seeds, clipped at 0 "
        f"(none with one seed{note}). Seeds {seeds}."
    )


def band(ax, x, m, s, colour, floor: float | None = 0.0, ceil: float | None = None) -> None:
    """A ± one-standard-deviation band clipped to the metric's range [floor, ceil]."""
    lo, hi = m - s, m + s
    if floor is not None:
        lo, hi = np.maximum(lo, floor), np.maximum(hi, floor)
    if ceil is not None:
        lo, hi = np.minimum(lo, ceil), np.minimum(hi, ceil)
    ax.fill_between(x, lo, hi, color=colour, alpha=0.2, lw=0)


def clipped_err(means, stds, floor: float | None = 0.0, ceil: float | None = None) -> list[np.ndarray]:
    """Error bars of ± one standard deviation clipped to the metric's range [floor, ceil]: the
    lengths [below, above] each mean (matplotlib's xerr / yerr)."""
    means, stds = np.asarray(means, np.float64), np.asarray(stds, np.float64)
    below = stds if floor is None else np.minimum(stds, np.maximum(means - floor, 0.0))
    return [below, stds if ceil is None else np.minimum(stds, np.maximum(ceil - means, 0.0))]


def config_name(command: str, default_config: str = DEFAULT_CONFIG) -> str:
    """The base config a figure ran on, from its command line: the --config file's stem, or
    that of the script's default config."""
    words = command.split()
    for i, w in enumerate(words):
        if w == "--config" and i + 1 < len(words):
            return os.path.splitext(os.path.basename(words[i + 1]))[0]
        if w.startswith("--config="):
            return os.path.splitext(os.path.basename(w.split("=", 1)[1]))[0]
    return os.path.splitext(os.path.basename(default_config))[0]


def runs_phrase(seeds: Sequence[int], warms: Sequence[int] = (0,)) -> str:
    """'3 seeds' or '2 warm starts x 3 seeds'."""
    s = f"{len(seeds)} seed{'s' if len(seeds) != 1 else ''}"
    return s if len(warms) == 1 else f"{len(warms)} warm starts x {s}"


def run_title(
    cfg: TrainConfig,
    command: str,
    seeds: Sequence[int],
    what: str = "",
    warms: Sequence[int] = (0,),
    default_config: str = DEFAULT_CONFIG,
    setting: str | None = None,
    runs: str | None = None,
) -> str:
    """A suptitle saying what was run: `what`, then the config and task with `setting` (default:
    the KV policy, budget and buffer), then `runs` (default: the runs and the iterations of rollouts)."""
    kv = cfg.kv
    head = f"{what}\n" if what else ""
    setting = setting or f"{kv.policy} budget {kv.budget} + buffer {kv.buffer}"
    runs = runs or (
        f"{runs_phrase(seeds, warms)}, {cfg.train.iterations} iterations of "
        f"{cfg.rollout.prompts}x{cfg.rollout.samples} rollouts"
    )
    return f"{head}{config_name(command, default_config)} (task {cfg.data.task}), {setting}\n{runs}"


def symlog_axis(ax, values: Iterable[float], axis: str = "x") -> None:
    """A log axis that also shows values <= 0: symlog, linear below the smallest positive |value|,
    with at most 5 decade ticks (no overlapping labels)."""
    v = np.abs(np.asarray([x for x in values if np.isfinite(x)], np.float64))
    pos = v[v > 0]
    lo = int(np.floor(np.log10(pos.min()))) if pos.size else -6
    hi = int(np.ceil(np.log10(v.max()))) if pos.size else 0
    hi = max(hi, lo + 1)
    getattr(ax, f"set_{axis}scale")("symlog", linthresh=10.0**lo, linscale=0.5)
    step = max(1, -(-(hi - lo) // 4))
    ticks = [0.0] + [10.0**k for k in range(hi, lo - 1, -step)][::-1]
    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_locator(FixedLocator(ticks))
    target.set_minor_locator(FixedLocator([]))
    target.set_major_formatter(
        FuncFormatter(lambda x, _: "0" if x == 0 else f"$10^{{{int(round(np.log10(abs(x))))}}}$")
    )
    neg = np.asarray([x for x in values if np.isfinite(x)], np.float64)
    low = min(-0.3 * 10.0**lo, 1.5 * float(neg.min()) if neg.size else 0.0)
    # room right of the largest bar for its value
    getattr(ax, f"set_{axis}lim")(low, 10.0 ** (hi + 0.3 * (hi - lo + 1)))


def ablation_figure(
    results: dict[str, list[dict]],
    histories: dict[str, list[list[dict]]],
    bars: Sequence[tuple[str, str, str, bool]],
    labels: dict[str, str],
    title: str,
    reference: str | None = None,
    roles: dict[str, str] | None = None,
):
    """A figure of an ablation with short variant labels: one horizontal bar panel (mean ± std over
    runs, value written beside each bar, every run a dot) per (key, axis label, value format,
    symlog?) in `bars`, then one small panel per variant with its train reward curve (mean ± std
    over runs) over the `reference` variant's mean (grey, dashed). Colours: arm_colours (`roles`
    names a variant's arm in the palette)."""
    names = list(results)
    colours = arm_colours(names, roles)
    n_multi_rows = -(-len(names) // 2)
    bar_h = 0.9 + 0.22 * len(names)
    fig = plt.figure(
        figsize=(2 * PANEL_W, bar_h * -(-len(bars) // 2) + 1.55 * n_multi_rows + 0.5), layout="constrained"
    )
    top, bottom = fig.subfigures(2, 1, height_ratios=[bar_h * -(-len(bars) // 2), 1.55 * n_multi_rows])
    bar_axes = np.atleast_1d(top.subplots(-(-len(bars) // 2), min(len(bars), 2))).ravel()
    for ax, (key, xlabel, spec, log) in zip(bar_axes, bars):
        means, stds = run_bars(
            ax,
            names,
            {n: [r[key] for r in results[n]] for n in names},
            colours,
            horizontal=True,
            value_fmt=spec,
            labels=[labels.get(n, n) for n in names],
        )
        if ax is not bar_axes[0] and len(bar_axes) == 2:  # same rows as its left neighbour
            ax.tick_params(labelleft=False)
        ax.set_xlabel(xlabel)
        if log:
            symlog_axis(ax, np.concatenate([means, means + stds]))
        else:
            ax.set_xlim(0, max(1e-9, float(np.nanmax(means + stds))) * 1.3)
    multi = np.atleast_2d(bottom.subplots(n_multi_rows, 2, sharex=True, sharey=True))
    for i, ax in enumerate(multi.ravel()):
        if i >= len(names):
            ax.set_visible(False)
            continue
        name = names[i]
        if reference in histories and name != reference:
            x, m, _ = curve(histories[reference], "reward/mean")
            ax.plot(x, m, "--", color="0.55", lw=1)
        mean_curves(ax, {name: histories[name]}, colours, "reward/mean", 0.0, 1.0)
        ax.set_title(labels.get(name, name), fontsize=8, pad=2)
        if i % 2 == 0:
            ax.set_ylabel("train reward\n(mean per rollout)")
        if i >= len(names) - 2:
            ax.set_xlabel("iteration")
            ax.xaxis.set_tick_params(labelbottom=True)
    fig.suptitle(title)
    return fig


def panels(rows: int, height: float, width: float = 2 * PANEL_W, **kw):
    """A figure of `rows` rows of two panels (paper-column width, constrained layout) and its axes, flat."""
    fig, axes = plt.subplots(rows, 2, figsize=(width, height), layout="constrained", **kw)
    return fig, axes.ravel()


def iteration_axis(ax) -> None:
    """An x axis of training iterations: labelled, whole numbers only."""
    ax.set_xlabel("iteration")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def band_legend_below(fig, ax, ncol: int | None = None) -> None:
    """One legend for the whole figure, below its panels (never over a curve), in `ncol` columns
    (default: one row), fewer where that row would be wider than the figure."""
    handles, names = ax.get_legend_handles_labels()
    ncol = ncol or len(names)
    while True:
        legend = fig.legend(handles, names, loc="outside lower center", ncol=ncol, frameon=False)
        fig.canvas.draw()
        if ncol == 1 or legend.get_window_extent().width <= fig.bbox.width:
            return
        legend.remove()
        ncol -= 1


# ----------------------------------------------------------------------------- curves


def spread(rows: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Mean and sample standard deviation over runs (0 for one run) of per-run series, each cut
    to the shortest."""
    n = min(len(r) for r in rows)
    ys = np.array([list(r[:n]) for r in rows], np.float64).reshape(len(rows), n)
    return ys.mean(0), ys.std(0, ddof=1) if len(rows) > 1 else np.zeros(n)


def curve(histories: Sequence[list[dict]], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Iterations, mean and sample standard deviation over runs (0 for one run) of one metric."""
    m, s = spread([[x.get(key, np.nan) for x in h] for h in histories])
    return np.arange(1, len(m) + 1), m, s


def mean_line(
    ax, x, m, s, colour, floor: float | None = 0.0, ceil: float | None = None, fmt: str = "-", **plot_kw
) -> None:
    """A mean over runs (line) and its ± one standard deviation band clipped to [floor, ceil]."""
    ax.plot(x, m, fmt, color=colour, **plot_kw)
    band(ax, x, m, s, colour, floor, ceil)


def mean_curves(
    ax,
    histories: dict[str, Sequence[list[dict]]],
    colours: dict[str, str],
    key: str,
    floor: float | None = 0.0,
    ceil: float | None = None,
    lw: float = 1.2,
    one_run_dashed: bool = False,
    **plot_kw,
) -> None:
    """Per arm, one logged metric per iteration: the mean over the arm's runs and a ± one std band
    clipped to [floor, ceil]; with `one_run_dashed` an arm of one run is dashed, without a band."""
    for name, hs in histories.items():
        x, m, s = curve(hs, key)
        if one_run_dashed and len(hs) == 1:  # no spread to show
            ax.plot(x, m, "--", color=colours[name], lw=lw, **plot_kw)
        else:
            mean_line(ax, x, m, s, colours[name], floor, ceil, lw=lw, **plot_kw)


def sparse_curve(histories: Sequence[list[dict]], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Like curve() for a metric logged at some iterations only (e.g. eval/accuracy every
    train.eval_every): the iterations where every run logged it."""
    steps = None
    for h in histories:
        have = {i + 1 for i, row in enumerate(h) if key in row}
        steps = have if steps is None else steps & have
    x = np.array(sorted(steps or ()), np.int64)
    return x, *spread([[h[i - 1][key] for i in x] for h in histories])


def text_sizes(fig) -> list[float]:
    """The font size (pt) of every visible, non-empty text of a drawn figure."""
    fig.canvas.draw()
    return [t.get_fontsize() for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text().strip()]


def _undrawn_tick_labels(fig) -> set[int]:
    """ids of the tick labels matplotlib keeps but does not draw: ticks outside their axis' view."""
    out = set()
    for axis in fig.findobj(matplotlib.axis.Axis):
        scale = axis.get_transform()
        lo, hi = sorted(scale.transform(np.asarray(axis.get_view_interval(), np.float64)))
        eps = 1e-6 * max(hi - lo, 1e-12)
        for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()]:
            loc = tick.get_loc()
            if loc is None or not lo - eps <= scale.transform(np.asarray([loc], np.float64))[0] <= hi + eps:
                out.update({id(tick.label1), id(tick.label2)})
    return out


def cut_texts(fig) -> list[str]:
    """The texts of a drawn figure that reach past its edges (cut off in the PNG)."""
    box, undrawn = fig.bbox.padded(1.0), _undrawn_tick_labels(fig)
    shown = [
        t
        for t in fig.findobj(matplotlib.text.Text)
        if t.get_visible() and t.get_text().strip() and id(t) not in undrawn
    ]
    return [t.get_text() for t in shown if not all(box.contains(*p) for p in t.get_window_extent().corners())]


def check_print_size(fig, name: str) -> None:
    """A figure is at most TWO_COLUMN_W wide, has no text below MIN_FONT_PT at that size and none
    cut off at its edges."""
    width = fig.get_figwidth()
    if width > TWO_COLUMN_W + 1e-6:
        raise ValueError(
            f"{name}: {width:.2f} in wide; a figure is one column ({COLUMN_W} in) or two ({TWO_COLUMN_W} in) at most"
        )
    small = min(text_sizes(fig), default=MIN_FONT_PT)
    if small < MIN_FONT_PT:
        raise ValueError(f"{name}: text at {small:g} pt; at least {MIN_FONT_PT:g} pt at print size")
    cut = cut_texts(fig)
    if cut:
        raise ValueError(f"{name}: text cut off at the figure's edges: {cut[:3]}")


def width_note(figures: dict) -> str:
    """results.md's line declaring the figures wider than one column (COLUMN_W) two-column
    figures; '' when every figure fits one column."""
    wide = [
        f"{name}.png ({fig.get_figwidth():.1f} in)"
        for name, fig in figures.items()
        if fig.get_figwidth() > COLUMN_W + 1e-6
    ]
    return (
        ""
        if not wide
        else f"Two-column figure{'s' if len(wide) > 1 else ''}, printed across the full "
        f"text width ({TWO_COLUMN_W:g} in; text at least {MIN_FONT_PT:g} pt at that size): {', '.join(wide)}."
    )


def wrap_suptitle(fig) -> None:
    """Re-wrap the lines of a suptitle wider than the figure (a long config name, a long run
    description) so that it prints whole; the layout then makes room for the extra lines."""
    title = getattr(fig, "_suptitle", None)  # matplotlib keeps the Text there (get_suptitle gives its string)
    if title is None or not title.get_text():
        return
    for _ in range(4):
        fig.canvas.draw()
        box, room = title.get_window_extent(), 0.96 * fig.bbox.width
        if box.width <= room:
            return
        lines = title.get_text().split("\n")
        chars = max(10, int(max(map(len, lines)) * room / box.width))
        title.set_text("\n".join(textwrap.fill(line, chars) for line in lines))


def save_figure(out_dir: str, fig, name: str) -> None:
    """<out_dir>/<name>.png, after wrap_suptitle and check_print_size."""
    os.makedirs(out_dir, exist_ok=True)
    wrap_suptitle(fig)
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    check_print_size(fig, name)
    fig.savefig(os.path.join(out_dir, f"{name}.png"), dpi=DPI)
    plt.close(fig)


def run_bars(
    ax,
    names: Sequence[str],
    values: dict[str, Sequence[float]],
    colours: dict[str, str],
    horizontal: bool = False,
    floor: float | None = 0.0,
    marks: dict[str, float | None] | None = None,
    value_fmt: str | None = None,
    labels: Sequence[str] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One bar per name at its mean over runs, an error bar of ± one sample standard deviation
    (none for one run; clipped at `floor`, the metric's range), every run a black dot, a black
    dash across the bar at `marks[name]` where given (e.g. a paper's number), with `value_fmt`
    the mean written past the bar's end, and with `labels` the bars' tick labels (horizontal bars
    top to bottom; vertical ones slanted). Returns the means and standard deviations."""
    stats = [mean_std(values[n]) for n in names]
    means, stds = np.array([m for m, _ in stats]), np.array([s for _, s in stats])
    pos = np.arange(len(names))
    draw = ax.barh if horizontal else ax.bar
    err = {"xerr" if horizontal else "yerr": clipped_err(means, stds, floor)}
    draw(pos, means, color=[colours[n] for n in names], alpha=0.85, capsize=2, error_kw={"elinewidth": 0.8}, **err)
    for p, n in zip(pos, names):
        vals = list(values[n])
        if len(vals) > 1:
            jitter = p + np.linspace(-0.15, 0.15, len(vals))
            ax.plot(*((vals, jitter) if horizontal else (jitter, vals)), "k.", ms=2.5)
        mark = (marks or {}).get(n)
        if mark is not None:
            dash = ([mark, mark], [p - 0.4, p + 0.4])
            ax.plot(*(dash if horizontal else dash[::-1]), "--", color="black", lw=1.5)
        if value_fmt:  # past the error bar and the last run's dot
            end = max(means[p] + stds[p], *vals, 0.0)
            ax.annotate(
                f"{means[p]:{value_fmt}}",
                (end, p) if horizontal else (p, end),
                fontsize=8,
                xytext=(3, 0) if horizontal else (0, 3),
                textcoords="offset points",
                va="center" if horizontal else "bottom",
                ha="left" if horizontal else "center",
            )
    if labels is not None and horizontal:
        ax.set_yticks(pos, labels)
        ax.invert_yaxis()
    elif labels is not None:
        ax.set_xticks(pos, labels, rotation=30, ha="right", rotation_mode="anchor")
    return means, stds


def heatmap(
    ax,
    cells: Sequence[Sequence[Sequence[float]]],
    rows: Sequence,
    columns: Sequence,
    vmin: float,
    vmax: float,
    cmap: str,
    spec: str = "{:.2f}",
):
    """A grid of per-run values (cells[i][j]: one value per run): colour by the mean, text the mean
    and, with several runs, ± their sample standard deviation; rows and columns labelled. Text is
    dark where the colour is light (viridis above 60%; a diverging map in its middle)."""
    stats = [[(float(np.mean(v)), mean_std(v)[1] if len(v) > 1 else None) for v in r] for r in cells]
    mat = np.array([[m for m, _ in r] for r in stats])
    im = ax.imshow(mat, vmin=vmin, vmax=vmax, cmap=cmap, aspect="auto")
    for i in range(mat.shape[0]):
        for j in range(mat.shape[1]):
            m, sd = stats[i][j]
            text = spec.format(m) + ("" if sd is None else f"\n±{sd:.2f}")
            level = (m - vmin) / max(vmax - vmin, 1e-9)  # where the colour sits on its scale
            light = level >= 0.6 if vmin == 0 else 0.2 < level < 0.8  # viridis: light above; RdBu: mid
            ax.text(j, i, text, ha="center", va="center", fontsize=7, linespacing=0.9, color="k" if light else "w")
    ax.set_xticks(range(len(columns)), [str(c) for c in columns])
    ax.set_yticks(range(len(rows)), rows)
    return im
