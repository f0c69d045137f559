"""The figures' verdict tables state no verdict by hand: docs/reproducing.md's full table ("Every
figure's verdict") and the README's one-line table. Every verdict word either gives with a count
("**supported** (12 of 12)") is the one the shared rule (figlib.verdict_phrase) gives that count;
the counts of the default experiment's row and figures a, b, d and e's R-KV rows are those their
committed results.json files give (each figure's claims; the default's pooled over its replicates
on other machines); the real-model collapse rows' words are the plan's rules on their
results.json; and every count and verdict word of a README row is its full row's (the row with the
same results link). Nothing is trained."""

import json
import re
from pathlib import Path

import pytest

from experiments.figures import fig_b_budget, fig_d_corrections, fig_e_robustness
from experiments.lib import curves as fig_a_curves
from experiments.lib import default_experiment, figlib, figstats
from experiments.real import collapse as real_collapse

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "experiments" / "results"
VERDICT = re.compile(r"\*\*(supported|not supported|refuted|tie)\*\* \((\d+) of (\d+)\b")


FULL = REPO / "docs" / "reproducing.md"
COUNT = re.compile(r"(?:\*\*[a-z ]+\*\* \()?\d+ of \d+")
LINK = re.compile(r"\]\((?:\.\./)?([^)#]+)")


def table_cells(text: str, heading: str) -> list[list[str]]:
    """The rows (cells) of the first table under `heading`, its header row left out."""
    table = text.split(heading, 1)[1].split("\n## ", 1)[0]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("| ")]
    return [c for c in cells[1:] if len(c) >= 2]


def figure_rows(text: str, heading: str = "## Every figure's verdict") -> dict[str, str]:
    """A figures table: each row's first cell -> its verdict cell."""
    return {c[0]: c[1] for c in table_cells(text, heading)}


def by_link(text: str, heading: str) -> dict[str, str]:
    """A figures table's verdict cells by the first file its results cell links (repo-relative)."""
    out = {}
    for c in table_cells(text, heading):
        target = LINK.search(c[2]).group(1)
        out[target[len("docs/") :] if target.startswith("docs/") else target] = c[1]
    return out


def wrong_words(cell: str) -> list[str]:
    """The verdict words of a cell that the shared rule does not give their count."""
    return [
        m.group(0)
        for m in VERDICT.finditer(cell)
        if not figlib.verdict_phrase(int(m.group(2)), int(m.group(3))).startswith(f"**{m.group(1)}**")
    ]


def row(rows: dict[str, str], start: str) -> str:
    (cell,) = [v for k, v in rows.items() if k.startswith(start)]
    return cell


def claims_of(data: dict) -> dict[str, tuple[int, int]]:
    """A figure a / default result's claims (fig_a_curves.claims): claim -> (runs where it holds, runs)."""
    return {claim: (k, n) for claim, k, n, _ in fig_a_curves.claims(data, data["eval_prompts"])}


@pytest.fixture(scope="module")
def rows():
    return figure_rows(FULL.read_text())


def test_every_verdict_word_is_the_rules(rows):
    readme = figure_rows((REPO / "README.md").read_text(), "## Figures")
    assert rows and readme and all(wrong_words(cell) == [] for cell in [*rows.values(), *readme.values()])


def test_every_readme_count_is_its_full_rows():
    """A README row quotes only counts and verdicts its full row gives (which the tests below
    recompute from results.json)."""
    readme = by_link((REPO / "README.md").read_text(), "## Figures")
    full = by_link(FULL.read_text(), "## Every figure's verdict")
    full = {k.replace("../", ""): v for k, v in full.items()}
    assert len(readme) >= 15 and set(readme) <= set(full), sorted(set(readme) - set(full))
    stray = {k: [c for c in COUNT.findall(cell) if c not in full[k]] for k, cell in readme.items()}
    assert {k: v for k, v in stray.items() if v} == {}


