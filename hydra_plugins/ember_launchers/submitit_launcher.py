"""Hydra's submitit launchers (hydra-submitit-launcher), waiting for every job of a sweep.

`hydra/launcher=submitit_local` and `submitit_slurm` (conf/hydra/launcher/) select these launchers: the
plugin's, with one thing changed. The plugin collects the jobs' results in order with `job.results()`,
which raises for a job whose process died (SIGKILL, out of memory, a lost node, a cancelled SLURM task):
the error leaves the launcher at once, the sweep ends as "the sweep's launcher stopped" naming no job,
and the jobs still running are not awaited (a submitit job outlives the command that submitted it, so
they go on recording into a parent run already closed). Here every job is waited for; a job whose
process died comes back as failed (ember_launchers.lost), and the sweep names it (from its child run,
which `ember.records.sweep.Sweep.finish` closes as KILLED) while the others finish.

Submitting is the plugin's own: its launcher object (what each job unpickles and calls), its
parameters, its executor. Hydra imports every plugin module when it starts, with or without the
`cluster` extra: nothing here imports submitit or the plugin before a sweep uses these launchers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, filter_overrides
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from hydra_plugins.ember_launchers.lost import lost_job

log = logging.getLogger(__name__)


class _EmberSubmititLauncher(Launcher):
    plugin_class = ""  # the plugin's launcher: LocalLauncher or SlurmLauncher

    def __init__(self, **params: Any) -> None:
        from hydra_plugins.hydra_submitit_launcher import submitit_launcher

        self.plugin = getattr(submitit_launcher, self.plugin_class)(**params)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.plugin.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from submitit.core.utils import FailedJobError, UncompletedJobError

        plugin = self.plugin
        assert plugin.config is not None and plugin.hydra_context is not None
        executor = self._executor()
        sweep_dir = Path(str(plugin.config.hydra.sweep.dir))
        log.info(f"Submitit '{plugin._EXECUTOR}' sweep output dir : {sweep_dir}")
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in plugin.config.hydra.sweep:
            sweep_dir.chmod(int(str(plugin.config.hydra.sweep.mode), 8))
        numbers = list(range(initial_job_idx, initial_job_idx + len(job_overrides)))
        overrides = [list(o) for o in job_overrides]
        for number, job_override in zip(numbers, overrides, strict=True):
            log.info(f"\t#{number} : {' '.join(filter_overrides(job_override))}")
        count = len(numbers)
        jobs = executor.map_array(plugin, overrides, ["hydra.sweep.dir"] * count, numbers,
                                  [f"job_id_for_{n}" for n in numbers], [Singleton.get_state()] * count)
        results = []
        for number, job_override, job in zip(numbers, overrides, jobs, strict=True):
            try:
                results.append(job.results()[0])
            except (UncompletedJobError, FailedJobError) as error:
                text = str(error).strip().splitlines()
                why = f"its submitit job {job.job_id} died: {text[0] if text else type(error).__name__}"
                job_config = plugin.hydra_context.config_loader.load_sweep_config(plugin.config, job_override)
                with open_dict(job_config):
                    job_config.hydra.job.num = number
                results.append(lost_job(number, job_override, job_config, why))
        return results

    def _executor(self) -> Any:
        """The plugin's executor, made from its parameters as the plugin makes it."""
        import submitit
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

        name, params = self.plugin._EXECUTOR, self.plugin.params
        init = {"folder": params["submitit_folder"]}
        if "max_num_timeout" in params:
            init[f"{name}_max_num_timeout"] = params["max_num_timeout"]
        executor = submitit.AutoExecutor(cluster=name, **init)
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{key if key in shared else f"{name}_{key}": value
                                      for key, value in params.items()
                                      if key not in ("submitit_folder", "max_num_timeout")})
        return executor


class EmberSubmititLocalLauncher(_EmberSubmititLauncher):
    """hydra/launcher=submitit_local: every job a process on this machine, all started at once."""

    plugin_class = "LocalLauncher"


class EmberSubmititSlurmLauncher(_EmberSubmititLauncher):
    """hydra/launcher=submitit_slurm: every job a SLURM array task."""

    plugin_class = "SlurmLauncher"
