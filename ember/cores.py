"""How many threads to run when none were asked for: the cores this process may run on that other
processes leave free.

A thread whose core another process keeps busy can make the others wait for it. When decode ran on
numba's OpenMP threads (fixed halves, spinning at the barrier), 2 threads with the other core busy
decoded at 7–9 tokens/s where 1 thread decoded at 41–68 (SmolLM2, 2-core Xeon; README "How many
threads"). Every product now runs on ember's threads in small pieces (`ember.parallel`), so a late
thread holds back one piece, not the whole; whether a second thread on a busy core then gains is not
yet measured on a quiet machine, so the default still leaves busy cores alone. It looks before it
chooses: it reads the busy time of each allowed core from /proc/stat over a short window
(SAMPLE_SECONDS, once per process), subtracts this process's own, and counts a core as taken for every
MOSTLY_BUSY core's worth of time others used; when that leaves fewer threads than cores, the load says
so in one line on stderr (`announce`). An explicit `threads=N` is always obeyed. Where
there is no /proc/stat (not Linux), every allowed core counts as free.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SAMPLE_SECONDS = 0.2  # 20 jiffies a core at /proc/stat's 100 Hz: a core's busy share to ±5 %
MOSTLY_BUSY = 0.75  # others' use of at least this much of a core takes the core


@dataclass(frozen=True, slots=True)
class ThreadChoice:
    """How many threads, and why (the `ember.threads_reason` tag); `taken`: the cores the default left
    to other processes."""

    threads: int
    reason: str
    taken: int = 0


def allowed_cores() -> list[int]:
    """The CPUs this process may run on (its affinity, which SLURM and cgroups narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_times(text: str) -> dict[int, tuple[int, int]]:
    """{cpu: (busy, total) jiffies since boot} from the text of /proc/stat (idle and iowait are not
    busy)."""
    times = {}
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit():
            fields = [int(value) for value in rest.split()[:8]]
            idle = fields[3] + fields[4]
            times[int(name[3:])] = (sum(fields) - idle, sum(fields))
    return times


def others_load(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], cores: list[int],
                own_cores: float = 0.0) -> float:
    """Cores' worth of busy time on `cores` between two /proc/stat samples, less `own_cores` (this
    process's use over the same window). Summed over the cores, so a busy process the scheduler moves
    from core to core still counts as one."""
    busy = total = 0
    for core in cores:
        if core in before and core in after:
            busy += after[core][0] - before[core][0]
            total += after[core][1] - before[core][1]
    if total <= 0:
        return 0.0
    return max(0.0, busy / total * len(cores) - own_cores)


def choose(cores: int, load: float) -> ThreadChoice:
    """Threads for `cores` allowed cores when other processes keep `load` cores' worth busy."""
    taken = min(cores, int(load + 1.0 - MOSTLY_BUSY))
    free = max(1, cores - taken)
    if taken == 0:
        return ThreadChoice(free, f"all {cores} cores free at load")
    return ThreadChoice(free, f"{cores - taken} of {cores} cores free at load (other processes kept "
                              f"{load:.1f} cores busy)", taken)


def sample_load(cores: list[int], seconds: float = SAMPLE_SECONDS) -> float | None:
    """Others' load on `cores` over `seconds` (this thread sleeps meanwhile); None without /proc/stat."""
    stat = Path("/proc/stat")
    try:
        before, own_before, started = cpu_times(stat.read_text()), time.process_time(), time.perf_counter()
        time.sleep(seconds)
        after, own_after, wall = cpu_times(stat.read_text()), time.process_time(), time.perf_counter()
    except OSError:
        return None
    if not before:
        return None
    own = (own_after - own_before) / max(wall - started, 1e-9)
    return others_load(before, after, cores, own)


@cache
def free_cores() -> ThreadChoice:
    """The default: as many threads as the allowed cores others leave free, looked at once a process."""
    cores = allowed_cores()
    if len(cores) == 1:
        return ThreadChoice(1, "the one core this process may run on")
    load = sample_load(cores)
    if load is None:
        return ThreadChoice(len(cores), f"all {len(cores)} cores (no /proc/stat to see which are free)")
    return choose(len(cores), load)


def thread_choice(requested: int | None) -> ThreadChoice:
    """`requested` when given, else `free_cores()`."""
    if requested:
        return ThreadChoice(requested, "asked for")
    return free_cores()


@cache
def announce(choice: ThreadChoice) -> None:
    """Say once a process, in one line on stderr, that the default chose fewer threads than the cores
    and why (called as the model loads, so a run that fails before says nothing of threads)."""
    if choice.taken:
        cores = len(allowed_cores())
        plural = "s" if choice.threads > 1 else ""
        print(f"ember: {choice.threads} thread{plural}, not {cores}: {choice.reason}; set threads to "
              "choose", file=sys.stderr, flush=True)