def test_the_default_rows_counts_are_its_results_pooled_over_machines(rows):
    out = str(RESULTS / "default")
    data, _ = figlib.load_results(out, False)
    machines = [data, *default_experiment.replicates(out).get("replicates", {}).values()]
    read = [claims_of(d) for d in machines]
    pooled = {claim: tuple(map(sum, zip(*(r[claim] for r in read)))) for claim in read[0]}
    cell = row(rows, "default experiment")
    k, n = pooled["naive sparse collapses (accuracy rule)"]
    assert f"naive sparse collapses on {k} of {n} runs by the accuracy rule" in cell
    k, n = pooled["naive sparse collapses (reward rule, beside it)"]
    assert f"reward rule {k} of {n}" in cell
    k, n = pooled["Sparse-RL not behind naive sparse, dense inference (tie rule at each run)"]
    assert f"Sparse-RL at or above naive (tie rule per run): {figlib.verdict_phrase(k, n)[:-1]}" in cell
    k, n = pooled["Sparse-RL level with dense, dense inference (a tie at each run)"]
    assert f"Sparse-RL level with dense (the paper: ~97%, stable): {figlib.verdict_phrase(k, n)} runs" in cell
    assert [k for k in rows if k.startswith("default experiment")][0].count(f"each of {len(machines)} machines") == 1


@pytest.mark.parametrize(
    "start, config", [("a. training curves, SnapKV@48", "walk_key"), ("a. training curves, R-KV@48", "walk_key_rkv")]
)
def test_figure_a_rows_counts_are_its_results(rows, start, config):
    cell = row(rows, start)
    claims = claims_of(json.loads((RESULTS / "fig_a_curves" / config / "results.json").read_text()))
    k, n = claims["naive sparse behind dense, dense inference (tie rule at each run)"]
    assert f"naive behind dense {figlib.verdict_phrase(k, n)}" in cell
    k, n = claims["naive sparse collapses (accuracy rule)"]
    assert f"naive collapses on {k} of {n} by the accuracy rule" in cell
    k, n = claims["Sparse-RL level with dense, dense inference (a tie at each run)"]
    phrase = figlib.verdict_phrase(k, n)[:-1]  # '(k of n' then the cell's own detail
    assert f"Sparse-RL level with dense {phrase if '**' in phrase else 'on ' + phrase}" in cell


@pytest.mark.parametrize(
    "start, setting",
    [
        ("Sparse-RL's collapse claim on SmolLM2-135M: dense / R-KV@64", "rkv64"),
        ("Sparse-RL's collapse claim on SmolLM2-135M, the plan's second setting", "rkv48"),
        ("Sparse-RL's collapse claim on SmolLM2-135M where the eviction cannot be escaped", "rkv48q"),
        ("Sparse-RL's collapse claim on SmolLM2-135M, budget 32 with the question compressed at prefill", "rkv32q"),
    ],
)
def test_the_real_model_collapse_rows_give_the_plans_verdicts(rows, start, setting):
    """Each setting's row states the verdicts its results.json gives by the plan's rules
    (real_collapse.verdicts): the collapse claim's word first, then Sparse-RL's."""
    data, _ = figlib.load_results(str(RESULTS / "real" / "collapse" / setting), False)
    assert data["recorded_runs"] == data["planned_runs"]
    lines, _ = real_collapse.verdicts(data)
    words = [re.search(r"\*\*([a-z ]+)\*\*", line).group(1) for line in lines[2:4]]
    assert re.findall(r"\*\*(supported|not supported|refuted|open|no verdict)\*\*", row(rows, start))[:2] == words


def reading(claim) -> str:
    """The shared rule's reading of a claim over every run: figlib.verdict_phrase of its counts."""
    return figlib.verdict_phrase(claim.outcomes.count(figstats.HOLDS), len(claim.outcomes))


def phrases(claims) -> dict[str, str]:
    """Each claim's text -> its reading."""
    return {c.text: reading(c) for c in claims}


def group(header: str, labelled) -> str:
    """The README's form of a row of claims: 'header: label phrase, label phrase'."""
    return f"{header}: " + ", ".join(f"{label} {phrase}" for label, phrase in labelled)


