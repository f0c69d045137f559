"""The device check's runner and report: every step in its own process, timed and killed at its
budget, and DIR/report.json + DIR/report.md rewritten before and after every step.

A step's process writes DIR/steps/<name>.json ("running" with what it has measured so far, then its
verdict) and its output to DIR/steps/<name>.log. A step that raises, dies (a compiler abort, an
out-of-memory kill) or outlives its budget is recorded as failed with one line saying why, and the
next step runs: one process each, so a crash takes nothing else down, a step's peak device memory
is its own, and the process running the steps never starts a device itself. Imports no JAX.

Step verdicts: ok; warn (it ran and its correctness checks hold, a performance goal is missed);
fail (an error, a crash, a timeout or a correctness check that does not hold); skipped (the time
limit was spent, or the environment step found no GPU). The report reads PASS only when every
step ran and none failed; its exit code is non-zero when one failed or did not run.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

VERDICT_OK = ("ok", "warn")
_MIN_STEP_S = 10.0  # a step is not started with less time than this left


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    title: str
    budget_s: float  # its process is killed past this (and past the check's time limit)


def check(name: str, value, limit: str, passed: bool, kind: str = "must") -> dict:
    """One check of a step: "must" fails the step where it does not hold, "goal" (a performance
    goal) makes it a warning."""
    return {"name": name, "value": value, "limit": limit, "passed": bool(passed), "kind": kind}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def one_line(text: str, limit: int = 300) -> str:
    """The first non-empty line of `text`, cut to `limit` characters."""
    line = next((s.strip() for s in str(text).splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def write_json(path: str, data: dict) -> None:
    """Write through a temporary file, so a reader never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=float)
    os.replace(tmp, path)


def read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def verdict(steps: Sequence[dict]) -> tuple[str, str]:
    """(word, sentence) for the report: PASS only when every step ran and none failed."""
    failed = [s["name"] for s in steps if s["status"] == "fail"]
    undone = [s["name"] for s in steps if s["status"] in ("pending", "running", "skipped")]
    warned = [s["name"] for s in steps if s["status"] == "warn"]
    if failed:
        return "FAIL", f"{len(failed)} of {len(steps)} steps failed: {', '.join(failed)}" + (
            f"; not run: {', '.join(undone)}" if undone else ""
        )
    if undone:
        return "INCOMPLETE", f"not run (or still running): {', '.join(undone)}"
    if warned:
        return "PASS with warnings", f"every step ran; a performance goal missed in: {', '.join(warned)}"
    return "PASS", "every step ran and every check holds"


def render_markdown(report: dict) -> str:
    word, sentence = verdict(report["steps"])
    env = next((s.get("result") or {} for s in report["steps"] if s["name"] == "env"), {})
    device = env.get("device_kind", "device not yet known")
    lines = [
        f"# Device check: {device} ({report['mode']})",
        "",
        f"**{word}**: {sentence}.",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Started {report['started']}; "
        + (
            f"finished {report['finished']}, {report['elapsed_s']:.0f} s of the {report['time_limit_s']:.0f} s limit."
            if report.get("finished")
            else f"{report['elapsed_s']:.0f} s so far (limit {report['time_limit_s']:.0f} s)."
        ),
        "",
        "| step | status | seconds (budget) | figure |",
        "|---|---|---|---|",
    ]
    for s in report["steps"]:
        secs = "-" if s.get("seconds") is None else f"{s['seconds']:.0f}"
        shown = " ".join(x for x in (f"**{s['error']}**" if s.get("error") else "", s.get("figure") or "") if x)
        lines.append(
            f"| {s['name']} | {s['status'].upper() if s['status'] == 'fail' else s['status']} | "
            f"{secs} ({s['budget_s']:.0f}) | {shown.replace('|', '/')} |"
        )
    for s in report["steps"]:
        if s["status"] in ("pending",):
            continue
        lines += ["", f"## {s['name']}: {s['title']}", ""]
        if s.get("error"):
            lines += [f"Failed: {s['error']}", ""]
        if s.get("note"):
            lines += [f"Note: {s['note']}.", ""]
        for c in s.get("checks", []):
            mark = "holds" if c["passed"] else ("MISSED (goal)" if c["kind"] == "goal" else "FAILS")
            lines.append(f"- {c['name']}: {c['value']} (limit {c['limit']}): {mark}")
        if s.get("checks"):
            lines.append("")
        lines += s.get("markdown", [])
        if s.get("log"):
            lines += [
                "",
                f"Output: [{os.path.basename(s['log'])}](steps/{os.path.basename(s['log'])})"
                + (f"; what it measured: steps/{s['name']}.json" if s["status"] == "fail" else ""),
            ]
    return "\n".join(lines) + "\n"


