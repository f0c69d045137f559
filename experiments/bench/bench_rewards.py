"""Reward throughput on a rollout's responses: the checks one after the other in this process
(data.reward_pool.workers=0) against the pool of worker processes (sparserl_jax/data/reward_pool.py).

  nice -n 10 python experiments/bench/bench_rewards.py --note "two training runs held both cores"
      # -> experiments/results/bench_rewards.{json,md}
  python experiments/bench/bench_rewards.py --smoke --out /tmp/bench_rewards.json

Workload: --responses (1024, one iteration's rollout.prompts x rollout.samples) made-up responses
of a few sentences of working and a final answer, drawn from --seed: boxed fractions, roots,
intervals, polynomials, multiples of pi and integers, each written as the label is (the string
fast path), in an equivalent form the symbolic check must decide (0.5 for \\frac{1}{2}, \\sqrt{8}
for 2\\sqrt{2}, x^2+2x+1 for (x+1)^2), or wrong; GSM8K "####" answers and multiple-choice letters
(their rows' data_source picks those rewards); truncated and missing answers. Every repeat draws
fresh responses from numbers so spread that math-verify's cache of checks seldom hits, and serial
and pool check the same ones, in alternating order; the pool's start (its workers load sympy) is
timed apart. Per arm: the median seconds of a batch, responses per second, the pool's speed-up
over serial, and whether its rewards equal the serial ones.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import statistics
import sys
import time

from experiments.lib import figprov, workers  # import no JAX
from sparserl_jax.data import rewards
from sparserl_jax.data.reward_pool import RewardChecker, RewardPoolConfig

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/
KINDS = ("same", "equivalent", "wrong", "gsm8k", "choice", "no_answer")
WEIGHTS = (0.35, 0.25, 0.2, 0.1, 0.05, 0.05)
STEPS = (
    "We first rewrite the expression so that the common factor is visible.",
    "Substituting back, the two sides agree, so this is consistent.",
    "Note that $x^2 - 1 = (x-1)(x+1)$, which simplifies the fraction.",
    "By the quadratic formula, $x = \\frac{-b \\pm \\sqrt{b^2-4ac}}{2a}$.",
    "Checking the endpoints, the left one is excluded and the right one included.",
    "Multiplying both sides by the denominator gives a linear equation.",
    "The sum of the first $n$ terms is $\\frac{n(n+1)}{2}$.",
    "So the area is half the base times the height.",
)


def _math_item(rng: random.Random) -> tuple[str, list[str], list[str]]:
    """(label, equivalent forms, wrong forms) of one answer, its numbers drawn from rng from ranges
    wide enough that a (response, label) pair seldom comes twice (math-verify caches its checks)."""
    kind = rng.randrange(6)
    if kind == 0:  # a fraction, with a finite decimal
        b = rng.choice([2, 4, 5, 8, 16, 20, 25, 40, 50, 80])
        a, k = rng.randint(1, 4 * b - 1), rng.randint(2, 9)
        return (
            f"\\frac{{{a}}}{{{b}}}",
            [f"{a / b:g}", f"{a}/{b}", f"\\frac{{{a * k}}}{{{b * k}}}"],
            [f"\\frac{{{a + 1}}}{{{b}}}", f"{a / b + 0.5:g}"],
        )
    if kind == 1:  # a root
        k, m = rng.randint(2, 99), rng.choice([2, 3, 5, 6, 7, 10, 11, 13])
        return f"{k}\\sqrt{{{m}}}", [f"\\sqrt{{{k * k * m}}}"], [f"{k + 1}\\sqrt{{{m}}}", f"\\sqrt{{{k * m}}}"]
    if kind == 2:  # an interval
        lo, hi = sorted(rng.sample(range(-999, 1000), 2))
        return f"({lo}, {hi}]", [f"\\left({lo},{hi}\\right]"], [f"[{lo}, {hi})", f"({lo}, {hi})"]
    if kind == 3:  # a polynomial
        a = rng.randint(1, 999)
        return f"(x+{a})^2", [f"x^2+{2 * a}x+{a * a}"], [f"x^2+{a}x+{a * a}", f"(x-{a})^2"]
    if kind == 4:  # a multiple of pi
        n, d = rng.randrange(1, 999, 2), rng.choice([2, 3, 4, 6])
        return (
            f"\\frac{{{n}\\pi}}{{{d}}}",
            [f"{n}\\pi/{d}", f"\\frac{{{n}}}{{{d}}}\\pi"],
            [f"\\frac{{{n}\\pi}}{{{2 * d}}}"],
        )
    n = rng.randint(2, 99999)  # an integer
    return str(n), [f"{n}.0", f"{n:,}"], [str(n + 1)]


def _working(rng: random.Random) -> str:
    return " ".join(rng.choice(STEPS) for _ in range(rng.randint(3, 12)))


def make_rows(n: int, seed: int) -> list[tuple[str, str, str | None, str]]:
    """n (response, label, data_source, kind) rows, a function of (n, seed)."""
    rng = random.Random(seed)
    rows = []
    for kind in rng.choices(KINDS, WEIGHTS, k=n):
        work = _working(rng)
        if kind == "gsm8k":
            total = rng.randint(10, 20000)
            got = total if rng.random() < 0.7 else total + rng.randint(1, 9)
            rows.append((f"{work}\n#### {got:,}", f"So the total is {total}.\n#### {total}", "openai/gsm8k", kind))
            continue
        if kind == "choice":
            letter = rng.choice("ABCDE")
            got = letter if rng.random() < 0.6 else rng.choice("ABCDE")
            rows.append((f"{work} The answer is ({got}).", letter, "multiple_choice", kind))
            continue
        label, same, wrong = _math_item(rng)
        source = rng.choice([None, "lighteval/MATH"])
        if kind == "no_answer":
            response = rng.choice([work, f"{work} so the answer is \\boxed{{{label[:-1]}"])  # none, or truncated
        else:
            answer = {"same": label, "equivalent": rng.choice(same), "wrong": rng.choice(wrong)}[kind]
            response = f"{work} Therefore the answer is $\\boxed{{{answer}}}$."
        rows.append((response, label, source, kind))
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--responses", type=int, default=1024, help="responses per batch")
    p.add_argument("--workers", type=int, nargs="+", default=[2], help="pool sizes to measure")
    p.add_argument("--repeats", type=int, default=3, help="timed batches per arm (fresh responses each)")
    p.add_argument("--timeout-s", type=float, default=rewards.DEFAULT_TIMEOUT_S, help="per-check time limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default="", help="what else ran on the machine, for the report (e.g. two training runs)")
    p.add_argument("--smoke", action="store_true", help="32 responses, one repeat, one worker")
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_rewards.json"))
    args = p.parse_args(argv)
    if args.smoke:
        args.responses, args.repeats, args.workers = 32, 1, [1]
    for name in ("responses", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if min(args.workers) < 1:
        p.error(f"--workers {args.workers}: each pool needs >= 1 worker (serial is always measured)")
    return args


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) of this process and the processes `pids` so far (Linux /proc)."""
    total = time.process_time()
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return total


