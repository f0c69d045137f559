"""The figure scaffold (experiments/fig_*.py, default.py and the other result scripts), and the
one import a figure script needs: the public names of its parts are gathered here.

A figure script declares one `Figure`: a name (its results directory), its own arguments (the
names it picks from with `choices`, the KV budgets it sweeps with `budgets`, others by `arguments`), a `run`
(train and evaluate through a `Study`, return the numbers) and a `render` (numbers -> tables, PNGs,
caption); `Figure.main` is the whole command line: the common arguments (--config, --out,
--runs-dir, --seeds, --warm-starts, --eval-prompts, --smoke, --replot, key=value overrides),
pinning (workers.py), provenance and the outputs. `--replot <out>` re-renders results.md and the
PNGs from results.json and config.yaml alone, training and evaluating nothing.

Outputs: `<out>/results.md` (title, command, provenance, tables, figure, caption),
`results.json` (every number, the command and the provenance), `arms.json` (every run's resolved
config), `config.yaml` (the base config) and `<name>.png`.

The parts, one concern each:
- figruns.py: `Study` and `Run` (runs trained once into `<runs_dir>/<config hash>/`, shared by
  figures, resumed when interrupted; warm starts; parallel single-core workers), `summarize`,
  `scores`, `accuracies`, `run_variants`.
- figstats.py: the rules every table applies, declared once: `collapsed` and
  `reward_collapse_iteration` (collapse), `diff_se`, `tie_verdict`, `compare`, `compare_arms` and
  `comparison_lines` (is a difference a difference); `verdict_phrase` (counts -> a verdict); the
  tables (`md_table`, `stat_cells`, `arm_cells`, `per_warm_start_table`); `fmt` and `mean_std`.
  docs/reproducing.md states the rules in words.
- figplot.py: paper-column style (`COLUMN_W`, `TWO_COLUMN_W`, text >= `MIN_FONT_PT`, `panels`,
  `width_note`), one colour per arm (`ARM_COLOURS`, `arm_colours`) and per policy
  (`POLICY_COLOURS`), `curve`, `mean_curves`, `band`, `symlog_axis`, `ablation_figure`, `run_bars`,
  `heatmap`, `band_legend_below`, `run_title`, `save_figure`.
- figprov.py: `provenance` and the sentence results.md writes of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence

from experiments.lib import workers  # imports no JAX
from experiments.lib.figplot import (
    ARM_COLOURS,
    BAND_CAPTION,
    COLUMN_W,
    DPI,
    MIN_FONT_PT,
    PANEL_W,
    POLICY_COLOURS,
    TWO_COLUMN_W,
    ablation_figure,
    arm_colours,
    band,
    band_legend_below,
    check_print_size,
    clipped_err,
    config_name,
    curve,
    heatmap,
    iteration_axis,
    mean_curves,
    mean_line,
    panels,
    plt,
    run_bars,
    run_title,
    runs_phrase,
    save_figure,
    seeds_caption,
    sparse_curve,
    spread,
    symlog_axis,
    width_note,
)
from experiments.lib.figprov import PORTABLE_SINCE, command_line, cpu_model, provenance, provenance_line
from experiments.lib.figruns import (
    DEFAULT_CONFIG,
    DEFAULT_RUNS,
    EVAL_PROMPTS,
    FROM_WARM_START,
    HERE,
    REPO,
    RESULTS_EPOCH,
    SMOKE_OVERRIDES,
    Run,
    Study,
    accuracies,
    config_key,
    run_variants,
    scores,
    summarize,
    summarize_history,
    warm_rows,
)
from experiments.lib.figstats import (
    ACC_METRICS,
    COLLAPSE_FRACTION,
    COLLAPSE_HEADERS,
    COLLAPSE_NOTE,
    REWARD_WINDOW,
    TIE_NOTE,
    TIE_SE,
    VERDICT_NOTE,
    Claim,
    Column,
    Comparison,
    arm_cells,
    claim_cell,
    claims_table,
    collapse_cells,
    collapsed,
    compare,
    compare_arms,
    comparison_claim,
    comparison_lines,
    comparison_table,
    diff_se,
    fmt,
    headers,
    iteration_time,
    last_quarter,
    md_table,
    mean_std,
    per_warm_start_table,
    ratio_of_means,
    results_of,
    reward_collapse_iteration,
    run_mean,
    seconds_per_iteration,
    seed_collapse_cells,
    seed_rows,
    stat_cells,
    survival_claims,
    tie_verdict,
    unit_of,
    verdict_phrase,
    warm_dense_of,
    warm_note,
    warm_starts_of,
    with_reward_rule,
)
from sparserl_jax.config import TrainConfig, dump_config, load_config

# The figure library's public names: the scaffold's own and those of its parts.
__all__ = [
    # the scaffold
    "Figure",
    "Rendered",
    "write_results",
    "study_from_args",
    "smoke_overrides",
    "eval_prompts",
    "warms_of",
    "load_results",
    "default_out",
    "load_config",
    "dump_config",
    "TrainConfig",
    "workers",
    # runs (figruns)
    "HERE",
    "REPO",
    "DEFAULT_CONFIG",
    "DEFAULT_RUNS",
    "SMOKE_OVERRIDES",
    "FROM_WARM_START",
    "EVAL_PROMPTS",
    "RESULTS_EPOCH",
    "Run",
    "Study",
    "config_key",
    "summarize",
    "summarize_history",
    "scores",
    "accuracies",
    "warm_rows",
    "run_variants",
    # the rules and a table's numbers (figstats)
    "COLLAPSE_FRACTION",
    "REWARD_WINDOW",
    "COLLAPSE_NOTE",
    "TIE_SE",
    "TIE_NOTE",
    "collapsed",
    "reward_collapse_iteration",
    "collapse_cells",
    "with_reward_rule",
    "warm_note",
    "diff_se",
    "tie_verdict",
    "verdict_phrase",
    "VERDICT_NOTE",
    "Claim",
    "claim_cell",
    "comparison_claim",
    "survival_claims",
    "claims_table",
    "Comparison",
    "unit_of",
    "compare",
    "ACC_METRICS",
    "compare_arms",
    "comparison_lines",
    "comparison_table",
    "last_quarter",
    "run_mean",
    "warm_starts_of",
    "warm_dense_of",
    "results_of",
    "mean_std",
    "fmt",
    "ratio_of_means",
    "iteration_time",
    "seconds_per_iteration",
    # tables (figstats)
    "Column",
    "COLLAPSE_HEADERS",
    "md_table",
    "headers",
    "stat_cells",
    "arm_cells",
    "per_warm_start_table",
    "seed_rows",
    "seed_collapse_cells",
    # plotting (figplot)
    "PANEL_W",
    "COLUMN_W",
    "TWO_COLUMN_W",
    "MIN_FONT_PT",
    "ARM_COLOURS",
    "POLICY_COLOURS",
    "arm_colours",
    "check_print_size",
    "width_note",
    "DPI",
    "plt",
    "BAND_CAPTION",
    "seeds_caption",
    "band",
    "clipped_err",
    "config_name",
    "runs_phrase",
    "run_title",
    "symlog_axis",
    "ablation_figure",
    "band_legend_below",
    "curve",
    "mean_line",
    "mean_curves",
    "sparse_curve",
    "spread",
    "run_bars",
    "heatmap",
    "panels",
    "iteration_axis",
    "save_figure",
    # provenance (figprov)
    "PORTABLE_SINCE",
    "command_line",
    "cpu_model",
    "provenance",
    "provenance_line",
]


@dataclasses.dataclass
class Rendered:
    """A figure's render: results.md's title and body (tables, notes), its figures by file stem
    (the first is the main one, shown under the body with `caption`; the body shows the others)."""

    title: str
    markdown: str
    figures: dict
    caption: str = ""


@dataclasses.dataclass
class Figure:
    """One result script. `run(args, study)` trains and evaluates (study is None when
    `trains=False`) and returns the numbers (JSON-able); `render(data, base, command)` turns them
    into a Rendered, from a fresh run or from a committed results.json (--replot)."""

    name: str  # results directory: experiments/results/<name>[/<config stem>]
    doc: str
    run: Callable[[argparse.Namespace, Study | None], dict]
    render: Callable[[dict, TrainConfig | None, str], Rendered]
    arguments: Callable[[argparse.ArgumentParser], None] | None = None
    choices: dict[str, Sequence[str]] | None = None  # e.g. {"--variants": VARIANTS}: names to pick (default all)
    budgets: Sequence[int] | None = None  # --budgets default: the KV budgets swept
    seeds: Sequence[int] | None = (0,)  # --seeds default; None: the script has no seeds
    seeds_help: str = "train.seed of the RL runs (on every warm start)"
    warm_starts: Sequence[int] | None = None  # --warm-starts default; None: warm start 0 only
    trains: bool = True  # --config, --runs-dir, overrides, a Study
    eval_prompts: bool = True  # --eval-prompts
    replot: bool = True
    default_config: str = DEFAULT_CONFIG
    runs_dir: str = DEFAULT_RUNS  # --runs-dir default: the run cache
    fresh_runs: bool = False  # runs in <out>/runs, cleared first, unless --runs-dir names a cache
    smoke: Sequence[str] | None = None  # --smoke's overrides (None: smoke_overrides(config))
    defaults: Sequence[str] = ()  # the script's own overrides of its config (before --smoke's and the command line's)
    # inputs read from the results directory beside results.json (e.g. replicates from other
    # machines): given to render inside its data, never written into results.json
    beside: Callable[[str], dict] | None = None

    def parser(self) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(
            description=self.doc.split("\n")[0], epilog=self.doc, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        if self.replot:
            p.add_argument(
                "--replot",
                metavar="DIR",
                help="re-render the PNG(s) and results.md of a "
                "results directory from its results.json and config.yaml (no training)",
            )
        p.add_argument(
            "--out",
            help="output directory (default experiments/results/<figure>, or "
            "<figure>/<config stem> for another --config)",
        )
        p.add_argument("--smoke", action="store_true", help="a seconds-long run (tests)")
        if self.seeds is not None:
            p.add_argument("--seeds", type=int, nargs="+", default=list(self.seeds), help=self.seeds_help)
        if self.warm_starts is not None:
            p.add_argument(
                "--warm-starts",
                type=int,
                nargs="+",
                default=list(self.warm_starts),
                help="SFT seeds of the warm starts every arm is trained from",
            )
        if self.trains:
            p.add_argument("--config", default=self.default_config, help="the base YAML config")
            p.add_argument(
                "--runs-dir",
                default=None if self.fresh_runs else self.runs_dir,
                help="cache of training runs, shared by figures"
                + (" (default: <out>/runs, cleared first)" if self.fresh_runs else ""),
            )
            if self.eval_prompts:
                p.add_argument(
                    "--eval-prompts",
                    type=int,
                    help=f"held-out prompts of the final "
                    f"evaluations (default: at least {EVAL_PROMPTS}; train.eval_prompts "
                    "with --smoke)",
                )
            p.add_argument(
                "overrides", nargs="*", help="key=value settings applied to every run (after --smoke's: they win)"
            )
        for option, names in (self.choices or {}).items():
            p.add_argument(option, nargs="+", default=list(names), choices=list(names))
        if self.budgets is not None:
            p.add_argument("--budgets", type=int, nargs="+", default=list(self.budgets))
        if self.arguments:
            self.arguments(p)
        return p

    def main(self, argv=None) -> dict:
        args = self.parser().parse_args(argv)
        if getattr(args, "replot", None):
            data, base = load_results(args.replot, self.trains, self.default_config)
            self.write(args.replot, data, base, replot=True)
            return data
        t0 = time.perf_counter()
        cores = workers.available_cores()  # before this process pins itself to the first
        command = command_line(cores)
        args.out = args.out or default_out(self.name, getattr(args, "config", self.default_config), self.default_config)
        if self.fresh_runs and args.runs_dir is None:
            args.runs_dir = os.path.join(args.out, "runs")
            shutil.rmtree(args.runs_dir, ignore_errors=True)
        study = study_from_args(args, cores, self.smoke, self.defaults) if self.trains else None
        start = provenance(cores, None)  # the commit and tree at the start of the run (after pinning)
        data = self.run(args, study)
        data = {
            "command": command,
            **data,
            "provenance": {
                **start,
                "wall_s": round(time.perf_counter() - t0, 1),
                "arms_json": bool(study and study.arms),
            },
        }
        self.write(args.out, data, study.base if study else None, study)
        return data

    def write(self, out: str, data: dict, base, study: Study | None = None, replot: bool = False) -> None:
        """results.md and the PNGs (and, unless `replot`, results.json, arms.json, config.yaml)."""
        shown = {**data, **self.beside(out)} if self.beside else data
        write_results(out, self.render(shown, base, data["command"]), data, study, replot)


def write_results(out: str, r: Rendered, data: dict, study: Study | None = None, replot: bool = False) -> None:
    """results.md (title, command, provenance, body, main figure, caption) and every PNG of `r`;
    unless `replot`, also results.json (`data`), and with a study arms.json and config.yaml, those
    first: a figure the print check refuses (figplot.check_print_size) loses no result."""
    os.makedirs(out, exist_ok=True)
    if not replot:
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(data, f, indent=1, default=float)
        if study is not None:
            dump_config(study.base, os.path.join(out, "config.yaml"))
        if study is not None and study.arms:
            with open(os.path.join(out, "arms.json"), "w") as f:
                json.dump(
                    {"config": os.path.relpath(study.config, REPO), "overrides": study.overrides, "arms": study.arms},
                    f,
                    indent=1,
                )
    prov = provenance_line(data, os.path.join(out, "results.json") if replot else None)
    main = next(iter(r.figures), None)
    command = f"`{data['command']}`"
    if "command_today" in data:  # a recorded command that now runs something else: the one that reproduces it
        command = f"`{data['command_today']}` ({data['command_note']})"
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(f"# {r.title}\n\nCommand: {command}\n\n{prov}\n\n{r.markdown}\n")
        if main:
            f.write(f"\n![{main}]({main}.png)\n")
        if r.caption:
            f.write(f"\n{r.caption}\n")
        if width_note(r.figures):
            f.write(f"\n{width_note(r.figures)}\n")
    for name, fig in r.figures.items():
        save_figure(out, fig, name)
    print(r.markdown)


def study_from_args(
    args, cores: list[int] | None = None, smoke: Sequence[str] | None = None, defaults: Sequence[str] = ()
) -> Study:
    """The study of a figure script's arguments: the base config with the script's `defaults`,
    then, under --smoke, `smoke` (default smoke_overrides), then the command line's key=value
    overrides (which win). Pins
    this process to one core first (before any JAX computation; workers.py) so its evaluations,
    like its workers' runs, are the same on any machine; the workers get every core the command
    may use (`cores`, counted before pinning)."""
    if getattr(args, "replot", None):
        raise ValueError("--replot re-renders committed results: it trains nothing")
    cores = workers.available_cores() if cores is None else cores
    workers.pin_to_one_core()
    if not args.smoke:
        smoke = []
    elif smoke is None:
        smoke = smoke_overrides(args.config, args.overrides)
    return Study(args.config, [*defaults, *smoke, *args.overrides], args.runs_dir, cores=cores)


def smoke_overrides(config: str, overrides: Sequence[str] = ()) -> list[str]:
    """SMOKE_OVERRIDES, plus a 2-step SFT curriculum where the config has one."""
    has_curriculum = load_config([config], list(overrides)).sft.curriculum.steps > 0
    return list(SMOKE_OVERRIDES) + (["sft.curriculum.steps=2"] if has_curriculum else [])


def eval_prompts(args, study: Study) -> int:
    """The final evaluations' prompt count: --eval-prompts, else max(EVAL_PROMPTS,
    train.eval_prompts), else (--smoke) train.eval_prompts."""
    if getattr(args, "eval_prompts", None):
        return args.eval_prompts
    n = study.base.train.eval_prompts
    return n if args.smoke else max(EVAL_PROMPTS, n)


def warms_of(args) -> list[int]:
    """--warm-starts, or [0] for a script without it."""
    return list(getattr(args, "warm_starts", None) or [0])


def load_results(
    out_dir: str, with_config: bool = True, default_config: str = DEFAULT_CONFIG
) -> tuple[dict, TrainConfig | None]:
    """A results directory's results.json and the base config it ran: its config.yaml, or (results
    that kept none) the --config of its command, else `default_config`."""
    with open(os.path.join(out_dir, "results.json")) as f:
        data = json.load(f)
    if not with_config:
        return data, None
    path = os.path.join(out_dir, "config.yaml")
    if not os.path.exists(path):
        words = data["command"].split()
        path = os.path.join(REPO, words[words.index("--config") + 1]) if "--config" in words else default_config
    return data, load_config([path])


def default_out(name: str, config: str = DEFAULT_CONFIG, default_config: str = DEFAULT_CONFIG) -> str:
    """experiments/results/<figure>, or .../<figure>/<config stem> for another base config (so
    a second regime never overwrites the first)."""
    out = os.path.join(HERE, "results", name)
    if os.path.abspath(config) == os.path.abspath(default_config):
        return out
    return os.path.join(out, os.path.splitext(os.path.basename(config))[0])
