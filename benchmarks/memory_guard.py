"""Keep a benchmark worker from taking a shared machine down: estimate, budget, watch, kill, report.

An engine process that needs more memory than the machine has (an 8B model kept as float32 wants
~32 GB on a 24 GB machine) must not run the machine into its OOM killer, which may pick someone else's
process. So the harness

* estimates what the worker will hold resident and skips it when that exceeds the budget: the
  machine's MemAvailable now, less a reserve for everyone else;
* starts it under an address-space limit (RLIMIT_AS: the budget plus the mapped file plus slack for
  virtual reservations that are never touched), so a runaway allocation fails inside the worker;
* watches its resident set while it runs and kills it (SIGKILL) when it exceeds the budget or when the
  machine's MemAvailable falls under half the reserve (someone else grew meanwhile);
* reports a worker that died, by its signal (the kernel's OOM killer sends SIGKILL too) or by the
  watchdog's reason, as a failed measurement; the run goes on.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
# Virtual memory a worker reserves without touching it (thread stacks and malloc arenas, OpenBLAS
# buffers, LLVM, torch's libraries): measured well under 4 GiB; the limit allows twice that.
ADDRESS_SPACE_SLACK = 8 * GIB


def mem_available() -> int:
    """Bytes the kernel says can be allocated without swapping (`MemAvailable` in /proc/meminfo)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def rss_bytes(pid: int) -> int | None:
    """The process's resident set size now, or None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def address_space_limiter(limit_bytes: int | None) -> Callable[[], None] | None:
    """A preexec_fn setting RLIMIT_AS in the child (None: no limit)."""
    if limit_bytes is None:
        return None

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    return apply


@dataclass
class Outcome:
    returncode: int | None
    timed_out: bool
    killed_reason: str | None  # why the watchdog killed it, if it did
    peak_rss_seen: int  # the largest VmRSS the watchdog saw (a sample, not the kernel's peak)
    seconds: float

    def failure(self) -> str | None:
        """A one-line description of how the worker failed, or None if it exited normally."""
        if self.timed_out:
            return f"timed out after {self.seconds:.0f} s"
        if self.killed_reason:
            return f"killed by the harness: {self.killed_reason}"
        if self.returncode is not None and self.returncode < 0:
            name = signal.Signals(-self.returncode).name
            hint = " (the kernel's OOM killer sends SIGKILL)" if name == "SIGKILL" else ""
            return f"worker killed by {name}{hint}"
        if self.returncode:
            return f"worker exited with status {self.returncode}"
        return None


def run_watched(command: list[str], *, cwd: Path, env: dict[str, str], timeout: float,
                budget_bytes: int | None, reserve_bytes: int, stdout_path: Path, stderr_path: Path,
                address_space_bytes: int | None = None, interval: float = 0.1) -> Outcome:
    """Run `command`, sampling its RSS and the machine's MemAvailable every `interval` seconds."""
    started = time.monotonic()
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=err,
                                   preexec_fn=address_space_limiter(address_space_bytes))
        peak, reason, timed_out = 0, None, False
        while process.poll() is None:
            rss = rss_bytes(process.pid) or 0
            peak = max(peak, rss)
            if budget_bytes is not None and rss > budget_bytes:
                reason = f"resident {rss / GIB:.1f} GiB over its budget of {budget_bytes / GIB:.1f} GiB"
            elif mem_available() < reserve_bytes // 2:
                reason = (f"the machine's available memory fell under {reserve_bytes / 2 / GIB:.1f} GiB "
                          f"(worker resident {rss / GIB:.1f} GiB)")
            elif time.monotonic() - started > timeout:
                timed_out = True
            if reason or timed_out:
                process.kill()
                break
            time.sleep(interval)
        returncode = process.wait()
    return Outcome(returncode, timed_out, reason, peak, time.monotonic() - started)


def directory_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (0 if it does not exist)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total