def _timed(checker: RewardChecker, rows) -> tuple[float, float, list[float], int]:
    """(wall s, CPU s of this process and the pool's workers, rewards, timeouts) of one batch."""
    responses, labels, sources, _ = zip(*rows)
    pids = checker.worker_pids
    c0, t0 = _cpu_s(pids), time.perf_counter()
    values, late = checker.check(list(responses), list(labels), list(sources))
    return time.perf_counter() - t0, _cpu_s(pids) - c0, values.tolist(), int(late.sum())


def measure(args) -> dict:
    """Per arm ("serial", "pool_<W>"): each repeat's seconds, and the rewards' agreement with serial."""
    reward = rewards.get_timed_reward("math", args.timeout_s)
    rewards.warm_up()
    arms = {"serial": RewardChecker(reward)}
    start_s = {}
    for w in args.workers:
        t0 = time.perf_counter()
        arms[f"pool_{w}"] = RewardChecker(reward, RewardPoolConfig(workers=w, timeout_s=args.timeout_s))
        arms[f"pool_{w}"].wait_ready()
        start_s[f"pool_{w}"] = time.perf_counter() - t0
    out = {name: {"seconds": [], "cpu_s": [], "timeouts": 0, "equal_to_serial": True} for name in arms}
    kinds, by_kind = {}, {k: [] for k in KINDS}
    for r in range(args.repeats):
        rows = make_rows(args.responses, args.seed + r)
        for kind in KINDS:
            kinds[kind] = kinds.get(kind, 0) + sum(row[3] == kind for row in rows)
        order = list(arms) if r % 2 == 0 else list(arms)[::-1]  # alternate: neither arm always first
        got = {}
        for name in order:
            seconds, cpu_s, values, late = _timed(arms[name], rows)
            out[name]["seconds"].append(seconds)
            out[name]["cpu_s"].append(cpu_s)
            out[name]["timeouts"] += late
            got[name] = values
        for row, value in zip(rows, got["serial"]):
            by_kind[row[3]].append(value)
        for name in arms:
            out[name]["equal_to_serial"] &= got[name] == got["serial"]
    for name, checker in arms.items():
        checker.close()
        out[name]["start_s"] = start_s.get(name, 0.0)
    every = [v for values in by_kind.values() for v in values]
    reward_by_kind = {k: statistics.fmean(v) for k, v in by_kind.items() if v}
    return {"arms": out, "kinds": kinds, "mean_reward": statistics.fmean(every), "reward_by_kind": reward_by_kind}


