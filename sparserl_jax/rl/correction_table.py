"""The table of every behaviour-policy correction and preset in docs/implementation.md
(#the-correction-family), generated from the registry (rl/corrections/) and RL_MODES:

  python -m sparserl_jax.rl.correction_table            # print it
  python -m sparserl_jax.rl.correction_table --write    # rewrite it between the markers in
                                                        # docs/implementation.md

tests/test_correction_family.py keeps the docs equal to what this renders."""

from __future__ import annotations

import argparse
import dataclasses
import os

from sparserl_jax.rl.config import MODE_NOTES, RL_MODES, RLConfig
from sparserl_jax.rl.corrections import CORRECTIONS, Correction, compose

START = "<!-- correction table: python -m sparserl_jax.rl.correction_table --write -->"
END = "<!-- end of the correction table -->"
DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "implementation.md")


def _contributes(c: Correction) -> str:
    parts = [("accept mask", c.accept), ("weight", c.weight), ("clip scale", c.clip_scale)]
    return ", ".join(name for name, hook in parts if hook is not None)


def _defaults(c: Correction) -> str:
    fields = [f for f in dataclasses.fields(c.settings) if f.name != "enabled"]
    return ", ".join(f"`{f.name}={f.default}`" for f in fields)


def _rejected_in_denominator(mode: str) -> str:
    """What the loss's denominator does with a preset's rejected tokens (base.py DENOMINATORS)."""
    cfg = RLConfig(mode=mode)
    if not any(CORRECTIONS[n].accept is not None for n in cfg.corrections):
        return "none rejected"
    return "counted (AReaL's)" if compose.counts_rejections(cfg) else "removed"


def render() -> str:
    """Both tables, as markdown."""
    lines = [
        "| correction (`rl.<name>.*`) | contributes | at its defaults | defaults | source | shipped by |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in CORRECTIONS.items():
        joins = (
            " (joins any mode: `enabled`)" if any(f.name == "enabled" for f in dataclasses.fields(c.settings)) else ""
        )
        lines.append(
            f"| `{name}`{joins} | {_contributes(c)} | {c.formula} | {_defaults(c)} | {c.source} | {c.frameworks} |"
        )
    lines += [
        "",
        "| preset (`rl.mode=`) | corrections | rejected tokens in the loss's denominator | what it is | source |",
        "|---|---|---|---|---|",
    ]
    for mode, names in RL_MODES.items():
        what, source = MODE_NOTES[mode]
        corr = " + ".join(f"`{n}`" for n in names) or "none"
        lines.append(f"| `{mode}` | {corr} | {_rejected_in_denominator(mode)} | {what} | {source} |")
    return "\n".join(lines)


def split_doc(text: str) -> tuple[str, str, str]:
    """(before, the table, after) of docs/implementation.md."""
    if START not in text or END not in text:
        raise ValueError(f"docs/implementation.md lacks the table's markers {START!r} ... {END!r}")
    before, rest = text.split(START, 1)
    table, after = rest.split(END, 1)
    return before, table.strip("\n"), after


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true", help="rewrite the table in docs/implementation.md")
    args = p.parse_args(argv)
    table = render()
    if not args.write:
        print(table)
        return 0
    with open(DOC) as f:
        before, _, after = split_doc(f.read())
    with open(DOC, "w") as f:
        f.write(f"{before}{START}\n{table}\n{END}{after}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
