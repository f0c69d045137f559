"""Every committed result says what produced it and prints at paper size: each results.md under
experiments/results names its command and, in every provenance sentence, the commit at the start
of the run, whether the tree was clean, the CPU model, the jax version, the cores and the wall time
(figprov.FIELDS; "not recorded" where unknown); each committed PNG is at most one column wide
(figplot.COLUMN_W, 3.5 in at its DPI) or named in its results.md's two-column declaration
(figplot.width_note) and has nothing cut off at its edges (no ink in its outermost pixels; figures
are saved through figplot.check_print_size, which refuses text past the edges). Files only: no
JAX, milliseconds."""

import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from experiments.lib import figplot, figprov

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "experiments" / "results"
MDS = sorted(RESULTS.rglob("results.md"))
PNGS = sorted(RESULTS.rglob("*.png"))
# each field's words in the provenance sentence (figprov._fields)
FIELD_WORDS = {
    "commit": r"\bcommit\b",
    "tree": r"\btree\b",
    "CPU": r"\bCPU\b",
    "jax": r"\bjax\b",
    "cores": r"\bcores\b",
    "wall time": r"\bwall time\b",
}


def missing_provenance(text: str) -> list[str]:
    """What a results.md's text lacks: its command line, a provenance sentence, and in each
    provenance sentence every field of figprov.FIELDS."""
    missing = [] if re.search(r"^Command: `[^`]+`", text, re.M) else ["command"]
    sentences = [line for line in text.splitlines() if "Provenance:" in line]
    if not sentences:
        return missing + ["provenance"]
    return missing + sorted(
        {
            field
            for line in sentences
            for field in figprov.FIELDS
            if not re.search(FIELD_WORDS[field], line.split("Provenance:", 1)[1])
        }
    )


def png_width_in(path: Path) -> float:
    """A PNG's print width in inches: its pixel width over the DPI it was saved at."""
    with Image.open(path) as im:
        return im.size[0] / float(im.info.get("dpi", (figplot.DPI,))[0])


def undeclared_wide(png: Path, results_md_text: str | None) -> bool:
    """A PNG wider than one column that its results.md does not declare a two-column figure."""
    if png_width_in(png) <= figplot.COLUMN_W + 0.01:
        return False
    declared = [line for line in (results_md_text or "").splitlines() if line.startswith("Two-column figure")]
    return not any(f"{png.name} (" in line for line in declared)


def ink_at_edges(path: Path, margin: int = 2) -> int:
    """Dark pixels within `margin` pixels of a PNG's edges: something drawn past the figure is cut
    off there (every figure has a white border: its layout keeps text and axes inside)."""
    with Image.open(path) as im:
        a = np.asarray(im.convert("L"))
    edges = np.concatenate([a[:, :margin].ravel(), a[:, -margin:].ravel(), a[:margin].ravel(), a[-margin:].ravel()])
    return int((edges < 200).sum())


def test_provenance_fields_are_figprovs():
    assert set(FIELD_WORDS) == set(figprov.FIELDS)


def test_a_library_from_another_checkout_is_named_beside_the_commit():
    """A study whose sparserl_jax package is imported from another worktree records that
    checkout's commit too (figprov.library_commit); in this checkout there is none to record."""
    assert figprov.library_commit() is None
    base = {"commit": "aaaa", "commit_at": "start", "uncommitted_changes": False, "cpu": "x", "jax": "0.10.2"}
    line = figprov.provenance_line({"provenance": {**base, "library_commit": "bbbb"}})
    assert "commit aaaa at the start of the run (its sparserl_jax package from commit bbbb)" in line
    assert "sparserl_jax package" not in figprov.provenance_line({"provenance": base})


@pytest.mark.parametrize("path", MDS, ids=[str(p.relative_to(RESULTS)) for p in MDS])
def test_every_results_md_says_what_produced_it(path):
    assert missing_provenance(path.read_text()) == []


@pytest.mark.parametrize("path", PNGS, ids=[str(p.relative_to(RESULTS)) for p in PNGS])
def test_every_figure_fits_one_column_or_is_declared_two_column(path):
    md = path.parent / "results.md"
    assert png_width_in(path) <= figplot.TWO_COLUMN_W + 0.01
    assert not undeclared_wide(path, md.read_text() if md.exists() else None)


@pytest.mark.parametrize("path", PNGS, ids=[str(p.relative_to(RESULTS)) for p in PNGS])
def test_no_committed_figure_is_cut_off_at_its_edges(path):
    assert ink_at_edges(path) == 0


