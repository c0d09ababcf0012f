"""`python -m ember.run`: the declarative front door (Hydra config in, MLflow records out).

    python -m ember.run                                         # default model, plain generation
    python -m ember.run experiment=zero_layer layer=7           # one intervention
    python -m ember.run -m experiment=zero_layer layer=0,1,2,3  # a sweep: one MLflow parent run
    python -m ember.run -m hydra/launcher=joblib layer=0,1,2,3 experiment=zero_layer   # in parallel

Each job: validate the whole config (types, experiments, layer range, lengths: the model file's
metadata is read, its weights are not), load the model (cached per process, so the jobs of a sweep
in one process pay the load once), generate with the experiments attached, measure the effect of
interventions against the clean model, and record everything in MLflow. A user mistake ends with
one readable message and exit status 2; a failed experiment with a FAILED run and status 1; a sweep
with failed jobs names them and exits 1.
"""

from __future__ import annotations

import os

os.environ.setdefault("MPLBACKEND", "Agg")  # figures are files; never open a window (before pyplot loads)

import signal
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from ember.console import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_TERMINATED, EXIT_USAGE, say
from ember.errors import EmberError, Terminated, raise_terminated
from ember.records.store import check_reachable, quiet_mlflow_logging
from ember.records.sweep import Sweep, SweepSummary
from ember.runs.execute import run_job
from ember.runs.overrides import describe_hydra_error, preflight
from ember.runs.sweep_callback import finish

# conf/hydra/launcher/{ray,submitit_local,submitit_slurm}.yaml keep the plugins' names on purpose
# (hydra/launcher=ray) and extend their schemas; Hydra warns about the name each shares with the plugin's
# own config on every composition.
warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/(ray|submitit_local|submitit_slurm)' is "
                        "validated against ConfigStore schema")

# ------------------------------------------------------------------------------------ entry point

_EXIT_CODES: list[int] = []


# conf/ sits next to the package in the source tree (an editable install runs from there).
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_task(cfg: DictConfig) -> Any:
    outcome = run_job(cfg)
    _EXIT_CODES.append(outcome.code)
    return outcome.for_sweeper()  # the exit status, or a search's objective


def main(argv: Sequence[str] | None = None) -> int:
    """Run Hydra with `argv` (default: the command line) and return the process exit status."""
    from ember.records.store import mlflow_environment

    mlflow_environment()
    if not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        os.environ.setdefault("NO_COLOR", "1")  # no ANSI colours in logs (Optuna's trial lines, colorlog's)
    saved_argv = sys.argv
    if argv is not None:
        sys.argv = [sys.argv[0] if sys.argv else "ember.run", *argv]
    try:
        return _main()
    finally:
        sys.argv = saved_argv


def _main() -> int:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    _EXIT_CODES.clear()
    quiet_mlflow_logging()
    try:
        for uri in preflight(sys.argv[1:], CONF_DIR, "config"):
            check_reachable(uri or os.environ.get("MLFLOW_TRACKING_URI") or "")
    except EmberError as error:
        say(f"ember: {error}")
        return EXIT_USAGE
    previous = signal.signal(signal.SIGTERM, raise_terminated)  # as Ctrl-C, exit 143
    started = time.perf_counter()
    # Hydra's own errors are raised to this function (not printed by Hydra) unless the user asked for
    # Hydra's full reports with HYDRA_FULL_ERROR.
    user_wants_hydra_reports = "HYDRA_FULL_ERROR" in os.environ
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        _hydra_task()
    except (HydraException, OmegaConfBaseException) as error:
        if user_wants_hydra_reports:
            raise
        say(f"ember: {describe_hydra_error(error, sys.argv[1:])}")
        _close_open_sweep(interrupted=False)
        return EXIT_USAGE
    except EmberError as error:  # e.g. the sweep's store, met when its parent run is made
        say(f"ember: {error}")
        _close_open_sweep(interrupted=False)
        return EXIT_USAGE
    except Exception as error:
        # A launcher's own crash (a joblib worker that died takes its pool down): the sweep is closed
        # FAILED and its jobs named, not left behind a traceback.
        if Sweep.opened_here() is None:
            raise
        text = str(error).strip().splitlines()
        say(f"ember: the sweep's launcher stopped: {type(error).__name__}: {text[0] if text else ''}")
        sweep = _close_open_sweep(interrupted=False)
        if sweep is not None:
            _report_sweep(sweep, started)
        return EXIT_FAILED
    except KeyboardInterrupt as interrupt:
        sweep = _close_open_sweep(interrupted=True)
        if sweep is not None:
            say("ember: sweep interrupted; its parent run is recorded as KILLED"
                + (f": MLflow run {sweep.run_id} in {sweep.tracking_uri}" if sweep.run_id else ""))
        return EXIT_TERMINATED if isinstance(interrupt, Terminated) else EXIT_INTERRUPTED
    except SystemExit as exit_:
        # Hydra's own errors (bad override syntax, unknown group, ...) and launcher crashes (a joblib
        # worker died): Hydra has printed what happened; a sweep that was under way is closed FAILED.
        code = exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
        sweep = _close_open_sweep(interrupted=False)
        if sweep is not None:
            _report_sweep(sweep, started)
            return code or EXIT_FAILED
        return code
    finally:
        signal.signal(signal.SIGTERM, previous)
        if not user_wants_hydra_reports:
            os.environ.pop("HYDRA_FULL_ERROR", None)
    sweep = _close_open_sweep(interrupted=False)
    if sweep is not None:
        return _report_sweep(sweep, started)
    return max(_EXIT_CODES) if _EXIT_CODES else EXIT_OK


def _report_sweep(sweep: SweepSummary, started: float) -> int:
    jobs = sweep.jobs or len(_EXIT_CODES)
    for line in sweep.retried_jobs:
        say(f"ember: {line}")
    if sweep.best:
        say(f"ember: best trial: {sweep.best}")
    where = (f"; parent MLflow run {sweep.run_id} in {sweep.tracking_uri}" if sweep.run_id else "")
    if not sweep.ok:
        ended = f"{sweep.error}, with" if sweep.error else "sweep finished with"
        say(f"ember: {ended} {len(sweep.failed_jobs)} failed job(s) of {jobs}{where}"
            + (":" if sweep.failed_jobs else ""))
        for line in sweep.failed_jobs:
            say(f"  {line}")
        return EXIT_FAILED
    say(f"ember: sweep of {jobs} job(s) finished in {time.perf_counter() - started:.1f} s{where}")
    return EXIT_OK


def _close_open_sweep(*, interrupted: bool) -> SweepSummary | None:
    """The sweep this process started: closed by the callback already, or closed here (Ctrl-C,
    a launcher crash)."""
    sweep = Sweep.opened_here()
    if sweep is None:
        return None
    summary = sweep.summary
    if summary is None or interrupted:
        summary = finish(sweep, interrupted=interrupted,
                         error=None if interrupted else "the sweep stopped before its end")
    sweep.forget()
    return summary


if __name__ == "__main__":
    sys.exit(main())