def test_figure_b_rows_counts_are_its_results(rows):
    data = json.loads((RESULTS / "fig_b_budget" / "walk_key_rkv" / "results.json").read_text())
    warms, results = figlib.results_of(data)
    said = phrases(fig_b_budget.claims(results, warms, data["budgets"], data["mode"], data["eval_prompts"]))
    cell = row(rows, "b. KV budgets, R-KV, 3 warm starts")
    for header, claim in (
        (
            "not behind dense-trained under dense inference",
            "{m}@{b} not behind dense-trained, dense inference (tie rule at each run)",
        ),
        (
            "under sparse inference at B",
            "{m}@{b} not behind dense-trained, sparse inference at {b} (tie rule at each run)",
        ),
        ("does not collapse by the accuracy rule", "{m}@{b} does not collapse (accuracy rule)"),
        ("by the reward rule", "{m}@{b} does not collapse (reward rule, beside it)"),
    ):
        labelled = [(f"B={b}", said[claim.format(m=data["mode"], b=b)]) for b in data["budgets"]]
        assert group(header, labelled) in cell


def test_figure_d_rows_counts_are_its_results(rows):
    data = json.loads((RESULTS / "fig_d_corrections" / "walk_key_rkv" / "results.json").read_text())
    warms, results = figlib.results_of(data)
    said = phrases(fig_d_corrections.claims(results, warms, data["eval_prompts"]))
    label = fig_d_corrections.LABELS
    short = {"none": "none", "sars_only": "SARS only", "ibr_only": "IBR only", "both": "both"}
    cell = row(rows, "d. corrections, R-KV@48, 3 warm starts")
    ahead = [
        (short[v], said[f"{label[v]} ahead of {label['none']}, dense inference (tie rule at each run)"])
        for v in ("both", "sars_only", "ibr_only")
    ]
    assert group("Ahead of none under dense inference", ahead) in cell
    level = [
        (short[v], said[f"{label['both']} not behind {label[v]}, dense inference (tie rule at each run)"])
        for v in ("sars_only", "ibr_only")
    ]
    assert group("both not behind, dense inference", level) in cell
    for header, rule in (
        ("does not collapse by the accuracy rule", "accuracy rule"),
        ("by the reward rule", "reward rule, beside it"),
    ):
        alive = [(short[v], said[f"{label[v]} does not collapse ({rule})"]) for v in short]
        assert group(header, alive) in cell


def test_figure_e_rows_counts_are_its_results(rows):
    data = json.loads((RESULTS / "fig_e_robustness" / "walk_key_rkv" / "results.json").read_text())
    columns = ["dense"] + [f"{p}@{b}" for p in data["policies"] for b in data["budgets"]]
    claims = dict(zip(columns, fig_e_robustness.claims(data, columns, data["eval_prompts"])))
    said = {col: reading(c) for col, c in claims.items()}
    holds = {col: c.outcomes.count(figstats.HOLDS) for col, c in claims.items()}
    cell = row(rows, "e. robustness to sparse inference, R-KV")
    head = "Sparse-RL-trained ahead of dense-trained, per cell over the 6 run pairs"
    assert f"{head}: dense inference {said['dense']}, its own rkv@48 {said['rkv@48']}" in cell
    sparse = columns[1:]
    assert f"0 of 6 in {sum(holds[c] == 0 for c in sparse)} of the {len(sparse)} sparse cells" in cell
    assert (
        f"at most {max(holds[c] for c in sparse)} of 6 in the others (h2o@32 {said['h2o@32']}, rkv@32 {said['rkv@32']})"
        in cell
    )
    ratio = {k: f"{v:.0%}" for k, v in data["retained_sparse_over_dense"].items()}
    assert (
        f"warm start {ratio['warm start']}, dense-trained {ratio['dense-trained']}, "
        f"Sparse-RL-trained {ratio['sparse_rl-trained']}"
    ) in cell


def test_the_checker_finds_a_word_typed_by_hand():
    assert wrong_words("naive collapse **supported** (5 of 6 by both rules)") == ["**supported** (5 of 6"]
    assert wrong_words("**not supported** (1 of 6)") == ["**not supported** (1 of 6"]
    assert wrong_words("**supported** (6 of 6), **not supported** (0 of 3), 4 of 6") == []
