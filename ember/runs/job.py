"""Where a job sits: a single run or one job of a sweep, under which launcher, with how many threads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ember.cores import ThreadChoice, free_cores, thread_choice
from ember.records.sweep import handed_over_size
from ember.runs import placement
from ember.runs.placement import Placement


@dataclass(frozen=True, slots=True)
class JobInfo:
    """Where this job sits: a single run or job `number` of a sweep, how many run at once, and where
    its scheduler placed it."""

    multirun: bool
    number: int | None
    overrides: tuple[str, ...]
    output_dir: Path | None
    sweep_dir: Path | None
    workers: int
    place: Placement = field(default_factory=placement.detect)
    # The folder the sweep was started from (Hydra's runtime.cwd), when the job runs elsewhere.
    launch_dir: Path | None = None

    @classmethod
    def from_hydra(cls) -> JobInfo:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():
            return cls(False, None, (), None, None, 1)
        hc = HydraConfig.get()
        multirun = hc.mode == RunMode.MULTIRUN
        launcher = str(OmegaConf.select(hc, "launcher._target_", default="") or "")
        joblib_workers = 1
        if "joblib" in launcher.lower():
            joblib_workers = _joblib_workers(OmegaConf.select(hc, "launcher.n_jobs", default=-1))
        size = _positive_int(handed_over_size())
        place = placement.detect(joblib_workers=joblib_workers, sweep_size=size)
        cwd = OmegaConf.select(hc, "runtime.cwd", default=None)
        return cls(
            multirun=multirun,
            number=int(hc.job.num) if multirun else None,
            overrides=tuple(str(o) for o in hc.overrides.task),
            output_dir=Path(hc.runtime.output_dir),
            sweep_dir=Path(hc.sweep.dir).resolve() if multirun else None,
            workers=joblib_workers if place.scheduler == placement.JOBLIB else 1,
            place=place,
            launch_dir=Path(cwd) if cwd else None,
        )

    def where(self) -> str:
        """How messages name this job: `job #3 (layer=3): ` in a sweep (`job #3 on node-7 (...)` when a
        scheduler placed it), nothing for a single run."""
        if not self.multirun:
            return ""
        on = f" on {self.place.host}" if self.place.remote else ""
        return f"job #{self.number}{on} ({' '.join(self.overrides)}): "


def _positive_int(text: Any) -> int | None:
    try:
        value = int(str(text))
    except ValueError:
        return None
    return value if value > 0 else None


def _joblib_workers(n_jobs: Any) -> int:
    """joblib's meaning of n_jobs: positive = that many, -1 = all cores, -2 = all but one, ..."""
    cores = placement.cores()
    try:
        n = int(n_jobs)
    except (TypeError, ValueError):
        return cores
    if n > 0:
        return n
    return max(1, cores + 1 + n)


def threads_for(job: JobInfo, requested: int | None) -> ThreadChoice:
    """`threads` from the config, else the CPUs the job's scheduler granted it: for a run of its own the
    cores other processes leave free (`ember.cores`), a share of them for a joblib worker or a submitit
    local job, Ray's `num_cpus` for a Ray task, the allocation for a SLURM task."""
    if requested:
        return thread_choice(requested)
    if job.place.scheduler == placement.LOCAL:
        return free_cores()
    return ThreadChoice(job.place.cpus, f"granted by {job.place.scheduler}")
