"""Does another machine (or today's code) give a recorded run? Replay its first iterations and
compare them with its record, bit for bit.

  python experiments/real/collapse.py --setting rkv64 --replay naive/seed0 --replay-iterations 2

A study's verdict stands on one machine's runs until they are repeated elsewhere, and repeating a
real-model study costs hours a run. A replay trains a recorded run again from its start, for its
first few iterations, in a fresh run directory (no checkpoint of the run is resumed), with the
same resolved config and the same single-core worker settings (experiments/lib/workers.py: the
portable CPU numerics), and compares every metric of those iterations that is not a clock reading
with the record, exactly. Identical iterations mean this machine computes the recorded run: its
record (and so the verdict) holds here too, at the cost of a few iterations. A difference names
the first iteration and metric where the two part, and how far apart every metric ends up.
Code changes count too: a record made with other package code than today's can differ because of
the code (a new metric in the update step changes how XLA fuses it, and so the last bits), so the
replay says how many commits changed sparserl_jax/ between the record's code and its own, and
metrics logged only since the record are listed, not compared. To test the machine alone, replay a
record made with today's package.

Each replay writes <out>/replays/<run>--<cpu>.json (the comparison and its provenance: commit,
CPU, jax); results.md lists them beside the records.
"""

from __future__ import annotations

import json
import os
import shutil
import time

from experiments.lib import figlib, run_records, workers
from experiments.lib.figprov import cpu_slug, package_changes, package_commit
from experiments.lib.figstats import untimed

REPLAYS = "replays"
SAMPLED = ("reward/", "response/", "kv/")  # metrics of the sampled tokens themselves


def compare(recorded: list[dict], replayed: list[dict]) -> dict:
    """Exact comparison of the first len(replayed) iterations of a recorded metrics history with a
    replay's (both as JSON gives them back): how many values were compared, whether all are equal,
    the first difference (iteration from 1, metric, both values), the metrics that differ anywhere
    and the largest relative difference of any metric. A metric the record lacks is one logged only
    since the record was made (new_metrics: listed, not compared); one the replay lacks is a
    difference (the code no longer computes it)."""
    if len(replayed) > len(recorded):
        raise ValueError(f"the replay has {len(replayed)} iterations, the record only {len(recorded)}")
    first, worst, n, differing, new, names = None, 0.0, 0, set(), set(), set()
    for i, (a, b) in enumerate(zip(recorded, replayed), 1):
        a, b = untimed(a), untimed(b)
        new |= b.keys() - a.keys()
        names |= a.keys()
        for k in sorted(a.keys()):
            n += 1
            va, vb = a[k], b.get(k)
            if va == vb or (va != va and vb != vb):  # equal, or both NaN
                continue
            first = first or {"iteration": i, "metric": k, "recorded": va, "replayed": vb}
            differing.add(k)
            if isinstance(va, (int, float)) and isinstance(vb, (int, float)):
                worst = max(worst, abs(vb - va) / max(abs(va), 1e-12))
            else:  # a metric the replay lacks
                worst = float("inf")
    return {
        "iterations": len(replayed),
        "values": n,
        "metrics": len(names),
        "identical": first is None,
        "first_difference": first,
        "differing_metrics": sorted(differing),
        "max_rel_diff": worst,
        "new_metrics": sorted(new),
        # the same tokens so far: every metric of what was sampled (rewards, lengths, kept KV) equal
        "same_samples": not any(k.startswith(SAMPLED) for k in differing),
    }


def path_of(out: str, name: str) -> str:
    return os.path.join(out, REPLAYS, f"{name.replace('/', '-')}--{cpu_slug()}.json")


def _job(job) -> dict:
    """Worker: train the run of `over` for `iterations` iterations from its start in `runs_dir`;
    its metrics history as JSON gives it back, with the provenance of this process."""
    config, base, runs_dir, over, iterations = job
    start = figlib.provenance(workers.available_cores(), None)
    t0 = time.perf_counter()
    run = figlib.Study(config, base, runs_dir).train("replay", [*over, f"train.iterations={iterations}"])
    history = json.loads(json.dumps(run.history, default=float))
    return {"history": history, "provenance": {**start, "wall_s": round(time.perf_counter() - t0, 1)}}


