"""The shared table, comparison and panel builders of the figure scaffold (experiments/lib/figstats.py,
figplot.py, figruns.py, figlib.Figure's choices and budgets) on crafted inputs whose cells,
verdicts and drawn marks are known; figures render off-screen (Agg) and train nothing."""

import numpy as np
import pytest

from experiments.lib import figlib

COLUMNS = (("acc", "dense_acc", ".3f"), ("saving", "train_kv_saving", ".1%"))


def _rows(accs, warm=0, its=None):
    return [
        {
            "dense_acc": a,
            "train_kv_saving": 0.5,
            "warm_start": warm,
            "seed": i,
            **({} if its is None else {"collapse_iteration": its[i]}),
        }
        for i, a in enumerate(accs)
    ]


def test_md_table_and_cells():
    rows = _rows([0.4, 0.6])
    table = figlib.md_table(["arm", *figlib.headers(COLUMNS)], [["a", *figlib.stat_cells(rows, COLUMNS)]])
    assert table == ["| arm | acc | saving |", "|---|---|---|", "| a | 0.500 ± 0.141 | 50.0% ± 0.0% |"]
    assert figlib.stat_cells(rows, (("x", "absent", ".3f"),), missing="—") == ["—"]
    # both collapse rules after the columns: 0.4 < 0.5 x 0.9 collapses, 0.6 does not; the reward rule at 7
    cells = figlib.arm_cells(_rows([0.4, 0.6], its=[7, None]), COLUMNS, {0: {"dense_acc": 0.9}})
    assert cells[2:] == ["1 of 2", "1 of 2 (at 7, -)"]
    assert figlib.arm_cells(rows, COLUMNS, {})[2] == "-"  # warm start not recorded: no accuracy-rule verdict


def test_seed_rows_and_their_collapse_cells():
    assert figlib.seed_rows({"acc": [0.1, 0.2], "skip": None}) == [{"seed": 0, "acc": 0.1}, {"seed": 1, "acc": 0.2}]
    assert figlib.seed_collapse_cells([0.1, 0.8], [3, None], 0.9) == ("1 of 2", "1 of 2 (at 3, -)")
    assert figlib.seed_collapse_cells([0.8], None, 0.9) == ("0 of 1", "-")  # no histories kept


def test_compare_arms_pairs_present_arms_on_every_metric():
    results = {"a": _rows([0.9, 0.92]), "b": _rows([0.2, 0.25]), "c": _rows([0.5, 0.5])}
    cs = figlib.compare_arms(results, [("a", "b"), ("a", "missing"), ("c", "a")], {"dense_acc": "dense"}, 512)
    assert [(c.a, c.b, c.metric) for c in cs] == [("a", "b", "dense"), ("c", "a", "dense")]
    assert [c.sign for c in cs] == [1, -1] and cs[0].verdict == "**a ahead**"
    np.testing.assert_allclose(cs[0].diffs, [0.7, 0.67])
    tie = figlib.compare_arms({"a": _rows([0.5]), "b": _rows([0.51])}, [("a", "b")], {"dense_acc": "d"}, 128)
    assert tie[0].sign == 0 and tie[0].verdict == "tie"
    lines = figlib.comparison_lines(cs, "Heading:")
    assert lines[:3] == ["", "Heading:", ""] and lines[-1] == figlib.TIE_NOTE
    assert any(line.startswith("| a - b | dense |") for line in lines)


def test_one_rule_turns_counts_into_a_verdict():
    """figlib.verdict_phrase: a verdict word only where the claim holds at every run (or at none);
    'k of n' without a word otherwise; Comparison.counts reads each pair by the tie rule."""
    assert figlib.verdict_phrase(6, 6) == "**supported** (6 of 6)"
    assert figlib.verdict_phrase(0, 6) == "**not supported** (0 of 6)"
    assert figlib.verdict_phrase(5, 6) == "5 of 6" and "supported" not in figlib.verdict_phrase(11, 12)
    assert figlib.verdict_phrase(1, 1, "ahead", "behind") == "**ahead** (1 of 1)"
    with pytest.raises(ValueError):
        figlib.verdict_phrase(7, 6)
    (c,) = figlib.compare("a", _rows([0.9, 0.5, 0.2]), "b", _rows([0.5, 0.5, 0.6]), "dense_acc", 512)
    assert c.outcomes() == [1, 0, -1] and c.counts() == (1, 1, 1) and c.sign == 0


