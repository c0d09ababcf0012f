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

os.environ.setdefault("MPLBACKEND", "Agg")  # figures are files; never open a window
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # records stay where the config says

import signal
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import numpy as np
from mlflow.exceptions import MlflowException
from omegaconf import DictConfig, OmegaConf

from ember import tracking
from ember.errors import EmberError
from ember.experiments import BUILTIN_EXPERIMENTS, Experiment, ExperimentFailure
from ember.provenance import canonical_json, config_digest, environment_tags, flatten
from ember.runconfig import (
    ExperimentSpec,
    RunConfig,
    build_experiments,
    check_model_fit,
    describe_error,
    parse_run_config,
    to_plain,
)
from ember.tracking import FAILED, FINISHED, KILLED

# Exit statuses.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

# Built-in experiments that only observe; any other experiment may write, unless its class says
# `may_write = False`.
OBSERVING_BUILTINS = frozenset({"activation_stats"})


# ------------------------------------------------------------------------------------ the job


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


# ------------------------------------------------------------------------------------ model cache

# Loaded models of this process, by (resolved file, context length): the jobs of a sweep run by the
# basic launcher (or by one joblib worker) load each model once.
_MODELS: dict[tuple[str, int | None], Any] = {}


def cached_model(model_file: Any, context_length: int | None, threads: int) -> tuple[Any, bool]:
    """(model, cache hit). The engine's own thread count follows this job's."""
    from ember.model import load_model

    key = (str(Path(model_file.path).resolve()), context_length)
    model = _MODELS.get(key)
    if model is not None:
        model.threads = threads
        return model, True
    from ember.progress import Progress

    with Progress.status(f"loading {Path(model_file.path).name}"):
        model = load_model(model_file, context_length=context_length, threads=threads)
    _MODELS[key] = model
    return model, False


# ------------------------------------------------------------------------------------ preparation


@dataclass(slots=True)
class Prepared:
    """A validated job: config, the model file and its metadata, the experiments, the prompt ids."""

    run: RunConfig
    plain: dict[str, Any]
    model_file: Any
    gguf: Any
    model_config: Any
    tokenizer: Any
    experiments: list[Any]
    prompt_ids: list[int]
    model_label: str
    run_name: str
    effect_wanted: bool = False
    tags: dict[str, str] = field(default_factory=dict)


def prepare(cfg: DictConfig) -> Prepared:
    """Validate everything a user can get wrong, reading only the model file's metadata."""
    from ember.config import config_from_gguf
    from ember.gguf_file import GGUFFile
    from ember.sources import resolve_model

    run = parse_run_config(cfg)
    plain = to_plain(cfg)
    model_file = resolve_model(run.model.source)
    cached = _MODELS.get((str(Path(model_file.path).resolve()), run.model.context_length))
    if cached is not None:
        gguf, model_config, tokenizer = cached.gguf, cached.config, cached.tokenizer
    else:
        from ember.tokenizer import Tokenizer

        gguf = GGUFFile.open(model_file.path)
        model_config = config_from_gguf(gguf)
        tokenizer = Tokenizer.from_gguf(gguf)
    family = getattr(model_config.family, "value", str(model_config.family))
    experiments = build_experiments(run.experiments, BUILTIN_EXPERIMENTS, model_config.layer_count)
    prompt_ids = prompt_token_ids(run, tokenizer)
    check_model_fit(
        run,
        path=str(model_file.path),
        architecture=model_config.architecture,
        family=family,
        layer_count=model_config.layer_count,
        context_length=model_config.context_length,
        prompt_token_count=len(prompt_ids),
    )
    label = model_label(run.model.source, model_file)
    effect_wanted = run.intervention_effect and any(may_write(e) for e in experiments)
    return Prepared(run, plain, model_file, gguf, model_config, tokenizer, experiments, prompt_ids, label,
                    run_name(run.experiments, experiments, label), effect_wanted)


def prompt_token_ids(run: RunConfig, tokenizer: Any) -> list[int]:
    """The prompt as token ids: raw text (tokenizer's BOS rule), or chat messages through the template."""
    if run.messages is not None:
        render = getattr(tokenizer, "apply_chat_template", None)
        if render is None:
            raise EmberError("this ember build cannot render chat templates yet: use prompt=... instead")
        rendered = render([dict(m) for m in run.messages], add_generation_prompt=True)
        ids = list(tokenizer.encode(rendered, parse_special=True))
        bos = tokenizer.bos_id
        if len(ids) >= 2 and ids[0] == ids[1] == bos:  # the template wrote BOS itself
            ids = ids[1:]
        return ids
    return list(tokenizer.encode(run.prompt or ""))