def replay(study: figlib.Study, records_dir: str, name: str, iterations: int, out: str, commit: bool) -> dict:
    """Replay the recorded run `name` for its first `iterations` iterations (a run of today's
    resolved config: a record of another config is refused), write the comparison to
    <out>/replays/ (committed if asked) and return it."""
    record = run_records.read(records_dir, name)
    if record is None:
        raise FileNotFoundError(f"--replay {name}: no record {run_records.path_of(records_dir, name)}")
    key = figlib.config_key(study.resolve(record["overrides"]))
    if key != record["config_key"]:
        raise ValueError(
            f"--replay {name}: the record's config ({record['config_key']}) is not what this code resolves "
            f"for its overrides ({key}); a replay compares only the same run"
        )
    if not 0 < iterations <= len(record["history"]):
        raise ValueError(f"--replay-iterations {iterations}: the record has {len(record['history'])} iterations")
    runs_dir = os.path.join(study.runs_dir, "replays", key)  # fresh: no checkpoint of the run resumes
    shutil.rmtree(runs_dir, ignore_errors=True)
    (done,) = workers.parallel_map(
        _job,
        [(study.config, study.overrides, runs_dir, record["overrides"], iterations)],
        (study.cores or workers.available_cores())[:1],
    )
    result = {
        "name": name,
        "record": os.path.relpath(run_records.path_of(records_dir, name), out),
        "record_provenance": {k: record["provenance"].get(k) for k in ("commit", "library_commit", "cpu", "jax")},
        **compare(record["history"], done["history"]),
        # commits to the package between the record's code and the replay's: a difference with
        # none is the machine's (or jax's); with some it may be the code's
        "package_changes": package_changes(package_commit(record["provenance"]), package_commit(done["provenance"])),
        "provenance": done["provenance"],
        "history": done["history"],  # the replayed iterations, for another comparison later
        "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    path = path_of(out, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=float)
        f.write("\n")
    if commit:
        word = "identical" if result["identical"] else "differs"
        run_records.commit(path, f"replay of {name} ({iterations} iterations) on {cpu_slug()}: {word}")
    return result


def replays(out: str) -> dict:
    """{"replays": [comparison, ...]} from <out>/replays/ (none: {}), for results.md; a replay that
    keeps its replayed history is compared with its record again, by today's rules."""
    folder = os.path.join(out, REPLAYS)
    if not os.path.isdir(folder):
        return {}
    found = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                r = json.load(f)
            record = os.path.join(out, r["record"])
            if "history" in r and os.path.exists(record):  # compared again by today's rules
                with open(record) as f:
                    r.update(compare(json.load(f)["history"], r["history"]))
            found.append(r)
    return {"replays": found} if found else {}


def outcome(r: dict) -> str:
    """A comparison in words: identical, or where the replay parts from the record and how far;
    metrics logged only since the record, and package changes between the two, said."""
    new = r.get("new_metrics") or []
    changes = r.get("package_changes")
    notes = (f"; {len(new)} metrics logged only since the record, not compared" if new else "") + (
        f"; the package changed in {changes} commits between the record and the replay, so a difference "
        "may be the code's, not the machine's"
        if changes
        else "; the same package code"
        if changes == 0
        else ""
    )
    if r["identical"]:
        return f"identical ({r['values']} values){notes}"
    d = r["first_difference"]
    differing = r.get("differing_metrics")
    where = f" in {len(differing)} of {r['metrics']} metrics" if differing and r.get("metrics") else ""
    samples = (
        "; the same samples (every reward, length and kept-KV metric equal)"
        if r.get("same_samples")
        else "; the samples differ"
        if "same_samples" in r
        else ""
    )
    return (
        f"differs from iteration {d['iteration']} ({d['metric']}: {d['recorded']} recorded, {d['replayed']} "
        f"replayed); largest relative difference {r['max_rel_diff']:.2g}{where}{samples}{notes}"
    )


def lines(found: list[dict]) -> list[str]:
    """results.md's table of replays: run, iterations, machine and commit of the replay against the
    record's, and the outcome."""
    if not found:
        return []
    rows = []
    for r in found:
        p, rec = r["provenance"], r["record_provenance"]
        rows.append(
            [
                r["name"],
                str(r["iterations"]),
                f"{p['cpu']}, jax {p['jax']}, commit {p['commit']}"
                + (" (uncommitted changes)" if p.get("uncommitted_changes") else ""),
                f"{rec['cpu']}, jax {rec['jax']}, commit {rec['commit']}",
                outcome(r),
            ]
        )
    return [
        "Replays (experiments/lib/run_replay.py: a recorded run trained again from its start for its first "
        "iterations, every metric but clock readings compared exactly; identical means the replaying "
        "machine computes the recorded run; a difference is the machine's only where the package code is the same):",
        "",
        *figlib.md_table(["run", "iterations", "replayed on", "recorded on", "outcome"], rows),
    ]
