"""One job end to end: validate, load, generate, measure, record; an exit status, never a raw
traceback for a user's mistake."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ember.console import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, say
from ember.cores import ThreadChoice
from ember.errors import EmberError
from ember.experiments import ExperimentFailure
from ember.provenance import config_digest, environment_tags, flatten
from ember.records.run import NullRecord, Record
from ember.records.store import describe_mlflow_error
from ember.records.sweep import write_job_status
from ember.records.tracker import FAILED, FINISHED, KILLED, SOURCE_TAGS
from ember.records.values import failure_record, failure_tags
from ember.runconfig import describe_error, settings_from_config
from ember.runs import models
from ember.runs.checkpoint import Checkpoints
from ember.runs.effect import LogitsRecorder, measure_effect, record_effect
from ember.runs.job import JobInfo, threads_for
from ember.runs.objective import Objective, TrialFailed, parse_objective, sweeper_direction
from ember.runs.prepare import Prepared, prepare
from ember.runs.records import generation_metrics, generation_record, job_params, model_tags, open_job_record
from ember.runs.summary import experiment_summary


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """How a job ended: its exit status and, for a job of a search, its objective."""

    code: int
    objective: float | None = None
    searching: bool = False

    def for_sweeper(self) -> Any:
        """What the job returns to its Hydra sweeper: the objective in a search (a failed job raises,
        so the search records a failed trial), else the exit status."""
        if not self.searching:
            return self.code
        if self.code != EXIT_OK or self.objective is None:
            raise TrialFailed(f"the job ended with exit status {self.code}")
        return self.objective


def run_job(cfg: DictConfig) -> JobOutcome:
    """Run one job end to end; its exit status and objective. Never raises for a user's mistake."""
    job = JobInfo.from_hydra()
    with in_launch_dir(job):
        return _execute(cfg, job)


@contextlib.contextmanager
def in_launch_dir(job: JobInfo) -> Iterator[None]:
    """Run the job from the folder its sweep was started in, when this process is elsewhere (a Ray
    worker starts in its raylet's folder) and that folder exists here (same machine, shared disk):
    relative model paths, `experiments/` and the default store then mean what they meant there."""
    here = os.getcwd()
    target = job.launch_dir
    if target is None or not target.is_dir() or Path(here) == target:
        yield
        return
    os.chdir(target)
    try:
        yield
    finally:
        os.chdir(here)


def _execute(cfg: DictConfig, job: JobInfo) -> JobOutcome:
    started = time.perf_counter()
    if os.getcwd() not in sys.path:  # `_target_: experiments.my_module.MyExperiment` from here
        sys.path.insert(0, os.getcwd())
    where = job.where()
    searching = OmegaConf.select(cfg, "objective", default=None) is not None
    try:
        objective = parse_objective(cfg, sweeper_direction())
        prepared = prepare(cfg)
    except EmberError as error:
        detail = _on_this_node(error, job)
        say(f"ember: {where}{detail}")
        _record_invalid_job(cfg, job, detail)
        return JobOutcome(EXIT_USAGE, searching=searching)
    except Exception as error:  # a bug met while validating: say so, with the traceback
        detail = f"internal error while checking the config: {describe_error(error)}"
        say(f"ember: {where}{detail}\n{traceback.format_exc()}")
        _record_invalid_job(cfg, job, detail)
        return JobOutcome(EXIT_FAILED, searching=searching)

    choice = threads_for(job, prepared.run.threads)
    threads = choice.threads
    from threadpoolctl import threadpool_limits

    recorder: Record = NullRecord()
    status, code, detail = FAILED, EXIT_FAILED, ""
    value = None
    try:
        with threadpool_limits(threads):
            recorder = _open_record(prepared, job, choice)
            code, detail = _run_prepared(prepared, job, recorder, choice, where)
            if code == EXIT_OK and objective is not None:
                code, detail, value = _record_objective(objective, recorder, where)
            status = FINISHED if code == EXIT_OK else FAILED
    except KeyboardInterrupt:
        status, code, detail = KILLED, EXIT_INTERRUPTED, "interrupted"
        say(f"\nember: {where}interrupted" + (f" ({recorder.kept})" if recorder.kept else ""))
        raise
    except EmberError as error:
        detail = str(error)
        say(f"ember: {where}{error}")
        recorder.set_tags({"ember.error": detail})
        code = EXIT_USAGE
    except Exception as error:
        if _from_mlflow(error):
            uri = recorder.store_uri or prepared.run.mlflow.tracking_uri
            detail = describe_mlflow_error(error, uri or "the default store")
            say(f"ember: {where}{detail}")
        else:  # a bug, not a user mistake: keep the traceback in the record
            text = traceback.format_exc()
            detail = f"internal error: {describe_error(error)}"
            say(f"ember: {where}{detail}\n{text}")
            recorder.set_tags({"ember.error": describe_error(error)})
            recorder.log_text(text, "error.txt")
    finally:
        try:
            # The whole job in this process, validation and loading included (a sweep's per-job cost).
            recorder.log_metrics([("job.seconds", time.perf_counter() - started, 0)])
            recorder.close(status)
            if recorder.last_run_id is not None:
                waiting = recorder.waiting()
                say(f"ember: {where}recorded as MLflow run {recorder.last_run_id} ({status}) in "
                    f"{recorder.store_uri}" + (f"; records waiting for it in {waiting}" if waiting else ""))
        except Exception as error:
            say(f"ember: {where}could not close the MLflow run as {status}: {describe_error(error)}")
            code = code or EXIT_FAILED
        finally:
            if job.multirun and job.output_dir is not None:
                write_job_status(job.output_dir, status, detail)
    return JobOutcome(code, value, searching=objective is not None)


