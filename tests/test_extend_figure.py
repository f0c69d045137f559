"""Adding a figure, walked through once as docs/layout.md ("How to extend") says, with a toy
"reward_by_seed" figure (the train reward of a dense RL arm per seed, with a collapse column):

1. its script, experiments/fig_reward_by_seed.py in real use (here in this test): a docstring,
   `run(args, study)` (trains through the study, returns the numbers), `render(data, base,
   command)` (numbers -> figlib.Rendered: title, table, figure, caption), and
   `FIGURE = figlib.Figure("<name>", __doc__, run, render, ...)`, `main = FIGURE.main`;
2. nothing else: Figure.main brings the arguments (--smoke, --seeds, --out, --runs-dir, --replot,
   overrides), the study, the provenance and the outputs.

Run with --smoke on the smoke config it writes results.md (with the command and its provenance),
results.json, arms.json, config.yaml and the PNG; --replot re-renders results.md and the PNG from
results.json and config.yaml alone, byte for byte, training nothing."""

import json
import re

import jax
import pytest
from compile_cache import compile_cache_in_process

from experiments.lib import figlib

jax.devices()  # the backend runs: the runs train in this process (no worker start-up)

# ----------------------------------------------------------------------------- 1. the script

DOC = """Figure reward_by_seed (toy): the train reward of a dense RL arm from warm start 0, per seed.

  python experiments/fig_reward_by_seed.py --seeds 0 1 2
"""


def run(args, study) -> dict:
    runs = {s: study.arm(f"dense/seed{s}", mode="dense", policy="none", seed=s) for s in args.seeds}
    warm = study.warm_start("none").evaluate({"policy": "none"})["accuracy"]
    return {
        "seeds": list(args.seeds),
        "warm_start": {"dense_acc": warm},
        "rows": [
            {"seed": s, "dense_acc": r.evaluate({"policy": "none"})["accuracy"], **figlib.summarize(r)}
            for s, r in runs.items()
        ],
        "histories": [r.history for r in runs.values()],
    }


def render(data: dict, base, command: str) -> figlib.Rendered:
    rows, seeds = data["rows"], data["seeds"]
    acc_rule, reward_rule = figlib.collapse_cells(rows, [data["warm_start"]["dense_acc"]] * len(rows))
    lines = [
        "| arm | accuracy | train reward (last 25%) | collapsed (accuracy rule) | collapsed (reward rule) |",
        "|---|---|---|---|---|",
        f"| dense | {figlib.fmt([r['dense_acc'] for r in rows])} | "
        f"{figlib.fmt([r['train_reward_last25'] for r in rows])} | {acc_rule} | {reward_rule} |",
        "",
        figlib.COLLAPSE_NOTE,
    ]
    fig, ax = figlib.plt.subplots(figsize=(figlib.PANEL_W, 2.8), layout="constrained")
    x, m, s = figlib.curve(data["histories"], "reward/mean")
    ax.plot(x, m, color="C0", label="dense")
    figlib.band(ax, x, m, s, "C0", 0.0, 1.0)
    ax.set(xlabel="iteration", ylabel="train reward\n(mean per rollout)")
    fig.suptitle(figlib.run_title(base, command, seeds, "Toy: dense RL from warm start 0"))
    caption = f"Figure: the train reward per iteration. {figlib.BAND_CAPTION} Seeds {seeds}."
    return figlib.Rendered("Figure reward_by_seed (toy)", "\n".join(lines), {"reward_by_seed": fig}, caption)


FIGURE = figlib.Figure("reward_by_seed", DOC, run, render, seeds=(0, 1, 2))
main = FIGURE.main


# ----------------------------------------------------------------------------- the walk-through


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(tmp_path_factory):
    with compile_cache_in_process(tmp_path_factory):
        yield


@pytest.mark.slow
@pytest.mark.extended  # docs/layout.md's "How to extend" toy figure: figure a's scaffold and the figures' replot
def test_a_toy_figure_runs_writes_its_outputs_and_replots(tmp_path):
    out = tmp_path / "out"
    data = main(["--smoke", "--seeds", "0", "--out", str(out), "--runs-dir", str(tmp_path / "runs")])
    (row,) = data["rows"]
    assert row["seed"] == 0 and 0.0 <= row["dense_acc"] <= 1.0 and len(data["histories"][0]) == 2

    for name in ("results.md", "results.json", "arms.json", "config.yaml", "reward_by_seed.png"):
        assert (out / name).stat().st_size > 0, name
    saved = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    same = lambda a, b: json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # noqa: E731 (NaN-safe)
    assert same(saved["rows"], data["rows"]) and re.match(r"(taskset -c [\d,]+ )?python ", saved["command"])
    prov = saved["provenance"]
    assert prov["jax"] == jax.__version__ and prov["cpu"] and prov["arms_json"] is True
    assert md.startswith("# Figure reward_by_seed (toy)\n") and f"Command: `{saved['command']}`" in md
    assert f"Provenance: commit {prov['commit']}" in md and "[arms.json](arms.json)" in md
    assert "| dense | " in md and "![reward_by_seed](reward_by_seed.png)" in md and "Figure: the train" in md
    arms = json.loads((out / "arms.json").read_text())["arms"]
    assert set(arms) == {"warm_start0/sft", "dense/seed0", "warm_start"}  # every run the study returned
    assert arms["dense/seed0"]["config"]["train"]["iterations"] == 2  # the smoke config
    assert arms["dense/seed0"]["config"]["model"]["init_from"].endswith(arms["warm_start0/sft"]["run"])

    png = (out / "reward_by_seed.png").read_bytes()
    (out / "results.md").unlink()
    (out / "reward_by_seed.png").unlink()
    replotted = main(["--replot", str(out)])  # from results.json and config.yaml: no training
    assert same(replotted, saved)
    assert (out / "results.md").read_text() == md and (out / "reward_by_seed.png").read_bytes() == png
    assert same(json.loads((out / "results.json").read_text()), saved)
