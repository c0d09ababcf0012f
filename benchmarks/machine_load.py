"""How busy the rest of the machine is, so a benchmark can wait for quiet and report what it shared."""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine since boot, from /proc/stat."""
    fields = [int(value) for value in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of one process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_and_children_cpu_seconds() -> float:
    """CPU seconds of this process plus its waited-for children."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


class LoadMeter:
    """Cores used by everything except `own_seconds()` while the `with` block ran: `foreign_cores`."""

    def __init__(self, own_seconds: Callable[[], float]) -> None:
        self.own_seconds = own_seconds
        self.foreign_cores = 0.0

    def __enter__(self) -> LoadMeter:
        self._start = (time.perf_counter(), cpu_jiffies(), self.own_seconds())
        return self

    def __exit__(self, *exc: object) -> None:
        wall0, (busy0, total0), own0 = self._start
        wall = max(time.perf_counter() - wall0, 1e-9)
        busy1, total1 = cpu_jiffies()
        machine_cores = (busy1 - busy0) / max(total1 - total0, 1) * (os.cpu_count() or 1)
        self.foreign_cores = max(machine_cores - (self.own_seconds() - own0) / wall, 0.0)


def wait_for_quiet(
    limit_cores: float,
    max_wait_seconds: float,
    own_seconds: Callable[[], float] = self_and_children_cpu_seconds,
    sample_seconds: float = 1.0,
) -> float:
    """Wait until others use under `limit_cores` over one sample (or time runs out); return their load."""
    deadline = time.monotonic() + max_wait_seconds
    announced = False
    while True:
        with LoadMeter(own_seconds) as meter:
            time.sleep(sample_seconds)
        if meter.foreign_cores < limit_cores or time.monotonic() >= deadline:
            return meter.foreign_cores
        if not announced:
            print(f"  waiting for a quiet machine (others use {meter.foreign_cores:.1f} cores)",
                  file=sys.stderr, flush=True)
            announced = True
        time.sleep(2.0)
