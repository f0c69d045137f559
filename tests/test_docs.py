"""README.md and docs/*.md: every relative link resolves (file, and heading for #anchors, GitHub's
slug rules), every command names a script, module and --config file that exist, and every script
they name is run by a test or has a committed results.md. The code (sources, docstrings, configs,
tests) cites docs by their path in the repository: every docs/<file>.md it names exists, with
every #heading it names, and the method notes are cited as docs/methods.md. No JAX: milliseconds."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Scripts the docs name that neither a test nor a committed results.md runs, and why.
NOT_RUN = {"experiments/bench/bench_kernel.py": "needs a GPU or TPU (pending a GPU session)"}

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# Files that cite docs: the package, the kernels, the experiments and their configs, the tests.
CODE = sorted(
    {
        *REPO.glob("sparserl_jax/**/*.py"),
        *REPO.glob("kernels/**/*.py"),
        *REPO.glob("experiments/**/*.py"),
        *REPO.glob("experiments/configs/**/*.yaml"),
        *REPO.glob("tests/*.py"),
        REPO / "setup.py",
    }
    - {Path(__file__).resolve()}
)
# docs/<file>.md, then its anchors: "#a", "#a, #b", "#a and #b" (a line may break between them)
CITATION = re.compile(
    r"(?<![\w/.-])docs/([\w.-]+\.md)"
    r"((?:#[\w-]+)?(?:(?:,\s*|\s+and\s+|\s+or\s+)#[\w-]+)*)"
)
BARE_METHODS = re.compile(r"(?<![\w.-])(?<!docs/)methods\.md")  # ../shared/methods.md, methods.md
SCRIPT = re.compile(r"\bpython3? +((?:experiments|tests)/[\w/.-]+\.py)")
MODULE = re.compile(r"\bpython3? +-m +(sparserl_jax(?:\.\w+)*)")
CONFIG = re.compile(r"--config[ =]+(\S+\.ya?ml)")
ASSIGN = re.compile(r"^(\w+)=(\S+)\s*$", re.M)


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not - or _), spaces -> -."""
    text = re.sub(r"[*_`]{1,2}(?=\S)|(?<=\S)[*_`]{1,2}", "", heading.strip())  # emphasis markers
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor, duplicates numbered -1, -2 ... as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6} +(.+?) *#*$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), re.M):
        s = slug(m.group(1))
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def broken_links(doc: Path, text: str | None = None) -> list[str]:
    """The relative links of `doc` (or of `text` read as if it were at `doc`) that do not resolve."""
    text = doc.read_text() if text is None else text
    bad = []
    for target in LINK.findall(_prose(text)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{target}: no file {dest}")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest.read_text())):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    return bad


def broken_citations(text: str) -> list[str]:
    """The docs/<file>.md paths (and #anchors) cited in `text` that do not exist, and any mention of
    the method notes that is not their path in the repository."""
    bad = []
    for name, tail in CITATION.findall(text):
        doc = REPO / "docs" / name
        if not doc.is_file():
            bad.append(f"docs/{name}: no such file")
            continue
        heads = anchors(doc.read_text())
        bad += [f"docs/{name}#{a}: no such heading" for a in re.findall(r"#([\w-]+)", tail) if a not in heads]
    return bad + [f"{m.group(0)} (cite docs/methods.md)" for m in BARE_METHODS.finditer(text)]


def layout_names(text: str) -> tuple[set[str], set[str]]:
    """(folders, module files) that the "Every module" list of docs/layout.md names: each bullet
    opens with a folder (`sparserl_jax/kvcache/`) and names its files (`cache.py`)."""
    section = re.split(r"^## Every module.*$", text, maxsplit=1, flags=re.M)[1].split("\n## ", 1)[0]
    folders, files = set(), set()
    for bullet in re.split(r"\n(?=- `)", section):
        m = re.match(r"- `([\w/]+/)`", bullet.strip())
        if m:
            folders.add(m.group(1))
            files |= {m.group(1) + name for name in re.findall(r"`([\w.]+\.py)`", bullet)}
    return folders, files


def unnamed_modules(text: str, modules: set[str]) -> list[str]:
    """The modules (paths of the three trees) that docs/layout.md does not name; a package's
    __init__.py is named by its folder's bullet."""
    folders, files = layout_names(text)
    return sorted(
        m
        for m in modules
        if (m.rpartition("/")[0] + "/" not in folders if m.endswith("/__init__.py") else m not in files)
    )


def missing_commands(text: str) -> list[str]:
    """Scripts, `python -m` modules and --config files named in `text` that do not exist
    (shell variables set in the text, like M=experiments/configs/real, are expanded)."""
    for name, value in ASSIGN.findall(text):
        text = text.replace(f"${name}", value)
    bad = [s for s in SCRIPT.findall(text) if not (REPO / s).is_file()]
    for mod in MODULE.findall(text):
        path = REPO / mod.replace(".", "/")
        if not (path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()):
            bad.append(f"python -m {mod}")
    bad += [c for c in CONFIG.findall(text) if not (REPO / c).is_file()]
    return bad


def unexercised(text: str) -> list[str]:
    """Scripts named in `text` that no test runs and no committed result (experiments/results/**.md)
    records, and `python -m` modules no test runs or imports."""
    tests = "\n".join(p.read_text() for p in (REPO / "tests").glob("*.py") if p.name != "test_docs.py")
    results = "\n".join(p.read_text() for p in (REPO / "experiments/results").rglob("*.md"))

    def tested(script: str) -> bool:  # imported by a test (sparserl_jax.experiments), or its file named there
        stem = re.escape(Path(script).stem)
        pattern = (
            rf"^\s*from sparserl_jax\.experiments(\.real)? import [\w, ]*\b{stem}\b|"
            rf"\bsparserl_jax\.experiments(\.real)?\.{stem}\b|\b{stem}\.py\b|[\"']{stem}[\"']"
        )
        return re.search(pattern, tests, re.M) is not None

    def module_tested(mod: str) -> bool:  # `python -m` or an import of it in a test
        parent, _, name = mod.rpartition(".")
        pattern = rf"\b{re.escape(mod)}\b|from {re.escape(parent)} import [\w, ]*\b{name}\b"
        return re.search(pattern, tests) is not None

    return [s for s in sorted(set(SCRIPT.findall(text))) if s not in NOT_RUN and not tested(s) and s not in results] + [
        f"python -m {m}" for m in sorted(set(MODULE.findall(text))) if not module_tested(m)
    ]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_resolve(doc):
    assert broken_links(doc) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_commands_name_existing_files(doc):
    assert missing_commands(doc.read_text()) == []


@pytest.mark.parametrize("path", CODE, ids=lambda p: str(p.relative_to(REPO)))
def test_the_docs_the_code_cites_exist(path):
    assert broken_citations(path.read_text()) == []
    if path.parent.name != "tests":  # tests name missing files on purpose
        assert [c for c in missing_commands(path.read_text()) if "/" in c] == []  # not X.yaml


def test_layout_names_every_module():
    modules = {
        p.relative_to(REPO).as_posix()
        for tree in ("sparserl_jax", "kernels", "experiments")
        for p in (REPO / tree).rglob("*.py")
    }
    assert unnamed_modules((REPO / "docs/layout.md").read_text(), modules) == []


def test_every_module_opens_with_a_docstring():
    """docs/layout.md says every module of the three trees opens with one."""
    bare = [
        p.relative_to(REPO).as_posix()
        for tree in ("sparserl_jax", "kernels", "experiments")
        for p in (REPO / tree).rglob("*.py")
        if not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert bare == []


def test_every_script_named_is_run_by_a_test_or_a_committed_result():
    assert unexercised("\n".join(d.read_text() for d in DOCS)) == []


def test_the_checkers_find_what_is_broken():
    readme = REPO / "README.md"
    assert slug("The paper's regime: long responses") == "the-papers-regime-long-responses"
    assert slug("RL on SmolLM2-135M") == "rl-on-smollm2-135m"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}
    assert broken_links(
        readme,
        "[x](docs/nowhere.md) [y](docs/reproducing.md#no-such-heading) "
        "[z](https://example.com) `[w](not/a/link.md)` [v](#two-commands)",
    ) == [
        f"docs/nowhere.md: no file {REPO / 'docs/nowhere.md'}",
        "docs/reproducing.md#no-such-heading: no heading #no-such-heading in reproducing.md",
    ]
    assert broken_links(readme, "[ok](docs/reproducing.md#reproducibility)") == []
    assert missing_commands(
        "python experiments/no_such.py --config experiments/configs/none.yaml\n"
        "python -m sparserl_jax.nope\nM=experiments/configs/real\n"
        "python -m sparserl_jax.fetch --config $M/qwen2.5-1.5b.yaml"
    ) == ["experiments/no_such.py", "python -m sparserl_jax.nope", "experiments/configs/none.yaml"]
    assert broken_citations(
        "see docs/methods.md#sars, #ibr and\n#no-such (docs/nowhere.md); "
        "methods.md 1.2, ../shared/methods.md; docs/layout.md#how-to-extend"
    ) == [
        "docs/methods.md#no-such: no such heading",
        "docs/nowhere.md: no such file",
        "methods.md (cite docs/methods.md)",
        "methods.md (cite docs/methods.md)",
    ]
    assert broken_citations("docs/methods.md#acr or #tis, docs/reproducing.md") == []
    layout = (
        "## Every module\n\n- `sparserl_jax/`: `config.py` the schema;\n  `train.py` the loop.\n"
        "- `sparserl_jax/rl/`: `loss.py`.\n\n## Next\n`sparserl_jax/rl/update.py`\n"
    )
    assert unnamed_modules(
        layout,
        {
            "sparserl_jax/config.py",
            "sparserl_jax/train.py",
            "sparserl_jax/rl/__init__.py",
            "sparserl_jax/rl/loss.py",
            "sparserl_jax/rl/update.py",
            "sparserl_jax/quant/__init__.py",
            "sparserl_jax/rl/config.py",
        },
    ) == ["sparserl_jax/quant/__init__.py", "sparserl_jax/rl/config.py", "sparserl_jax/rl/update.py"]
    assert unexercised(
        "python experiments/bench/bench_kernel.py python experiments/not_run_anywhere.py\n"
        "python -m sparserl_jax.train python -m sparserl_jax.untested"
    ) == ["experiments/not_run_anywhere.py", "python -m sparserl_jax.untested"]


def max_cell(text: str) -> int:
    """The longest cell of the markdown tables in `text` (0 without a table)."""
    cells = [c.strip() for line in text.splitlines() if line.startswith("|") for c in line.strip("|").split("|")]
    return max(map(len, cells), default=0)


def test_the_landing_checks_can_fail():
    assert max_cell("| a | b |\n|---|---|\n| " + "x" * 301 + " | y |\n") == 301
    assert max_cell("no table") == 0


def test_readme_is_a_landing_page():
    """The README stays a landing page (the rest lives in docs/): under 10k characters, no table
    cell over 300 (one line a figure), and its second command is CI's own (`bash .ci/run`,
    whose test command it names)."""
    text = (REPO / "README.md").read_text()
    assert len(text) < 10_000 and len(text.splitlines()) < 150
    assert max_cell(text) <= 300
    ci = (REPO / ".ci/run").read_text().strip().splitlines()[-1]
    assert "bash .ci/run" in text and ci in text and ci.startswith("python -m pytest")
    assert "## RL on SmolLM2-135M" in (REPO / "docs/real-model.md").read_text()


HELP_EACH = r"""
import contextlib, io, json, runpy, sys
out = {}
for script in json.loads(sys.argv[1]):
    sys.argv = [script, "--help"]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(script, run_name="__main__")
        out[script] = "ran without exiting"
    except SystemExit as e:
        out[script] = "ok" if e.code in (0, None) and "usage" in buf.getvalue().lower() else f"exit {e.code}"
    except BaseException as e:
        out[script] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def test_every_documented_script_answers_help():
    """Every `python experiments/...py` command of the README and docs/ answers --help (each run as
    its command runs it, in one fresh interpreter from the checkout's root)."""
    scripts = sorted({s for d in DOCS for s in SCRIPT.findall(d.read_text()) if s.startswith("experiments/")})
    assert "experiments/default.py" in scripts and len(scripts) >= 20
    proc = subprocess.run(
        [sys.executable, "-c", HELP_EACH, json.dumps(scripts)], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert {s: r for s, r in got.items() if r != "ok"} == {}
