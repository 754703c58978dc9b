"""This process's memory: the kernel's whole-process peak, and a run's memory sampled phase by phase from loading
to the saved adapter (the recipes' ``summary.json``, the memory benchmark).

A daemon thread reads ``VmRSS`` (the whole process, mapped weights included) and ``RssAnon`` (what the process
allocated, as MeBP's authors measure it) from ``/proc/self/status``; the baseline is taken after the imports. Off
Linux only ``ru_maxrss`` is known.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import threading
from typing import Any, Iterator

_MiB = 1024


def peak_rss_mb() -> float:
    """Whole-process peak resident set size in MiB: ``VmHWM`` on Linux, else ``ru_maxrss`` (bytes on macOS).

    Not ``ru_maxrss`` on Linux: it keeps the resident size of the process that started this one (exec carries
    it over), so a small run started by a large process would report the large one's.
    """
    high_water = read_status().get("VmHWM")
    if high_water is not None:
        return high_water
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def read_status() -> dict[str, float]:
    """``RssAnon``, ``VmRSS`` and ``VmHWM`` of this process in MiB (``/proc/self/status``; empty off Linux)."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0]) / _MiB
    except OSError:
        pass
    return out


class RunMemory:
    """Peak ``VmRSS`` and ``RssAnon`` of the whole run, of each named phase (:meth:`phase`, for the summary) and of
    consecutive windows (:meth:`mark`, the memory benchmark's cuts of a step at block boundaries).

    Example::

        >>> memory = RunMemory(period_s=0.01)
        >>> with memory.phase("load"):
        ...     data = b"x" * (32 << 20)  # 32 MiB, every page written
        >>> memory.close()
        >>> 30 <= memory.summary()["phases"]["load"]["peak_anon_above_imports_mib"] < 64
        True
    """

    def __init__(self, period_s: float = 0.005) -> None:
        self.period_s = period_s
        self.baseline = read_status()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.peak_rss = self.peak_anon = self.window_anon = 0.0
        self._phase: str | None = None
        self.phases: dict[str, dict[str, float]] = {}
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="lcsb-run-memory", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def _sample(self) -> dict[str, float]:
        now = read_status()
        rss, anon = now.get("VmRSS", 0.0), now.get("RssAnon", 0.0)
        with self._lock:
            self.peak_rss, self.peak_anon = max(self.peak_rss, rss), max(self.peak_anon, anon)
            self.window_anon = max(self.window_anon, anon)
            if self._phase is not None:
                peaks = self.phases[self._phase]
                peaks["rss"], peaks["anon"] = max(peaks["rss"], rss), max(peaks["anon"], anon)
        return now

    def reset(self) -> None:
        """Start the overall peaks (and the window's) again from zero."""
        with self._lock:
            self.peak_anon = self.peak_rss = self.window_anon = 0.0

    def mark(self) -> tuple[float, float]:
        """``(peak RssAnon of the window just closed, RssAnon now)``, and a new window opened."""
        now = self._sample().get("RssAnon", 0.0)
        with self._lock:
            peak, self.window_anon = self.window_anon, now
        return peak, now

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the samples taken inside the block to phase ``name`` (phases do not nest)."""
        with self._lock:
            self._phase = name
            self.phases.setdefault(name, {"rss": 0.0, "anon": 0.0})
        self._sample()
        try:
            yield
        finally:
            self._sample()
            with self._lock:
                self._phase = None

    def close(self) -> None:
        self._sample()
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, Any]:
        """The figures ``summary.json`` keeps, in MiB: whole-process peak, peak anonymous memory above the
        imports, the state after the imports, and the same peaks per phase."""
        base_anon = self.baseline.get("RssAnon", 0.0)
        with self._lock:
            phases = {
                name: {"peak_rss_mib": round(p["rss"], 1), "peak_anon_above_imports_mib": round(p["anon"] - base_anon, 1)}
                for name, p in self.phases.items()
            }
            sampled, anon = self.peak_rss, self.peak_anon
        return {
            "peak_rss_mib": round(max(peak_rss_mb(), sampled), 1),
            "peak_anon_above_imports_mib": round(anon - base_anon, 1) if self.baseline else None,
            "after_imports_rss_mib": round(self.baseline.get("VmRSS", 0.0), 1),
            "after_imports_anon_mib": round(base_anon, 1),
            "phases": phases,
        }
