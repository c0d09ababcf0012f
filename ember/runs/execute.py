"""One job end to end: validate, load, generate, measure, record; an exit status, never a raw
traceback for a user's mistake."""

from __future__ import annotations

import os
import sys
import traceback

from mlflow.exceptions import MlflowException
from omegaconf import DictConfig, OmegaConf

from ember import tracking
from ember.errors import EmberError
from ember.experiments import ExperimentFailure
from ember.provenance import config_digest, environment_tags, flatten
from ember.runconfig import describe_error
from ember.runs import models
from ember.runs.checkpoint import Checkpoints
from ember.runs.effect import LogitsRecorder, measure_effect, record_effect
from ember.runs.job import JobInfo, threads_for
from ember.runs.prepare import Prepared, prepare
from ember.runs.records import Recorder, generation_metrics, generation_record, model_tags
from ember.runs.summary import experiment_summary
from ember.tracking import FAILED, FINISHED, KILLED

# Exit statuses.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def execute(cfg: DictConfig) -> int:
    """Run one job end to end; return its exit status. Never raises for a user's mistake."""
    job = JobInfo.from_hydra()
    if os.getcwd() not in sys.path:  # `_target_: experiments.my_module.MyExperiment` from here
        sys.path.insert(0, os.getcwd())
    where = f"job #{job.number} ({' '.join(job.overrides)}): " if job.multirun else ""
    try:
        prepared = prepare(cfg)
    except EmberError as error:
        say(f"ember: {where}{error}")
        _record_invalid_job(cfg, job, str(error))
        return EXIT_USAGE
    except Exception as error:  # a bug met while validating: say so, with the traceback
        detail = f"internal error while checking the config: {describe_error(error)}"
        say(f"ember: {where}{detail}\n{traceback.format_exc()}")
        _record_invalid_job(cfg, job, detail)
        return EXIT_FAILED

    threads = threads_for(job, prepared.run.threads)
    from threadpoolctl import threadpool_limits

    recorder = Recorder(prepared.run.mlflow, job)
    status, code, detail = FAILED, EXIT_FAILED, ""
    try:
        with threadpool_limits(threads):
            code, detail = _run_prepared(prepared, job, recorder, threads, where)
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
    except MlflowException as error:
        detail = f"MLflow ({recorder.settings.tracking_uri or 'default store'}): {error.message}"
        say(f"ember: {where}{detail}")
    except Exception as error:  # a bug, not a user mistake: keep the traceback in the record
        text = traceback.format_exc()
        detail = f"internal error: {describe_error(error)}"
        say(f"ember: {where}{detail}\n{text}")
        recorder.set_tags({"ember.error": describe_error(error)})
        recorder.log_text(text, "error.txt")
    finally:
        try:
            recorder.close(status)
            if recorder.last_run_id is not None:
                waiting = recorder.tracker.outbox_of(recorder.last_run_id) if recorder.tracker else None
                say(f"ember: {where}recorded as MLflow run {recorder.last_run_id} ({status}) in "
                    f"{recorder.store_uri}" + (f"; records waiting for it in {waiting}" if waiting else ""))
        except Exception as error:
            say(f"ember: {where}could not close the MLflow run as {status}: {describe_error(error)}")
            code = code or EXIT_FAILED
        finally:
            if job.multirun and job.output_dir is not None:
                tracking.write_job_status(job.output_dir, status, detail)
    return code


def _run_prepared(prepared: Prepared, job: JobInfo, recorder: Recorder, threads: int,
                  where: str) -> tuple[int, str]:
    """Load, generate, measure, record; (exit status, what went wrong)."""
    run = prepared.run
    tags = {**environment_tags(), **model_tags(prepared),
            "ember.config_digest": config_digest(prepared.plain),
            "ember.threads": str(threads), "ember.workers": str(job.workers),
            "ember.experiments": ",".join(e.name for e in prepared.experiments) or "none",
            "mlflow.source.git.commit": environment_tags()["ember.git_commit"], **tracking.SOURCE_TAGS}
    recorder.start(prepared.run_name, tags, flatten(prepared.plain))
    recorder.log_text(OmegaConf.to_yaml(OmegaConf.create(prepared.plain)), "config.yaml")

    model, cache_hit = models.cached_model(prepared.model_file, run.model.context_length, threads,
                                           run.model.weights)
    recorder.set_tags({"ember.model_cache": "hit" if cache_hit else "miss",
                       "model.context_length": str(model.context_length), "model.weights": model.weights})
    recorder.log_metrics([("model.load_seconds", 0.0 if cache_hit else model.load_seconds, 0),
                          ("model.first_load_seconds", model.load_seconds, 0)])

    recorder_experiment = LogitsRecorder() if prepared.effect_wanted else None
    experiments = prepared.experiments + ([recorder_experiment] if recorder_experiment else [])
    stream = None if job.multirun else (lambda piece: print(piece, end="", flush=True))
    failure: ExperimentFailure | None = None
    if stream is not None and run.messages is None:
        print(run.prompt, end="", flush=True)
    from ember.tracing import Tracer

    tracer = Tracer(layers=run.trace_layers) if run.tracing else None
    checkpoints = Checkpoints(recorder, prepared.prompt_ids, prepared.experiments, show=stream)
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
        record = tracking.failure_record(failure, generation)
        recorder.log_json(record, "failure.json")
        recorder.set_tags(tracking.failure_tags(record))
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


def _record_invalid_job(cfg: DictConfig, job: JobInfo, error: str) -> None:
    """In a sweep, a job that could not start still leaves a FAILED child run saying why."""
    if not job.multirun:
        return
    try:
        recorder = Recorder(tracking.settings_from_config(cfg), job)
        try:
            plain = OmegaConf.to_container(cfg, resolve=False)
        except Exception:
            plain = {}
        recorder.start(f"invalid config: {' '.join(job.overrides)}",
                       {**environment_tags(), **tracking.SOURCE_TAGS, "ember.error": error}, flatten(plain))
        recorder.close(FAILED)
    except Exception as failure:  # MLflow unreachable: the job status file still tells the sweep
        say(f"ember: job #{job.number}: could not record the failure in MLflow: {describe_error(failure)}")
    finally:
        if job.output_dir is not None:
            tracking.write_job_status(job.output_dir, FAILED, error)