def summarise(arms: dict, responses: int) -> dict:
    serial = statistics.median(arms["serial"]["seconds"])
    out = {}
    for name, a in arms.items():
        median = statistics.median(a["seconds"])
        out[name] = {
            "median_s": median,
            "cpu_s": statistics.median(a["cpu_s"]),
            "responses_per_s": responses / median,
            "speedup": serial / median,
            "timeouts": a["timeouts"],
            "equal_to_serial": a["equal_to_serial"],
            "start_s": a["start_s"],
        }
    return out


def to_markdown(data: dict) -> str:
    load = data["load_average"]
    lines = [
        *figprov.report_head("Reward throughput: serial checks vs the reward pool", data),
        f"Workload: {data['responses']} responses a batch, {data['repeats']} batches (fresh responses each, "
        f"the same for every arm), per-check limit {data['timeout_s']:g} s; answers by kind over all "
        f"batches: {', '.join(f'{k} {v}' for k, v in data['kinds'].items())}; mean reward "
        f"{data['mean_reward']:.3f} (by kind: "
        f"{', '.join(f'{k} {v:.2f}' for k, v in data['reward_by_kind'].items())}).",
        "",
        f"{'Measured on a loaded machine' if load['start'] >= data['cores'] else 'Measured'}: {data['cores']} "
        f"cores, load average {load['start']:.1f} at the start and {load['end']:.1f} at the end"
        + (f" ({data['note']})" if data.get("note") else "")
        + f", this process at niceness {data['niceness']}"
        + (
            "; the kernel shares the cores between sessions (sched_autogroup on), so this process and "
            "its workers together had about one session's share however many of them ran"
            if data.get("autogroup") and load["start"] >= data["cores"]
            else ""
        )
        + ". The figures are the ratios of arms measured side by side in one run, batches "
        "alternating which arm goes first, not this CPU's speed.",
        "",
        "| arm | median s / batch | responses / s | speed-up over serial | CPU s / batch | timeouts "
        "| rewards equal serial | start s |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name, s in data["summary"].items():
        lines.append(
            f"| {name} | {s['median_s']:.2f} | {s['responses_per_s']:.0f} | {s['speedup']:.2f}x | "
            f"{s['cpu_s']:.2f} | {s['timeouts']} | {'yes' if s['equal_to_serial'] else 'no'} | {s['start_s']:.1f} |"
        )
    lines += [
        "",
        "CPU s: the CPU seconds of this process and the pool's workers in a batch (median), the "
        "figure a shared core leaves least changed: the pool's extra over serial is its cost of "
        "shipping the checks. start s: the pool's start before its first batch (its workers load "
        "sympy and math-verify), paid once a run and left out of the batches' times.",
    ]
    return "\n".join(lines) + "\n"


def _autogroup() -> bool | None:
    """Whether the kernel groups CPU time by session (Linux sched_autogroup); None where unknown."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return None


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0, cores = time.perf_counter(), workers.available_cores()
    provenance = figprov.provenance(cores, None)
    load_start = os.getloadavg()[0]
    measured = measure(args)
    niceness, command, argv = os.nice(0), figprov.command_line(cores), " ".join(sys.argv[1:])
    command = command[: len(command) - len(argv)] + shlex.join(sys.argv[1:])  # --note quoted
    data = {
        "command": (f"nice -n {niceness} " if niceness else "") + command,
        "note": args.note,
        "niceness": niceness,
        "provenance": {**provenance, "wall_s": round(time.perf_counter() - t0, 1)},
        "cores": os.cpu_count(),
        "load_average": {"start": load_start, "end": os.getloadavg()[0]},
        "autogroup": _autogroup(),
        "responses": args.responses,
        "repeats": args.repeats,
        "timeout_s": args.timeout_s,
        **measured,
        "summary": summarise(measured["arms"], args.responses),
    }
    figprov.write_report(args.out, data, to_markdown(data))
    print(to_markdown(data))
    return data


if __name__ == "__main__":
    main()
