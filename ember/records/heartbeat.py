"""No run stays RUNNING after its process died: who runs a run, its heartbeat, and the repair of dead runs.

Every run ember opens carries tags saying which process runs it (`ember.host`, `ember.pid`,
`ember.process_start`, and `ember.pid_namespace`: the machine's boot id and the process's pid namespace,
so a pid is only compared where it means the same process), and `ember.heartbeat`, the time of the last
sign of life, refreshed by one background thread per process while the run is open.

`repair_dead_runs` closes, as KILLED, every RUNNING run whose process is gone, with its last heartbeat as
end time:
- a run of this machine and pid namespace is dead when its pid is free or now belongs to a process that
  started at another time (certain, immediate);
- a run of another machine (or container) is dead when its heartbeat is older than the stale limit
  (`EMBER_HEARTBEAT_TIMEOUT`, default 300 s; heartbeats every `EMBER_HEARTBEAT_SECONDS`, default 30 s).
Runs without these tags (not ember's, or older ember) are left alone.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

HOST, PID, PROCESS_START = "ember.host", "ember.pid", "ember.process_start"
PID_NAMESPACE, HEARTBEAT, REPAIRED = "ember.pid_namespace", "ember.heartbeat", "ember.repaired"


def interval_seconds() -> float:
    return float(os.environ.get("EMBER_HEARTBEAT_SECONDS", "30"))


def stale_seconds() -> float:
    return float(os.environ.get("EMBER_HEARTBEAT_TIMEOUT", "300"))


# ------------------------------------------------------------------------------------ identity


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    """Boot id and pid namespace: equal only where a pid names the same process table."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{_read('/proc/sys/kernel/random/boot_id')}:{namespace}"


def _start_time(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def now_text() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


def _epoch_ms(text: str) -> int | None:
    try:
        return int(dt.datetime.fromisoformat(text).timestamp() * 1000)
    except (TypeError, ValueError):
        return None


def process_tags() -> dict[str, str]:
    """The tags a new run gets: this process, and a first heartbeat."""
    started = _start_time(os.getpid())
    return {HOST: socket.gethostname(), PID: str(os.getpid()), PID_NAMESPACE: _pid_namespace(),
            PROCESS_START: f"{started:.2f}" if started is not None else "", HEARTBEAT: now_text()}


# ------------------------------------------------------------------------------------ heartbeat


class _Beater:
    """One daemon thread per process, refreshing `ember.heartbeat` of every open run."""

    def __init__(self) -> None:
        self.runs: dict[str, Any] = {}  # run id -> MlflowClient
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.owner_pid = 0

    def add(self, client: Any, run_id: str) -> None:
        with self.lock:
            self.runs[run_id] = client
            if self.thread is None or not self.thread.is_alive() or self.owner_pid != os.getpid():
                self.owner_pid = os.getpid()
                self.thread = threading.Thread(target=self._loop, name="ember-heartbeat", daemon=True)
                self.thread.start()

    def remove(self, run_id: str) -> None:
        with self.lock:
            self.runs.pop(run_id, None)

    def _loop(self) -> None:
        while True:
            time.sleep(interval_seconds())
            with self.lock:
                runs = list(self.runs.items())
            for run_id, client in runs:
                try:
                    client.set_tag(run_id, HEARTBEAT, now_text())
                except Exception:  # a store that is away: the next beat tries again
                    pass


_BEATER = _Beater()


def start(client: Any, run_id: str) -> None:
    """Keep `run_id`'s heartbeat fresh until `stop(run_id)`."""
    _BEATER.add(client, run_id)


def stop(run_id: str) -> None:
    _BEATER.remove(run_id)


# ------------------------------------------------------------------------------------ repair


@dataclass(frozen=True, slots=True)
class Repaired:
    run_id: str
    run_name: str
    experiment_id: str
    reason: str


def dead_reason(tags: dict[str, str], *, now_ms: int | None = None) -> str | None:
    """Why the process running a RUNNING run is gone, or None while it may be alive (or the run is not
    ember's)."""
    if PID not in tags:
        return None
    host, pid = tags.get(HOST, "?"), tags.get(PID, "?")
    beat = tags.get(HEARTBEAT, "")
    if host == socket.gethostname() and tags.get(PID_NAMESPACE) == _pid_namespace():
        try:
            started = _start_time(int(pid))
        except ValueError:
            started = None
        recorded = float(tags[PROCESS_START]) if tags.get(PROCESS_START) else None
        if started is None:
            return f"its process (pid {pid} on {host}) is gone"
        if recorded is not None and abs(started - recorded) > 1.0:
            return f"its process (pid {pid} on {host}) is gone (the pid now belongs to another process)"
        return None
    last = _epoch_ms(beat)
    now_ms = now_ms if now_ms is not None else int(dt.datetime.now(dt.UTC).timestamp() * 1000)
    if last is not None and now_ms - last > stale_seconds() * 1000:
        return f"no heartbeat from its process (pid {pid} on {host}) for {(now_ms - last) / 1000:.0f} s"
    return None


def close_dead_run(client: Any, run: Any, reason: str) -> None:
    """KILLED, with the last heartbeat as end time (never before the start: the first heartbeat is
    taken just before the run is created), and the reason as a tag."""
    known = [t for t in (_epoch_ms(run.data.tags.get(HEARTBEAT, "")), run.info.start_time) if t is not None]
    end = max(known) if known else None
    client.set_tag(run.info.run_id, REPAIRED, f"closed as KILLED by ember: {reason}")
    client.set_terminated(run.info.run_id, status="KILLED", end_time=end)


def running_runs(client: Any, experiment_ids: Iterable[str] | None = None) -> list[Any]:
    if experiment_ids is None:
        experiment_ids = [e.experiment_id for e in _all_experiments(client)]
    experiment_ids = list(experiment_ids)
    runs: list[Any] = []
    for start in range(0, len(experiment_ids), 100):  # stores cap the experiments per search
        token = None
        while True:
            page = client.search_runs(experiment_ids[start : start + 100],
                                      filter_string="attributes.status = 'RUNNING'",
                                      max_results=1000, page_token=token)
            runs.extend(page)
            token = page.token
            if not token:
                break
    return runs


def _all_experiments(client: Any) -> list[Any]:
    found, token = [], None
    while True:
        page = client.search_experiments(max_results=1000, page_token=token)
        found.extend(page)
        token = page.token
        if not token:
            return found


def repair_dead_runs(client: Any, experiment_ids: Iterable[str] | None = None) -> list[Repaired]:
    """Close every RUNNING run of the store (or of these experiments) whose process is gone."""
    repaired = []
    for run in running_runs(client, experiment_ids):
        reason = dead_reason(run.data.tags)
        if reason is None:
            continue
        close_dead_run(client, run, reason)
        repaired.append(Repaired(run.info.run_id, run.info.run_name or "", run.info.experiment_id, reason))
    return repaired