def test_claims_read_at_every_run_per_warm_start_and_pooled():
    """figlib.claims_table: each claim's count of runs on each warm start and over every run, a verdict
    word only where all agree; survival by both collapse rules (the reward rule only where recorded);
    comparison claims from the tie rule's reading at each pair."""
    a = _rows([0.9, 0.2], warm=0, its=[None, 4]) + _rows([0.9, 0.9], warm=1, its=[None, None])
    b = _rows([0.5, 0.5], warm=0) + _rows([0.89, 0.5], warm=1)
    warms = {0: {"dense_acc": 0.8}, 1: {"dense_acc": 0.8}}
    acc, reward = figlib.survival_claims("a", a, warms)
    assert acc.outcomes == ["holds", "collapsed", "holds", "holds"]  # 0.2 < 0.5 x 0.8
    assert reward.cell(0) == "1 of 2; collapsed 1" and reward.cell(1) == "**supported** (2 of 2)"
    assert len(figlib.survival_claims("b", b, warms)) == 1  # no reward rule recorded: no such claim
    assert figlib.survival_claims("b", b, {}) == []  # no warm start recorded: no accuracy-rule claim either
    assert acc.cell(7) == "-"  # a warm start without runs of this claim
    (c,) = [x for x in figlib.compare("a", a, "b", b, "dense_acc", 512) if x.metric == "dense_acc"]
    ahead = figlib.comparison_claim("a ahead of b", c)
    assert ahead.units == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert ahead.outcomes == ["holds", "behind", "tie", "holds"]
    assert figlib.comparison_claim("a not behind b", c, (0, 1)).cell() == "3 of 4; behind 1"
    assert figlib.comparison_claim("a level with b", c, (0,)).cell(1) == "1 of 2; ahead 1"
    table = figlib.claims_table([acc, ahead])
    assert "| claim (rule) | warm start 0 | warm start 1 | every run |" in table
    assert "| a ahead of b | 1 of 2; behind 1 | 1 of 2; tie 1 | 2 of 4; behind 1; tie 1 |" in table
    assert (
        "| a does not collapse (accuracy rule) | 1 of 2; collapsed 1 | **supported** (2 of 2) | 3 of 4; collapsed 1 |"
        in table
    )
    one = figlib.claims_table([figlib.survival_claims("b", b[:2], warms)[0]])
    assert (
        "| claim (rule) | runs |" in one and "| b does not collapse (accuracy rule) | **supported** (2 of 2) |" in one
    )


def test_print_size_and_one_colour_per_arm():
    """figplot: a figure wider than two columns, or with text under MIN_FONT_PT, is refused; a
    figure wider than one column is declared two-column; every arm has its own colour."""
    fig = figlib.plt.figure(figsize=(figlib.COLUMN_W, 2))
    fig.text(0.5, 0.5, "seven", fontsize=figlib.MIN_FONT_PT)
    figlib.check_print_size(fig, "ok")  # one column, 7 pt: accepted, and no two-column note
    assert figlib.width_note({"ok": fig}) == ""
    fig = figlib.plt.figure(figsize=(figlib.COLUMN_W, 2))
    fig.text(0.5, 0.5, "six", fontsize=6)
    with pytest.raises(ValueError, match="6 pt"):
        figlib.check_print_size(fig, "small")
    fig = figlib.plt.figure(figsize=(figlib.TWO_COLUMN_W + 0.6, 2))
    with pytest.raises(ValueError, match="7.60 in wide"):
        figlib.check_print_size(fig, "wide")
    fig = figlib.plt.figure(figsize=(figlib.TWO_COLUMN_W, 2))
    note = figlib.width_note({"curves": fig})
    assert note.startswith("Two-column figure") and "curves.png (7.0 in)" in note
    figlib.plt.close("all")
    assert figlib.arm_colours(["dense", "none", "other"], {"none": "naive_sparse"}) == {
        "dense": "tab:blue",
        "none": "tab:red",
        "other": "black",
    }
    assert len(set(figlib.ARM_COLOURS.values())) == len(figlib.ARM_COLOURS)  # no two arms share one


