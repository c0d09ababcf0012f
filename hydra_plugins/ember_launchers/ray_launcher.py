"""Hydra's Ray launcher (hydra-ray-launcher), waiting for every job of a sweep.

`hydra/launcher=ray` (conf/hydra/launcher/ray.yaml) selects `EmberRayLauncher`: it starts or joins Ray
and submits each job as a Ray task with the plugin's own functions (`start_ray`, `launch_job_on_ray`).
One thing differs. The plugin collects the jobs' results in order with `ray.get`, so when one job's
worker dies (killed, out of memory, node lost) and Ray has no retry left for it, the error leaves the
launcher at once, Hydra ends the sweep, and the jobs still running die with the driver. Here every job
is waited for; a job whose worker died comes back as failed, and the sweep names it (from its child
run, which `ember.records.sweep.Sweep.finish` closes as KILLED) while the others finish.

Retries are Ray's (`hydra.launcher.ray.remote.max_retries`; Ray retries only system failures, and
ember's jobs never raise for their own). A retried job runs from the start in a new worker as a new
child run; the run of the attempt that died is never written again, except to close it as KILLED.

Hydra imports every plugin module when it starts, with or without the `cluster` extra: nothing here
imports Ray or hydra-ray-launcher before a sweep uses this launcher.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, configure_log, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from hydra_plugins.ember_launchers.lost import lost_job

log = logging.getLogger(__name__)


class EmberRayLauncher(Launcher):
    """hydra-ray-launcher's launcher, waiting for every job (see the module docstring)."""

    def __init__(self, ray: DictConfig) -> None:
        self.ray_cfg = ray
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import ray
        from hydra_plugins.hydra_ray_launcher._launcher_util import launch_job_on_ray, start_ray

        assert self.config is not None and self.hydra_context is not None
        assert self.task_function is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        try:
            start_ray(self.ray_cfg.init)
        except Exception as error:
            raise _refused(error, self.ray_cfg.init) from None

        submitted = []
        for number, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{number} : {' '.join(filter_overrides(overrides))}")
            job_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(job_config):
                job_config.hydra.job.id = f"job_id_for_{number}"
                job_config.hydra.job.num = number
            task = launch_job_on_ray(self.hydra_context, self.ray_cfg.remote, job_config,
                                     self.task_function, Singleton.get_state())
            submitted.append((number, list(overrides), job_config, task))

        results = []
        for number, overrides, job_config, task in submitted:
            try:
                results.append(ray.get(task))
            except ray.exceptions.RayError as error:
                text = str(error).strip()
                first_line = text.splitlines()[0] if text else type(error).__name__
                results.append(lost_job(number, overrides, job_config, f"its Ray worker died: {first_line}"))
        return results


def _refused(error: Exception, init: Any) -> Exception:
    """Ray could not be started or joined: one line saying where and why (ember prints it, exit 2).

    A cluster with token authentication refuses a wrong or missing token with a ConnectionError
    ("Failed to connect ...", the reason only in Ray's own log lines), so the hint names the token."""
    import os

    from ember.errors import EmberError

    address = OmegaConf.select(init, "address", default=None) or os.environ.get("RAY_ADDRESS")
    text = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {text[0] if text else ''}"
    where = f"the Ray cluster at {address}" if address else "a Ray instance on this machine"
    hint = ""
    if isinstance(error, ConnectionError) or type(error).__name__ == "AuthenticationError":
        hint = ("; a cluster with token authentication wants its token in RAY_AUTH_TOKEN (or "
                "RAY_AUTH_TOKEN_PATH) with RAY_AUTH_MODE=token")
    return EmberError(f"could not join {where} ({reason}){hint}")