class Runner:
    """Runs `steps` one process each (`command(step)`, environment `envs[step.name]`, default
    this process's), within `time_limit_s` in all, and keeps DIR/report.json and DIR/report.md
    current."""

    def __init__(
        self,
        out: str,
        steps: Sequence[Step],
        command: Callable[[Step], list[str]],
        *,
        mode: str,
        command_line: str,
        time_limit_s: float,
        envs: dict[str, dict] | None = None,
        log=print,
    ):
        self.out, self.steps, self.command, self.log = out, list(steps), command, log
        self.envs = envs or {}
        self.time_limit_s, self.t0 = time_limit_s, time.monotonic()
        os.makedirs(os.path.join(out, "steps"), exist_ok=True)
        self.report = {
            "mode": mode,
            "command": command_line,
            "started": now(),
            "finished": None,
            "time_limit_s": time_limit_s,
            "elapsed_s": 0.0,
            "steps": [
                {"name": s.name, "title": s.title, "budget_s": s.budget_s, "status": "pending"} for s in self.steps
            ],
        }
        self.proc: subprocess.Popen | None = None

    def path(self, step: Step, ext: str) -> str:
        return os.path.join(self.out, "steps", f"{step.name}.{ext}")

    def write(self) -> None:
        self.report["elapsed_s"] = time.monotonic() - self.t0
        self.report["verdict"] = verdict(self.report["steps"])[0]
        write_json(os.path.join(self.out, "report.json"), self.report)
        with open(os.path.join(self.out, "report.md"), "w") as f:
            f.write(render_markdown(self.report))

    def run(self) -> int:
        """Every step in order; the exit code: 0 when the report reads PASS (with or without
        warnings), 1 otherwise."""
        previous = signal.signal(signal.SIGTERM, self._terminated)
        try:
            stop = None
            for i, step in enumerate(self.steps):
                row = self.report["steps"][i]
                left = self.time_limit_s - (time.monotonic() - self.t0)
                if stop or left < _MIN_STEP_S:
                    row.update(
                        status="skipped",
                        error=stop or f"skipped: {left:.0f} s of the {self.time_limit_s:.0f} s limit left",
                    )
                    self.write()
                    continue
                row.update(status="running", started=now())
                self.write()
                self.log(
                    f"[{i + 1}/{len(self.steps)}] {step.name}: {step.title} (budget {step.budget_s:.0f} s)", flush=True
                )
                row.update(self._run_step(step, min(step.budget_s, left)))
                self.write()
                self.log(
                    f"    {row['status']} in {row['seconds']:.1f} s ({row['cpu_s']:.1f} s CPU): "
                    f"{row.get('figure') or row.get('error', '')}",
                    flush=True,
                )
                stop = row.pop("stop", None)
            self.report["finished"] = now()
            self.write()
        finally:
            signal.signal(signal.SIGTERM, previous)
        word, sentence = verdict(self.report["steps"])
        self.log(f"{word}: {sentence}. Report: {os.path.join(self.out, 'report.md')}", flush=True)
        return 0 if word in ("PASS", "PASS with warnings") else 1

    def _run_step(self, step: Step, timeout: float) -> dict:
        result_path, log_path = self.path(step, "json"), self.path(step, "log")
        for p in (result_path,):
            if os.path.exists(p):
                os.remove(p)
        t0, cpu0 = time.monotonic(), _children_cpu_s()
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                self.command(step),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.envs.get(step.name),
                start_new_session=True,
            )
            try:
                rc = self.proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                self._kill()
                rc, timed_out = self.proc.returncode, True
            finally:
                self.proc = None
        seconds = time.monotonic() - t0
        data = read_json(result_path) or {}
        row = {
            "seconds": seconds,
            "cpu_s": _children_cpu_s() - cpu0,
            "log": log_path,
            **{
                k: data[k]
                for k in ("figure", "checks", "result", "markdown", "stop", "error", "traceback")
                if k in data
            },
        }
        if timed_out:
            row.update(
                status="fail",
                error=f"timed out: killed after {seconds:.0f} s (budget "
                f"{step.budget_s:.0f} s, time left {timeout:.0f} s)",
            )
        elif data.get("status") in ("ok", "warn", "fail"):
            row["status"] = data["status"]
            if rc != 0 and data["status"] != "fail":  # e.g. a crash in the runtime's teardown
                row["note"] = f"its process then ended with {_how(rc)}"
        else:  # no verdict written: the process died
            row.update(
                status="fail",
                error=f"the step's process died ({_how(rc)}) without a verdict; "
                f"last output: {one_line(_last_line(log_path))}",
            )
        return row

    def _kill(self) -> None:
        """SIGTERM, then SIGKILL, to the step's process group (its own children included)."""
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=wait)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue

    def _terminated(self, signum, _frame) -> None:
        """Killed from outside (a time limit): stop the running step, record what it measured."""
        for row, step in zip(self.report["steps"], self.steps):
            if row["status"] == "running":
                if self.proc is not None:
                    self._kill()
                data = read_json(self.path(step, "json")) or {}
                row.update(
                    status="fail",
                    error="the check was killed (SIGTERM) while this step ran",
                    **{k: data[k] for k in ("figure", "checks", "result", "markdown") if k in data},
                )
        self.report["finished"] = now()
        self.write()
        sys.exit(128 + signum)


def _how(rc: int | None) -> str:
    return f"signal {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exit code {rc}"


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's finished children so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [s for s in f.read().splitlines() if s.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else "(none)"
