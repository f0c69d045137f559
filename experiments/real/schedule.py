"""Budget schedules from calibrated bins (Sparrow's tail): per bin of tokens seen, the smallest
KV budget whose agreement percentile holds a target. Pure functions of measured rows; the
measurement itself is real/tail.py's, the study real/tail_study.py and figures/fig_tail.py.
Imports no JAX."""

from __future__ import annotations


def schedule_for(rows: list[dict], budgets: list[int], tau: float) -> tuple[int, ...]:
    """Per bin of tokens seen (0 .. the last bin any arm reached): the smallest budget whose 5th
    percentile in that bin is >= tau, the largest where none is (a bin no arm reached: the
    previous entry; bins before any token: the smallest budget, nothing is evicted there)."""
    by = {r["arm"]["budget"]: {int(b): v for b, v in r["bins"].items()} for r in rows}
    last = max(b for bins in by.values() for b in bins)
    out = []
    for b in range(last + 1):
        measured = [B for B in sorted(budgets) if b in by[B]]
        if not measured:
            out.append(out[-1] if out else min(budgets))
            continue
        ok = [B for B in measured if by[B][b]["p5"] >= tau]
        out.append(ok[0] if ok else max(measured))
    return tuple(out)


def _holds(row: dict, bins, target: dict[int, float]) -> bool:
    """Every bin of `bins` the row reached at its target percentile."""
    p5 = {int(k): v["p5"] for k, v in row["bins"].items()}
    return all(p5.get(b, target[b]) >= target[b] for b in bins)


def sequential_schedule(
    n_bins: int, budgets: list[int], tau: float, reached: set[int], measure, ceiling: dict[int, float] | None = None
) -> tuple:
    """Bin by bin: the smallest budget that, sampled with the earlier bins' chosen budgets in force
    (and the largest after it), keeps the percentile of that bin and of every later bin at its
    target, the largest where none does; a bin no token reached takes the smallest (nothing is
    evicted there). A bin's target is tau, or where `ceiling` (bin -> the largest budget's own
    percentile there) is lower, that: a bin the largest budget cannot hold at tau is held at the
    largest budget's level. Later bins count because eviction is irreversible: a small early
    budget can pass its own bin and lose what a later bin needs. `measure(list of schedules) ->
    list of rows` samples candidates (in parallel). Returns (schedule, rows sampled, the row of
    the final schedule or None)."""
    budgets = sorted(budgets)
    target = {b: min(tau, (ceiling or {}).get(b, tau)) for b in range(n_bins)}
    chosen, sampled = [], []
    for b in range(n_bins):
        if b not in reached:
            chosen.append(budgets[0])
            continue
        cands = [tuple(chosen + [B] + [budgets[-1]] * (n_bins - b - 1)) for B in budgets]
        rows = measure(cands)
        sampled += rows

        ok = [B for B, r in zip(budgets, rows) if _holds(r, range(b, n_bins), target)]
        chosen.append(ok[0] if ok else budgets[-1])
    chosen = tuple(chosen)
    final = next((r for r in sampled if tuple(r["arm"]["schedule"]) == chosen), None)
    return chosen, sampled, final
