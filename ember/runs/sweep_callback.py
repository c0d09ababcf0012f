"""The Hydra side of a sweep: `SweepCallback` reads the sweep's config and hands it to
`ember.records.sweep.Sweep` (start, hand over to the jobs, finish), and prints one progress line a job.

The parent run's id reaches every job (in this process or a joblib worker) through the environment
and through `mlflow_sweep.json` in the sweep folder. At the end the parent is FINISHED if every child
finished, FAILED otherwise, with the failed jobs named in a tag (and by `ember.run` on stderr, with exit
status 1).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf, open_dict

from ember.console import EXIT_FAILED, EXIT_USAGE, say
from ember.errors import EmberError
from ember.records.store import describe_mlflow_error, resolve_store
from ember.records.sweep import Sweep, SweepSummary, handed_over_size
from ember.runconfig import settings_from_config


def summarize(records: Any, experiment_id: str, parent_run_id: str) -> None:
    """The parent's summary of its children (`ember.studies.summary`), written through `records`."""
    from ember.studies.summary import summarize_sweep

    summarize_sweep(records, experiment_id, parent_run_id)


def finish(sweep: Sweep, *, interrupted: bool = False, error: str | None = None,
           all_returned: bool = False) -> SweepSummary:
    """Close the sweep, its parent summarizing its children."""
    return sweep.finish(interrupted=interrupted, error=error, all_returned=all_returned, summarize=summarize)


class SweepCallback(Callback):
    """One MLflow parent run per sweep: created before the first job, closed after the last."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        # Hydra turns a callback's exception into a warning and goes on; a sweep without its parent
        # run or its hand-over would record unlinked runs, so it stops here, before any job.
        try:
            sweep = start(config, _sweep_size(config))
            hand_over_to_jobs(config, sweep)
        except EmberError as error:  # the store refused or is away: one line, no job started, status 2
            say(f"ember: {error}")
            raise SystemExit(EXIT_USAGE) from None
        except Exception as error:
            from mlflow.exceptions import MlflowException

            settings = settings_from_config(config)
            uri = resolve_store(settings).tracking_uri if settings else "the configured store"
            text = describe_mlflow_error(error, uri) if isinstance(error, MlflowException) else (
                f"{type(error).__name__}: {error}")
            say(f"ember: could not start the sweep: {text}")
            raise SystemExit(EXIT_FAILED) from None

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        # Progress of a sweep, one plain line per job: readable on a terminal, in CI logs, and from
        # joblib workers alike (a bar would be torn apart by the jobs' own output).
        number = OmegaConf.select(config, "hydra.job.num", default=None)
        if number is None:
            return
        overrides = " ".join(_task_overrides(config))
        say(f"ember: sweep job {int(number) + 1}/{handed_over_size() or '?'}: {overrides}")

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        finish(Sweep(str(config.hydra.sweep.dir)), all_returned=True)


def start(config: Any, size: int | None = None) -> Sweep:
    """The sweep of this Hydra config: its folder and its parent run (when recording is on). `size`: how
    many jobs the sweep will have, when known."""
    sweeper = str(OmegaConf.select(config, "hydra.sweeper._target_", default="") or "")
    search = None
    if "optuna" in sweeper.lower():  # a search: the best trial is tagged on the parent at the end
        search = str(OmegaConf.select(config, "hydra.sweeper.direction", default="minimize"))
    return Sweep.start(str(config.hydra.sweep.dir), settings_from_config(config), name=_sweep_name(config),
                       overrides=_task_overrides(config),
                       launcher=str(OmegaConf.select(config, "hydra.launcher._target_", default="") or ""),
                       search=search, size=size)


def hand_over_to_jobs(config: Any, sweep: Sweep) -> None:
    """Give every job of the sweep what it needs from this process, wherever the launcher runs it.

    A job's config is composed again from the sweep's Hydra overrides (in this process for Ray and
    joblib, in the job's own process for submitit), and a job on another node shares neither this
    process's environment nor its disk. So the parent run id, the store it lives in and the sweep size
    travel as `hydra.job.env_set` overrides (Hydra sets them around the job), and a relative sweep
    folder is made absolute (a Ray worker's working directory is its raylet's, not this one).
    """
    overrides = OmegaConf.select(config, "hydra.overrides.hydra", default=None)
    if overrides is None:
        return
    added = [f"++hydra.job.env_set.{key}={_override_value(value)}"
             for key, value in sweep.job_environment().items()]
    sweep_dir = str(OmegaConf.select(config, "hydra.sweep.dir"))
    if not os.path.isabs(sweep_dir):
        added.append(f"hydra.sweep.dir={_override_value(str(Path(sweep_dir).resolve()))}")
    with open_dict(config.hydra.overrides):
        config.hydra.overrides.hydra = [str(o) for o in overrides] + added


def _override_value(value: str) -> str:
    """`value` as a quoted Hydra override value (quotes and interpolations escaped)."""
    escaped = value.replace("'", "\\'").replace("${", "\\${")
    return f"'{escaped}'"


def _task_overrides(config: Any) -> list[str]:
    return [str(o) for o in OmegaConf.select(config, "hydra.overrides.task", default=[]) or []]


def _sweep_name(config: Any) -> str:
    source = OmegaConf.select(config, "model.source", default="?")
    label = Path(str(source)).stem if str(source).endswith(".gguf") else str(source)
    return f"sweep[{' '.join(_task_overrides(config))}] {label}"


def _sweep_size(config: Any) -> int | None:
    """How many jobs the sweep will make: the Optuna sweeper's trials, else the product of the sweep
    overrides' choices (the basic sweeper)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    sweeper = str(OmegaConf.select(config, "hydra.sweeper._target_", default="") or "")
    if "optuna" in sweeper.lower():
        trials = OmegaConf.select(config, "hydra.sweeper.n_trials", default=None)
        return int(trials) if trials else None
    try:
        size = 1
        for override in OverridesParser.create().parse_overrides(_task_overrides(config)):
            if override.is_sweep_override():
                size *= len(list(override.sweep_string_iterator()))
        return size
    except Exception:  # an exotic sweep (ranges, custom sweepers): progress then shows "?"
        return None