def test_per_warm_start_table():
    warms = {0: {"dense_acc": 0.9, "sparse_acc": 0.2}, 1: {"dense_acc": 0.8, "sparse_acc": 0.3}}
    rows = [{**r, "sparse_acc": 0.1} for r in _rows([0.3], warm=0) + _rows([0.7], warm=1)]
    assert figlib.per_warm_start_table({"x": rows}, {0: warms[0]}) == []  # one warm start: no table
    table = figlib.per_warm_start_table({"x": rows}, warms)
    assert "| warm start (dense / sparse acc.) | x |" in table
    assert "| 0 (0.900 / 0.200) | 0.300 / 0.100 (1 of 1) |" in table  # 0.3 < 0.45: collapsed
    assert "| 1 (0.800 / 0.300) | 0.700 / 0.100 (0 of 1) |" in table


def test_results_of_ratio_and_iteration_time():
    hist = [{"reward/mean": r} for r in [0.8] * 5 + [0.1] * 10]
    warms, res = figlib.results_of(
        {"results": {"a": [{"dense_acc": 0.5}]}, "histories": {"a": [hist]}, "warm_start": {"dense_acc": 0.9}}
    )
    assert warms == {0: {"dense_acc": 0.9}} and res["a"][0]["collapse_iteration"] == 8
    assert figlib.ratio_of_means([0.4, 0.6], [1.0]) == 0.5
    # a zero denominator is floored at 1e-9 (1 / 1e-9 is one rounding from 1e9)
    assert figlib.ratio_of_means([1.0], [0.0]) == pytest.approx(1e9, rel=1e-15)
    history = [
        {"time/rollout_s": 9.0, "time/update_s": 1.0, "loss": 5.0},
        {"time/rollout_s": 2.0},
        {"time/rollout_s": 4.0},
    ]
    assert figlib.iteration_time(history[0]) == 10.0  # time/* phases only
    assert figlib.seconds_per_iteration(history) == 3.0  # the first (compiling) iteration left out
    assert figlib.seconds_per_iteration(history[:1]) == 10.0


def test_accuracies_evaluates_each_run_under_the_overrides():
    class FakeRun:
        def __init__(self, acc):
            self.acc, self.calls = acc, []

        def evaluate(self, kv, n=None):
            self.calls.append((dict(kv), n))
            return {"accuracy": self.acc}

    runs = [FakeRun(0.25), FakeRun(0.75)]
    assert figlib.accuracies(runs, {"policy": "none"}, 64) == [0.25, 0.75]
    assert runs[1].calls == [({"policy": "none"}, 64)]


def test_clipped_err_keeps_bars_inside_the_metric_range():
    below, above = figlib.clipped_err([0.05, 0.5, 0.97], [0.1, 0.1, 0.1], 0.0, 1.0)
    np.testing.assert_allclose(below, [0.05, 0.1, 0.1])
    np.testing.assert_allclose(above, [0.1, 0.1, 0.03])
    below, above = figlib.clipped_err([-0.2], [0.1], None)  # no floor: a full bar either side
    np.testing.assert_allclose([below[0], above[0]], [0.1, 0.1])