def _from_mlflow(error: BaseException) -> bool:
    """An MlflowException, without importing MLflow (~130 MiB) where no record was made with it."""
    exceptions = sys.modules.get("mlflow.exceptions")
    return exceptions is not None and isinstance(error, exceptions.MlflowException)


def _record_objective(objective: Objective, recorder: Record, where: str) -> tuple[int, str, float | None]:
    """The job's objective from what it recorded, logged as the `objective` metric."""
    try:
        value, met = objective.evaluate(recorder.metrics)
    except TrialFailed as error:
        say(f"ember: {where}{error}")
        recorder.set_tags({"ember.error": str(error)})
        return EXIT_FAILED, str(error), None
    recorder.log_metrics([("objective", value, 0)])
    recorder.set_tags({"ember.objective.met": str(met).lower()})
    return EXIT_OK, "", value


def _open_record(prepared: Prepared, job: JobInfo, choice: ThreadChoice) -> Record:
    """The job's run, tagged with what it runs, where, and with what."""
    threads = choice.threads
    tags = {**environment_tags(), **model_tags(prepared),
            "ember.config_digest": config_digest(prepared.plain),
            "ember.threads": str(threads), "ember.threads_reason": choice.reason,
            "ember.workers": str(job.workers), **job.place.tags(),
            "ember.experiments": ",".join(e.name for e in prepared.experiments) or "none",
            "mlflow.source.git.commit": environment_tags()["ember.git_commit"], **SOURCE_TAGS}
    return open_job_record(prepared.run.mlflow, job, prepared.run_name, tags)


def _run_prepared(prepared: Prepared, job: JobInfo, recorder: Record, choice: ThreadChoice,
                  where: str) -> tuple[int, str]:
    """Load, generate, measure, record; (exit status, what went wrong)."""
    run = prepared.run
    recorder.log_params(job_params(job, run_params(prepared)))
    recorder.log_text(OmegaConf.to_yaml(OmegaConf.create(prepared.plain)), "config.yaml")

    model, cache_hit = models.cached_model(prepared.model_file, run.model.context_length, choice,
                                           run.model.weights)
    recorder.set_tags({"ember.model_cache": "hit" if cache_hit else "miss",
                       "model.context_length": str(model.context_length), "model.weights": model.weights})
    recorder.log_metrics([("model.load_seconds", 0.0 if cache_hit else model.load_seconds, 0),
                          ("model.first_load_seconds", model.load_seconds, 0)])
    if prepared.study is not None:
        return _run_study(prepared, model, recorder, job, where)

    recorder_experiment = LogitsRecorder() if prepared.effect_wanted else None
    experiments = prepared.experiments + ([recorder_experiment] if recorder_experiment else [])
    stream = None if job.multirun else (lambda piece: print(piece, end="", flush=True))
    failure: ExperimentFailure | None = None
    if stream is not None and run.messages is None:
        print(run.prompt, end="", flush=True)
    from ember.tracing import Tracer

    tracer = Tracer(layers=run.trace_layers) if run.tracing else None
    checkpoints = Checkpoints(recorder, prepared.prompt_ids, prepared.experiments,
                              show=stream)
    try:
        generation = model.generate(
            prepared.prompt_ids, max_new_tokens=run.max_new_tokens, temperature=run.sampling.temperature,
            top_k=run.sampling.top_k, top_p=run.sampling.top_p, min_p=run.sampling.min_p,
            seed=run.sampling.seed, experiments=experiments, on_text=checkpoints.on_text,
            on_token=checkpoints.on_token, tracer=tracer, stop_at_eog=run.stop_at_eog,
        )
    except ExperimentFailure as error:
        failure, generation = error, error.generation
    except KeyboardInterrupt:  # keep what was shown, and the experiments' results so far
        recorder.kept = f"after {len(checkpoints.token_ids)} generated tokens, kept in the run"
        checkpoints.write("interrupted")
        for experiment in prepared.experiments:
            try:
                recorder.result(str(experiment.name), experiment.results())
            except Exception:
                pass
        raise
    if stream is not None:
        print(flush=True)

    if generation is not None:
        recorder.log_metrics(generation_metrics(generation))
        recorder.log_json(generation_record(generation), "generation.json")
        recorder.log_text(generation.text, "generation.txt")
        for name, result in generation.experiment_results.items():
            if name != LogitsRecorder.name:
                recorder.result(name, result)
                say(f"ember: {where}{experiment_summary(name, result)}")
    if tracer is not None:
        recorder.log_json(tracer.to_json(), "trace.json")

    effect = None
    if recorder_experiment is not None and generation is not None:
        effect = measure_effect(model, generation.prompt_token_ids, generation.token_ids,
                                recorder_experiment.rows)
        if effect is not None:
            record_effect(recorder, effect)

    if failure is not None:
        record = failure_record(failure, generation)
        recorder.log_json(record, "failure.json")
        recorder.set_tags(failure_tags(record))
        produced = len(generation.token_ids) if generation is not None else 0
        say(f"ember: {where}{failure} (after {produced} generated tokens)")
        return EXIT_FAILED, str(failure)

    summary = f"{len(generation.token_ids)} tokens, {generation.timings.decode_tokens_per_second:.1f} tok/s"
    if effect is not None:
        s = effect.summary()
        summary += (f"; effect vs clean model: mean KL {s['kl_mean']:.4g}, top-1 agreement "
                    f"{s['top1_agreement']:.0%}, first divergent step {s['first_divergent_step']}")
        if effect.vacuous:
            summary += " (the intervention changed nothing)"
    if job.multirun:
        say(f"ember: {where}{prepared.run_name}: {generation.text!r} ({summary})")
    else:
        say(f"ember: {prepared.run_name}: {summary}")
    return EXIT_OK, ""