def may_write(experiment: Any) -> bool:
    declared = getattr(experiment, "may_write", None)
    if declared is not None:
        return bool(declared)
    return not (type(experiment).__module__.startswith("ember.experiments")
                and experiment.name in OBSERVING_BUILTINS)


def model_label(source: str, model_file: Any) -> str:
    if source.endswith(".gguf") or os.sep in source:
        return Path(str(model_file.path)).stem
    return source


def run_name(specs: Sequence[ExperimentSpec], experiments: Sequence[Any], label: str) -> str:
    """E.g. `zero_layer_output[layer=7] smollm2-135m`; `generate smollm2-135m` without experiments."""
    import inspect

    parts = []
    for spec, experiment in zip(specs, experiments, strict=True):
        defaults = {k: p.default for k, p in inspect.signature(type(experiment)).parameters.items()}
        shown = ",".join(f"{k}={_short(v)}" for k, v in spec.params.items()
                         if v is not None and k != "name" and not (k in defaults and defaults[k] == v))
        parts.append(f"{experiment.name}[{shown}]" if shown else str(experiment.name))
    return f"{'+'.join(parts) or 'generate'} {label}"


def _short(value: Any) -> str:
    text = canonical_json(value) if isinstance(value, list | dict) else str(value)
    return text if len(text) <= 40 else text[:39] + "…"


# ------------------------------------------------------------------------------------ effect


class LogitsRecorder(Experiment):
    """Internal observer placed after the user's experiments: keeps the logits each evaluation
    produced (after every intervention), to compare with the clean model afterwards."""

    name = "ember.intervened_logits"
    may_write = False

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []

    def after_logits(self, ctx: Any, logits: Any) -> None:
        self.rows.append(np.array(logits.values()[-1], dtype=np.float32))


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@dataclass(frozen=True, slots=True)
class InterventionEffect:
    kl: np.ndarray                 # [steps] KL(clean || intervened) of the next-token distributions
    top1_agree: np.ndarray         # [steps] bool: the greedy choices agree
    first_divergent_step: int      # -1: the greedy choices never differ

    @property
    def vacuous(self) -> bool:
        return bool(self.kl.size) and float(self.kl.max()) < 1e-6 and bool(self.top1_agree.all())

    def summary(self) -> dict[str, Any]:
        return {
            "steps": int(self.kl.size),
            "kl_mean": float(self.kl.mean()) if self.kl.size else 0.0,
            "kl_max": float(self.kl.max()) if self.kl.size else 0.0,
            "top1_agreement": float(self.top1_agree.mean()) if self.kl.size else 1.0,
            "first_divergent_step": self.first_divergent_step,
            "vacuous": self.vacuous,
            "kl": self.kl.tolist(),
            "top1_agree": self.top1_agree.astype(int).tolist(),
        }


def intervention_effect(clean: np.ndarray, intervened: np.ndarray) -> InterventionEffect:
    """Compare aligned rows of clean and intervened logits ([steps, V] each)."""
    clean_log = _log_softmax(clean)
    intervened_log = _log_softmax(intervened)
    kl = (np.exp(clean_log) * (clean_log - intervened_log)).sum(axis=-1)
    agree = clean.argmax(axis=-1) == intervened.argmax(axis=-1)
    differ = np.flatnonzero(~agree)
    return InterventionEffect(np.maximum(kl, 0.0), agree, int(differ[0]) if differ.size else -1)


def measure_effect(model: Any, prompt_ids: list[int], generated: list[int],
                   recorded: list[np.ndarray]) -> InterventionEffect | None:
    """One clean prefill over prompt + generated tokens; row P-1+s predicts generated token s."""
    steps = min(len(recorded), len(generated) + 1)
    if steps == 0:
        return None
    sequence = list(prompt_ids) + list(generated[: steps - 1])
    clean = model.logits(sequence)[len(prompt_ids) - 1 : len(prompt_ids) - 1 + steps]
    return intervention_effect(clean, np.stack(recorded[:steps]))


# ------------------------------------------------------------------------------------ recording


