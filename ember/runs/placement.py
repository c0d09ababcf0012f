"""Where a job runs and what its scheduler granted it: host, process, scheduler ids, CPUs.

A job learns this from its own process, never from the driver: a Ray task asks Ray's runtime
context, a SLURM task reads the variables SLURM sets, a submitit local job the ones submitit sets.
The CPU count is what the engine's BLAS threads are set to, so that the jobs a scheduler packs onto a
node never ask for more threads than the node has cores.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field

# Schedulers a job can find itself under.
LOCAL, JOBLIB, RAY, SLURM, SUBMITIT_LOCAL = "local", "joblib", "ray", "slurm", "submitit_local"


@dataclass(frozen=True, slots=True)
class Placement:
    """One job's place: its scheduler, host, process, scheduler ids and granted CPUs."""

    scheduler: str
    host: str
    pid: int
    cpus: int
    ids: dict[str, str] = field(default_factory=dict)

    @property
    def remote(self) -> bool:
        """True when a cluster scheduler (not this command's own process or joblib) placed the job."""
        return self.scheduler in (RAY, SLURM, SUBMITIT_LOCAL)

    def tags(self) -> dict[str, str]:
        """MLflow tags: `ember.host`, `ember.pid`, `ember.scheduler`, `ember.scheduler.<id>`..."""
        tags = {"ember.host": self.host, "ember.pid": str(self.pid), "ember.scheduler": self.scheduler,
                "ember.scheduler.cpus": str(self.cpus)}
        tags.update({f"ember.scheduler.{key}": value for key, value in self.ids.items()})
        return tags


def cores() -> int:
    """The cores this process may run on (its CPU affinity, which SLURM and cgroups narrow)."""
    from ember.model import default_threads

    return default_threads()


def detect(*, joblib_workers: int = 1, sweep_size: int | None = None) -> Placement:
    """This process's placement. `joblib_workers`: how many joblib workers share this machine;
    `sweep_size`: how many jobs a submitit local sweep starts at once."""
    host, pid = socket.gethostname(), os.getpid()
    ray_ids = _ray_worker()
    if ray_ids is not None:
        granted, ids = ray_ids
        return Placement(RAY, host, pid, max(1, int(granted)), ids)
    env = os.environ
    if env.get("SLURM_JOB_ID"):
        ids = {key: env[var] for key, var in (
            ("job_id", "SLURM_JOB_ID"), ("array_job_id", "SLURM_ARRAY_JOB_ID"),
            ("array_task_id", "SLURM_ARRAY_TASK_ID"), ("task_id", "SLURM_PROCID"),
            ("node", "SLURMD_NODENAME")) if env.get(var)}
        granted = _positive_int(env.get("SLURM_CPUS_PER_TASK")) or cores()
        return Placement(SLURM, host, pid, min(granted, cores()), ids)
    if env.get("SUBMITIT_EXECUTOR") == "local":
        # submitit's local executor starts every job of a sweep at once and grants no CPUs of its
        # own: the cores are shared out among the jobs running together.
        together = max(1, min(sweep_size or 1, cores()))
        return Placement(SUBMITIT_LOCAL, host, pid, max(1, cores() // together),
                         {"job_id": env.get("SUBMITIT_LOCAL_JOB_ID", "")})
    if joblib_workers > 1:
        return Placement(JOBLIB, host, pid, max(1, cores() // joblib_workers), {})
    return Placement(LOCAL, host, pid, cores(), {})


def _positive_int(text: str | None) -> int | None:
    try:
        value = int(str(text))
    except ValueError:
        return None
    return value if value > 0 else None


def _ray_worker() -> tuple[float, dict[str, str]] | None:
    """(CPUs granted, ids) when this process is a Ray worker running a task; None otherwise.

    Ray is looked at only if this process has imported it already (a Ray worker has)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    if context.worker.mode != ray._private.worker.WORKER_MODE:
        return None  # the driver
    granted = context.get_assigned_resources().get("CPU", 1.0)
    ids = {"job_id": context.get_job_id(), "task_id": context.get_task_id() or "",
           "node_id": context.get_node_id(), "worker_id": context.get_worker_id()}
    return granted, ids