def run_params(prepared: Prepared) -> dict[str, object]:
    """The run's params: its resolved config, flattened; with a prompt set (`data`), without the
    `prompt` and `messages` it did not use (config.yaml keeps the config as resolved)."""
    params = flatten(prepared.plain)
    if prepared.run.data is not None:
        params = {k: v for k, v in params.items()
                  if k not in ("prompt", "messages") and not k.startswith("messages.")}
    return params


def _on_this_node(error: EmberError, job: JobInfo) -> str:
    """A missing model file on a worker the scheduler chose: say which node looked, and where."""
    from ember.errors import ModelSourceError

    if isinstance(error, ModelSourceError) and job.place.remote and "no such model file" in str(error):
        return (f"{error} (looked on node {job.place.host} in {os.getcwd()}; a local model path must exist "
                f"on every node that runs jobs, or use a known model name, fetched by each node)")
    return str(error)


def _run_study(prepared: Prepared, model: object, recorder: Record, job: JobInfo,
               where: str) -> tuple[int, str]:
    """A prompt set item by item (ember.runs.study); a failed experiment fails the run after the
    items done so far are recorded."""
    from ember.runs.study import Study

    show = None if job.multirun else (lambda text: print(text, flush=True))
    outcome = Study(prepared, model, recorder, say, show=show).run()
    for line in outcome.summary:
        say(f"ember: {where}{line}" if line is outcome.summary[0] else line)
    if outcome.failure is not None:
        say(f"ember: {where}{outcome.failure} (after {outcome.items_done} of "
            f"{len(prepared.study.items)} items)")
        recorder.set_tags(failure_tags(failure_record(outcome.failure, None)))
        return EXIT_FAILED, str(outcome.failure)
    return EXIT_OK, ""  # `recorded as MLflow run ...` is said once, when the run is closed


def _record_invalid_job(cfg: DictConfig, job: JobInfo, error: str) -> None:
    """In a sweep, a job that could not start still leaves a FAILED child run saying why."""
    if not job.multirun:
        return
    try:
        try:
            plain = OmegaConf.to_container(cfg, resolve=False)
        except Exception:
            plain = {}
        name = f"invalid config: {' '.join(job.overrides)}"
        recorder = open_job_record(settings_from_config(cfg), job, name,
                                   {**environment_tags(), **SOURCE_TAGS, "ember.error": error})
        recorder.log_params(job_params(job, flatten(plain)))
        recorder.close(FAILED)
    except Exception as failure:  # MLflow unreachable: the job status file still tells the sweep
        say(f"ember: job #{job.number}: could not record the failure in MLflow: {describe_error(failure)}")
    finally:
        if job.output_dir is not None:
            write_job_status(job.output_dir, FAILED, error)