class Recorder:
    """The MLflow side of one job; every method is a no-op when tracking is off."""

    def __init__(self, settings: Any, job: JobInfo) -> None:
        self.settings = settings
        self.tracker: tracking.Tracker | None = None
        self.run_id: str | None = None
        self.job = job

    def start(self, name: str, tags: dict[str, Any], params: dict[str, Any]) -> None:
        if self.settings is None or not self.settings.enabled:
            return
        self.tracker = tracking.Tracker(tracking.resolve_store(self.settings), self.settings.experiment_name)
        parent = tracking.parent_run_id(self.job.sweep_dir) if self.job.multirun else None
        job_tags = dict(tags)
        if self.job.multirun:
            job_tags.update({"ember.job": str(self.job.number), "ember.sweep_dir": str(self.job.sweep_dir)})
        job_tags["ember.overrides"] = " ".join(self.job.overrides)
        self.run_id = self.tracker.start_run(name, job_tags, parent)
        self.tracker.log_params(self.run_id, {**params, "hydra.overrides": " ".join(self.job.overrides)})

    def __getattr__(self, method: str) -> Any:
        # tracker.<method>(run_id, ...) as self.<method>(...), doing nothing without a run
        def call(*args: Any, **kwargs: Any) -> None:
            if self.tracker is not None and self.run_id is not None:
                getattr(self.tracker, method)(self.run_id, *args, **kwargs)
        return call

    def result(self, name: str, result: Any) -> None:
        if self.tracker is not None and self.run_id is not None:
            tracking.log_experiment_result(self.tracker, self.run_id, name, result)

    def close(self, status: str) -> None:
        if self.tracker is not None and self.run_id is not None:
            self.tracker.end_run(self.run_id, status)
            self.run_id = None


def model_tags(prepared: Prepared) -> dict[str, str]:
    mf, cfg = prepared.model_file, prepared.model_config
    size = Path(mf.path).stat().st_size
    return {
        "model.name": str(getattr(mf, "name", "") or prepared.model_label),
        "model.path": str(mf.path),
        "model.sha256": str(mf.sha256 or prepared.gguf.sha256()),
        "model.size_bytes": str(size),
        "model.architecture": str(cfg.architecture),
        "model.family": str(getattr(cfg.family, "value", cfg.family)),
        "model.layer_count": str(cfg.layer_count),
        "model.quantization_mix": canonical_json(dict(sorted(prepared.gguf.quantization_mix().items()))),
        "model.origin": str(getattr(mf, "origin", "")),
    }


def generation_metrics(generation: Any) -> list[tuple[str, float, int]]:
    t = generation.timings
    return [
        ("tokens.prompt", len(generation.prompt_token_ids), 0),
        ("tokens.generated", len(generation.token_ids), 0),
        ("prefill.seconds", t.prefill_seconds, 0),
        ("decode.seconds", t.decode_seconds, 0),
        ("prefill.tokens_per_second", t.prefill_tokens_per_second, 0),
        ("decode.tokens_per_second", t.decode_tokens_per_second, 0),
    ]


def generation_record(generation: Any) -> dict[str, Any]:
    return {
        "text": generation.text,
        "prompt_token_ids": list(map(int, generation.prompt_token_ids)),
        "token_ids": list(map(int, generation.token_ids)),
        "stop_reason": generation.stop_reason,
        "complete": generation.complete,
    }


# ------------------------------------------------------------------------------------ one job


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
        say(f"ember: {where}interrupted; the run is recorded as KILLED")
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
            "mlflow.source.git.commit": environment_tags()["ember.git_commit"]}
    recorder.start(prepared.run_name, tags, flatten(prepared.plain))
    recorder.log_text(OmegaConf.to_yaml(OmegaConf.create(prepared.plain)), "config.yaml")

    model, cache_hit = cached_model(prepared.model_file, run.model.context_length, threads)
    recorder.set_tags({"ember.model_cache": "hit" if cache_hit else "miss",
                       "model.context_length": str(model.context_length)})
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
    try:
        generation = model.generate(
            prepared.prompt_ids, max_new_tokens=run.max_new_tokens, temperature=run.sampling.temperature,
            top_k=run.sampling.top_k, top_p=run.sampling.top_p, min_p=run.sampling.min_p,
            seed=run.sampling.seed, experiments=experiments, on_text=stream, tracer=tracer,
            stop_at_eog=run.stop_at_eog,
        )
    except ExperimentFailure as error:
        failure, generation = error, error.generation
    if stream is not None:
        print(flush=True)

    if generation is not None:
        recorder.log_metrics(generation_metrics(generation))
        recorder.log_json(generation_record(generation), "generation.json")
        recorder.log_text(generation.text, "generation.txt")
        for name, result in generation.experiment_results.items():
            if name != LogitsRecorder.name:
                recorder.result(name, result)
    if tracer is not None:
        recorder.log_json(tracer.to_json(), "trace.json")

    effect = None
    if recorder_experiment is not None and generation is not None:
        effect = measure_effect(model, generation.prompt_token_ids, generation.token_ids,
                                recorder_experiment.rows)
        if effect is not None:
            _record_effect(recorder, effect)

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
    if recorder.run_id is not None and recorder.tracker is not None:
        say(f"ember: recorded as MLflow run {recorder.run_id} in {recorder.tracker.store.tracking_uri}")
    return EXIT_OK, ""


