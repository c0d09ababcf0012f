"""Where a job sits: a single run or one job of a sweep, under which launcher, with how many threads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf


@dataclass(frozen=True, slots=True)
class JobInfo:
    """Where this job sits: a single run or job `number` of a sweep, and how many run at once."""

    multirun: bool
    number: int | None
    overrides: tuple[str, ...]
    output_dir: Path | None
    sweep_dir: Path | None
    workers: int

    @classmethod
    def from_hydra(cls) -> JobInfo:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():
            return cls(False, None, (), None, None, 1)
        hc = HydraConfig.get()
        multirun = hc.mode == RunMode.MULTIRUN
        launcher = str(OmegaConf.select(hc, "launcher._target_", default="") or "")
        workers = 1
        if "joblib" in launcher.lower():
            workers = _joblib_workers(OmegaConf.select(hc, "launcher.n_jobs", default=-1))
        return cls(
            multirun=multirun,
            number=int(hc.job.num) if multirun else None,
            overrides=tuple(str(o) for o in hc.overrides.task),
            output_dir=Path(hc.runtime.output_dir),
            sweep_dir=Path(hc.sweep.dir).resolve() if multirun else None,
            workers=workers,
        )


def _joblib_workers(n_jobs: Any) -> int:
    """joblib's meaning of n_jobs: positive = that many, -1 = all cores, -2 = all but one, ..."""
    from ember.model import default_threads

    cores = default_threads()
    try:
        n = int(n_jobs)
    except (TypeError, ValueError):
        return cores
    if n > 0:
        return n
    return max(1, cores + 1 + n)


def threads_for(job: JobInfo, requested: int | None) -> int:
    """`threads` from the config, else the cores shared out among the parallel workers."""
    if requested:
        return requested
    from ember.model import default_threads

    return max(1, default_threads() // max(1, job.workers))
