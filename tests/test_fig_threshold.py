"""experiments/figures/fig_threshold.py: the declared threshold test on synthetic runs, and the committed
result recomputed from the committed results.json files it reads."""

import json
import os

from experiments.figures import fig_threshold as F


def _pt(x, reading, k3=0.1):
    return {"x": x, "reading": reading, "k3": k3}


def test_the_lowest_threshold_with_every_run_above_it_level_and_two_below():
    pts = [_pt(0.90, -1), _pt(0.92, -1), _pt(0.95, 0), _pt(0.97, 1), _pt(0.99, 0)]
    res = F.threshold(pts)
    assert res["threshold"] == (0.92 + 0.95) / 2 and res["below"] == 2 and res["behind_below"] == 2
    # a run behind above every candidate: none holds
    assert F.threshold(pts + [_pt(0.999, -1)])["threshold"] is None
    # one run below is too few
    assert F.threshold([_pt(0.9, -1), _pt(0.95, 0)])["threshold"] is None
    assert "no run is behind" in F.outcome(F.threshold([_pt(0.9, 0), _pt(0.95, 1)]))
    # the post-hoc reading of k3 names both sides
    assert "separates" in F.post_hoc([_pt(0.9, -1, 0.2), _pt(0.95, 0, 0.01)])
    assert "does not separate" in F.post_hoc([_pt(0.9, -1, 0.01), _pt(0.95, 0, 0.2)])


def test_the_committed_result_is_what_the_sources_give():
    with open(os.path.join(F.RESULTS, "fig_threshold", "results.json")) as f:
        committed = json.load(f)
    pts = F.all_points(F.available())
    assert pts == committed["points"]
    assert {k: committed[k] for k in F.threshold(pts)} == F.threshold(pts)