def _record_effect(recorder: Recorder, effect: InterventionEffect) -> None:
    s = effect.summary()
    metrics = [("effect.kl", float(v), i) for i, v in enumerate(effect.kl)]
    metrics += [("effect.top1_agree", float(v), i) for i, v in enumerate(effect.top1_agree)]
    metrics += [("effect.kl_mean", s["kl_mean"], 0), ("effect.kl_max", s["kl_max"], 0),
                ("effect.top1_agreement", s["top1_agreement"], 0),
                ("effect.first_divergent_step", s["first_divergent_step"], 0)]
    recorder.log_metrics(metrics)
    recorder.log_json(s, "intervention_effect.json")
    verdict = "none: logits equal the clean model's" if effect.vacuous else (
        "changed greedy choices" if s["first_divergent_step"] >= 0 else "changed probabilities only")
    recorder.set_tags({"ember.intervention_effect": verdict})


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
                       {**environment_tags(), "ember.error": error}, flatten(plain))
        recorder.close(FAILED)
    except Exception as failure:  # MLflow unreachable: the job status file still tells the sweep
        say(f"ember: job #{job.number}: could not record the failure in MLflow: {describe_error(failure)}")
    finally:
        if job.output_dir is not None:
            tracking.write_job_status(job.output_dir, FAILED, error)


# ------------------------------------------------------------------------------------ entry point

_EXIT_CODES: list[int] = []


# conf/ sits next to the package in the source tree (an editable install runs from there).
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_task(cfg: DictConfig) -> int:
    code = execute(cfg)
    _EXIT_CODES.append(code)
    return code


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C so every open run is closed as KILLED."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    """Run Hydra with `argv` (default: the command line) and return the process exit status."""
    saved_argv = sys.argv
    if argv is not None:
        sys.argv = [sys.argv[0] if sys.argv else "ember.run", *argv]
    try:
        return _main()
    finally:
        sys.argv = saved_argv


def _main() -> int:
    _EXIT_CODES.clear()
    tracking.quiet_mlflow_logging()
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    started = time.perf_counter()
    try:
        _hydra_task()
    except KeyboardInterrupt:
        sweep = _close_open_sweep(interrupted=True)
        if sweep is not None:
            say("ember: sweep interrupted; its parent run is recorded as KILLED")
        return EXIT_INTERRUPTED
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
    sweep = _close_open_sweep(interrupted=False)
    if sweep is not None:
        return _report_sweep(sweep, started)
    return max(_EXIT_CODES) if _EXIT_CODES else EXIT_OK


def _report_sweep(sweep: tracking.SweepSummary, started: float) -> int:
    jobs = sweep.jobs or len(_EXIT_CODES)
    if not sweep.ok:
        say(f"ember: sweep finished with {len(sweep.failed_jobs)} failed job(s) of {jobs}:")
        for line in sweep.failed_jobs:
            say(f"  {line}")
        return EXIT_FAILED
    say(f"ember: sweep of {jobs} job(s) finished in {time.perf_counter() - started:.1f} s")
    return EXIT_OK


def _close_open_sweep(*, interrupted: bool) -> tracking.SweepSummary | None:
    """The sweep this process started: closed by the callback already, or closed here (Ctrl-C,
    a launcher crash)."""
    sweep_dir = tracking.active_sweep_dir()
    if sweep_dir is None:
        return None
    summary = tracking.last_sweep()
    if summary is None or interrupted:
        summary = tracking.finish_sweep(sweep_dir, interrupted=interrupted,
                                        error=None if interrupted else "the sweep stopped before its end")
    tracking.forget_active_sweep()
    return summary


if __name__ == "__main__":
    sys.exit(main())