def test_text_past_the_edges_is_refused_and_a_wide_legend_wraps(tmp_path):
    fig, ax = figplot.plt.subplots(figsize=(figplot.COLUMN_W, 3), layout="constrained")
    for i in range(6):
        ax.plot([0, 1], [i, i], label=f"a rather long label {i}")
    one_row = fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=6)
    fig.canvas.draw()
    assert len(figplot.cut_texts(fig)) >= 2
    fig.savefig(tmp_path / "cut.png", dpi=figplot.DPI)
    assert ink_at_edges(tmp_path / "cut.png") > 0
    with pytest.raises(ValueError, match="cut off"):
        figplot.check_print_size(fig, "cut")
    one_row.remove()
    figplot.band_legend_below(fig, ax)  # one row would not fit: fewer columns
    figplot.check_print_size(fig, "fits")
    fig.savefig(tmp_path / "fits.png", dpi=figplot.DPI)
    assert ink_at_edges(tmp_path / "fits.png") == 0
    fig.suptitle("a title far too long for one column " * 4)
    with pytest.raises(ValueError, match="cut off"):
        figplot.check_print_size(fig, "title")
    figplot.save_figure(str(tmp_path), fig, "title")  # wraps the suptitle to the figure's width
    assert ink_at_edges(tmp_path / "title.png") == 0


def test_the_checkers_find_what_is_missing(tmp_path):
    good = (
        "# T\n\nCommand: `python x.py`\n\nProvenance: commit abc at the start of the run; tree clean; "
        "CPU X; jax 0.10.2; cores 2; wall time 3 s.\n"
    )
    assert missing_provenance(good) == []
    assert missing_provenance(good.replace("jax 0.10.2; ", "")) == ["jax"]
    assert missing_provenance(good.replace("Command: `python x.py`", "")) == ["command"]
    assert missing_provenance("# T\n\nCommand: `python x.py`\n") == ["provenance"]
    # the sentence every committed result gets from figprov passes, recorded or not
    assert missing_provenance("Command: `c`\n\n" + figprov.provenance_line({}) + "\n") == []
    prov = {
        "commit": "abc",
        "uncommitted_changes": False,
        "portable_cpu": True,
        "cpu": "X",
        "jax": "1",
        "cores": 2,
        "wall_s": 3.0,
    }
    assert missing_provenance("Command: `c`\n\n" + figprov.provenance_line({"provenance": prov}) + "\n") == []
    wide, narrow = tmp_path / "wide.png", tmp_path / "narrow.png"
    for path, width in ((wide, 7.0), (narrow, 3.5)):
        fig = figplot.plt.figure(figsize=(width, 2))
        fig.savefig(path, dpi=figplot.DPI)
        figplot.plt.close(fig)
    assert abs(png_width_in(wide) - 7.0) < 0.01 and not undeclared_wide(narrow, None)
    assert undeclared_wide(wide, "Figure: a caption.\n")
    fig = figplot.plt.figure(figsize=(7.0, 2))
    assert not undeclared_wide(wide, f"Figure: a caption.\n\n{figplot.width_note({'wide': fig})}\n")
    figplot.plt.close(fig)


def test_the_commit_a_copy_was_made_from_comes_from_the_environment(monkeypatch, tmp_path):
    """A lent GPU machine receives the working tree with a .git that can be older than it (the
    session's start): SPARSERL_COMMIT names the commit the tree is, and then the tree is clean."""
    monkeypatch.delenv("SPARSERL_COMMIT", raising=False)
    here = figprov.commit()
    assert here and len(here) == 12
    monkeypatch.setenv("SPARSERL_COMMIT", "0123456789ab")
    assert figprov.commit() == "0123456789ab" and figprov.uncommitted_changes() is False
    monkeypatch.setattr(figprov, "REPO", str(tmp_path))  # a folder outside any checkout
    assert figprov.commit() == "0123456789ab"
    monkeypatch.delenv("SPARSERL_COMMIT")
    assert figprov.commit() is None and figprov.uncommitted_changes() is False


def test_a_commands_own_output_can_be_left_out_of_the_tree_state(monkeypatch, tmp_path):
    """tpu_compile.py rewrites its committed table as it goes: the tree state it records leaves that
    file out, and any other change still counts."""
    import subprocess

    monkeypatch.delenv("SPARSERL_COMMIT", raising=False)
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    for name in ("table.json", "code.py"):
        (tmp_path / name).write_text("0\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    monkeypatch.setattr(figprov, "REPO", str(tmp_path))
    assert figprov.uncommitted_changes() is False
    (tmp_path / "table.json").write_text("1\n")
    assert figprov.uncommitted_changes() is True
    assert figprov.uncommitted_changes(ignoring=(str(tmp_path / "table.json"),)) is False
    (tmp_path / "code.py").write_text("1\n")
    assert figprov.uncommitted_changes(ignoring=(str(tmp_path / "table.json"),)) is True
    # a table written outside the checkout (--out /tmp/...) leaves the tree's state as it is
    assert figprov.uncommitted_changes(ignoring=(str(tmp_path.parent / "elsewhere.json"),)) is True


def test_package_changes_counts_commits_to_the_package_between_two_commits():
    """A replay's note on code changes: 0 between a commit and itself, None for a commit git does not
    know; a library checkout's commit is the package's."""
    head = figprov.commit()
    assert figprov.package_changes(head, head) == 0
    assert figprov.package_changes("0000000deadbeef", head) is None and figprov.package_changes(None, head) is None
    assert figprov.package_commit({"commit": "abc", "library_commit": "def with uncommitted changes"}) == "def"
    assert figprov.package_commit({"commit": "abc"}) == "abc"