def test_heatmap_writes_mean_and_spread_per_cell():
    fig, ax = figlib.plt.subplots()
    im = figlib.heatmap(ax, [[[0.2, 0.4], [0.9]]], ["snapkv"], [16, 32], 0.0, 1.0, "viridis")
    texts = [t.get_text() for t in ax.texts]
    assert texts == ["0.30\n±0.14", "0.90"]  # one run: no spread
    np.testing.assert_allclose(im.get_array(), [[0.3, 0.9]])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["16", "32"]
    assert [t.get_color() for t in ax.texts] == ["w", "k"]  # dark text on the light end of viridis
    figlib.plt.close(fig)


def test_mean_curves_and_run_bars_labels():
    hist = lambda rs: [{"reward/mean": r} for r in rs]  # noqa: E731
    fig, axes = figlib.panels(1, 3.0)
    figlib.mean_curves(
        axes[0],
        {"two": [hist([0.1, 0.2]), hist([0.3, 0.4])], "one": [hist([0.5, 0.6])]},
        {"two": "C0", "one": "C1"},
        "reward/mean",
        0.0,
        1.0,
        one_run_dashed=True,
    )
    assert [line.get_linestyle() for line in axes[0].lines] == ["-", "--"]  # the one-run arm dashed
    assert len(axes[0].collections) == 1  # and without a band
    np.testing.assert_allclose(axes[0].lines[0].get_ydata(), [0.2, 0.3])
    means, _ = figlib.run_bars(
        axes[1],
        ["a", "b"],
        {"a": [1.0, 3.0], "b": [2.0]},
        {"a": "C0", "b": "C1"},
        horizontal=True,
        labels=["first", "second"],
    )
    np.testing.assert_allclose(means, [2.0, 2.0])
    assert [t.get_text() for t in axes[1].get_yticklabels()] == ["first", "second"]
    assert axes[1].yaxis_inverted()  # the first bar on top
    assert axes.shape == (2,)
    figlib.plt.close(fig)


def test_sparse_curve_keeps_only_the_iterations_every_run_logged():
    a = [{"eval/accuracy": 0.2}, {}, {"eval/accuracy": 0.4}]
    b = [{"eval/accuracy": 0.4}, {"eval/accuracy": 0.9}, {"eval/accuracy": 0.6}]
    x, m, s = figlib.sparse_curve([a, b], "eval/accuracy")
    assert list(x) == [1, 3]
    np.testing.assert_allclose(m, [0.3, 0.5])
    np.testing.assert_allclose(s, [np.sqrt(0.02), np.sqrt(0.02)])


def test_titles_and_captions():
    base = figlib.load_config([figlib.DEFAULT_CONFIG])
    cmd = "python experiments/figures/fig_c_policies.py --config experiments/configs/walk_key.yaml"
    title = figlib.run_title(base, cmd, [0, 1], "What", setting="budget 8", runs="2 seeds, 5 iterations")
    assert title == f"What\nwalk_key (task {base.data.task}), budget 8\n2 seeds, 5 iterations"
    assert f"{base.kv.policy} budget {base.kv.budget}" in figlib.run_title(base, cmd, [0])
    assert figlib.seeds_caption("Bars", [0, 1], "; x") == (
        "Bars: mean over seeds; error bars: ± one sample standard deviation over seeds, clipped at 0 "
        "(none with one seed; x). Seeds [0, 1]."
    )


def test_figure_choices_and_budgets_arguments():
    fig = figlib.Figure(
        "toy",
        "Toy.",
        lambda a, s: {},
        lambda d, b, c: None,
        seeds=(0,),
        choices={"--variants": {"a": 1, "b": 2}},
        budgets=(16, 32),
    )
    args = fig.parser().parse_args([])
    assert args.variants == ["a", "b"] and args.budgets == [16, 32]
    assert fig.parser().parse_args(["--variants", "b", "--budgets", "8"]).budgets == [8]
    with pytest.raises(SystemExit):
        fig.parser().parse_args(["--variants", "c"])  # not one of the variants
