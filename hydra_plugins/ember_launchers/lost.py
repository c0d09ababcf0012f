"""A job whose process died before it returned (killed, out of memory, node lost), as its sweeper
should see it. Shared by ember's Ray and submitit launchers."""

from __future__ import annotations

import logging
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from ember.console import EXIT_FAILED  # what a failed ember job returns

log = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
    """A job whose process died before it returned."""


def lost_job(number: int, overrides: list[str], job_config: Any, why: str) -> JobReturn:
    """The result of job `number`, whose process died (`why`, one line).

    A job of a search (it has an `objective`, as ember.runs.execute decides) returns its objective to
    the sweeper, so a lost one is a failed job, as a job of ember's that failed is: the Optuna sweeper
    records the trial as failed (TrialState.FAIL), never as a value. Any other job returns exit status
    1, as a failed ember job does, so the sweep goes on and names it at its end."""
    log.error(f"job #{number} ({' '.join(overrides)}): {why}")
    result = JobReturn(overrides=overrides, hydra_cfg=job_config)
    if OmegaConf.select(job_config, "objective", default=None) is not None:
        result.status = JobStatus.FAILED
        result.return_value = WorkerLost(f"job #{number}: {why}")
    else:
        result.status = JobStatus.COMPLETED
        result.return_value = EXIT_FAILED
    return result
