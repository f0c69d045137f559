"""Compile time as JAX reports it: the wall seconds spent tracing, lowering and compiling
programs (each second counted once), the number of XLA compilations and how many of them were
loaded from the persistent compilation cache instead, from jax.monitoring.

JAX reports each jit's tracing, its lowering to MLIR and its backend compilation as a time span.
A function traced inside another jit's trace reports its own span inside the outer one, so a sum
of the durations counts that time twice; the clock keeps the union of the spans instead.
A program found in JAX's persistent compilation cache (sparserl_jax/cli.py use_compile_cache)
is loaded instead of compiled, inside the same backend-compile span: it counts in `compiles` and
in `cache_hits`, and its seconds are the load's.
`install()` registers the listeners once per process; `Since()` reads what compiled after it was
made (benchmarks subtract it from wall time; tests count compilations with it).
"""

from __future__ import annotations

import threading

import jax

# jax._src.dispatch's JAXPR_TRACE_EVENT, JAXPR_TO_MLIR_MODULE_EVENT, BACKEND_COMPILE_EVENT
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
EVENTS = (TRACE, LOWER, BACKEND_COMPILE)
CACHE_HIT = "/jax/compilation_cache/cache_hits"  # jax._src.compiler: a program loaded, not compiled


class CompileClock:
    """Running totals over the compile spans reported so far: `seconds` (their union),
    `compiles` (backend compilations) and `cache_hits` (those loaded from the persistent cache)."""

    KEEP = 4096  # spans kept for merging; a new span never reaches back further in practice

    def __init__(self):
        self._lock = threading.Lock()
        self._spans: list[tuple[float, float]] = []  # disjoint, by end time
        self.seconds = 0.0
        self.compiles = 0
        self.cache_hits = 0

    def add(self, event: str, start: float, end: float) -> None:
        """One reported span; a span overlapping earlier ones adds only its uncovered part."""
        if event not in EVENTS:
            return
        with self._lock:
            self.compiles += event == BACKEND_COMPILE
            spans, later = self._spans, []
            while spans and spans[-1][1] >= start:
                s, e = spans.pop()
                if s <= end:  # overlaps: merge (an inner span reported before its outer one)
                    self.seconds -= e - s
                    start, end = min(start, s), max(end, e)
                else:  # wholly after this one (reported out of order by another thread)
                    later.append((s, e))
            spans.append((start, end))
            self.seconds += end - start
            spans.extend(reversed(later))
            if len(spans) > 2 * self.KEEP:
                del spans[: -self.KEEP]

    def event(self, event: str) -> None:
        """One reported event: a persistent-cache hit counts."""
        if event == CACHE_HIT:
            with self._lock:
                self.cache_hits += 1


CLOCK = CompileClock()
_installed = False
_install_lock = threading.Lock()


def install() -> None:
    """Register the clock's listeners (once per process)."""
    global _installed
    with _install_lock:
        if not _installed:
            jax.monitoring.register_event_time_span_listener(
                lambda event, start, end, **_: CLOCK.add(event, start, end)
            )
            jax.monitoring.register_event_listener(lambda event, **_: CLOCK.event(event))
            _installed = True


class Since:
    """What compiled after this object was made: `seconds` (wall, each second once), `compiles`
    (backend compilations) and `cache_hits` (those loaded from the persistent cache)."""

    def __init__(self):
        install()
        self._s0, self._c0, self._h0 = CLOCK.seconds, CLOCK.compiles, CLOCK.cache_hits

    @property
    def seconds(self) -> float:
        return CLOCK.seconds - self._s0

    @property
    def compiles(self) -> int:
        return CLOCK.compiles - self._c0

    @property
    def cache_hits(self) -> int:
        return CLOCK.cache_hits - self._h0
