"""The MLflow side of one job: its run, model tags, generation metrics and record."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ember import tracking
from ember.provenance import canonical_json
from ember.runs.job import JobInfo


class Recorder:
    """The MLflow side of one job; every method is a no-op when tracking is off."""

    def __init__(self, settings: Any, job: JobInfo) -> None:
        self.settings = settings
        self.tracker: tracking.Tracker | None = None
        self.run_id: str | None = None
        self.last_run_id: str | None = None  # kept after close, for the console line naming the run
        self.store_uri = ""
        self.kept = ""  # what an interrupted job kept, for its console line
        self.job = job
        # Every metric this job logged, by name: its step-0 value, else its last (tracking on or off).
        self.metrics: dict[str, float] = {}
        self._metric_steps: dict[str, int] = {}

    def _remember(self, metrics: list[tuple[str, float, int]]) -> None:
        for name, value, step in metrics:
            known = self._metric_steps.get(name)
            if known is None or (known != 0 and (step == 0 or step >= known)):
                self.metrics[name] = float(value)
                self._metric_steps[name] = int(step)

    def log_metrics(self, metrics: Any) -> None:
        metrics = list(metrics)
        self._remember(metrics)
        if self.tracker is not None and self.run_id is not None:
            self.tracker.log_metrics(self.run_id, metrics)

    def start(self, name: str, tags: dict[str, Any], params: dict[str, Any]) -> None:
        if self.settings is None or not self.settings.enabled:
            return
        store = tracking.resolve_store(self.settings, sweep_job=self.job.multirun)
        self.tracker = tracking.Tracker(store, self.settings.experiment_name)
        parent = tracking.parent_run_id(self.job.sweep_dir) if self.job.multirun else None
        job_tags = dict(tags)
        if self.job.multirun:
            job_tags.update({"ember.job": str(self.job.number), "ember.sweep_dir": str(self.job.sweep_dir)})
        job_tags["ember.overrides"] = " ".join(self.job.overrides)
        self.run_id = self.last_run_id = self.tracker.start_run(name, job_tags, parent)
        self.store_uri = self.tracker.store.tracking_uri
        self.tracker.log_params(self.run_id, {**params, "hydra.overrides": " ".join(self.job.overrides)})

    def __getattr__(self, method: str) -> Any:
        # tracker.<method>(run_id, ...) as self.<method>(...), doing nothing without a run
        def call(*args: Any, **kwargs: Any) -> None:
            if self.tracker is not None and self.run_id is not None:
                getattr(self.tracker, method)(self.run_id, *args, **kwargs)
        return call

    def result(self, name: str, result: Any) -> None:
        self._remember([(f"{name}.{m.name}", m.value, m.step) for m in result.metrics
                        if isinstance(m.value, int | float)])
        if self.tracker is not None and self.run_id is not None:
            tracking.log_experiment_result(self.tracker, self.run_id, name, result)

    def close(self, status: str) -> None:
        if self.tracker is not None and self.run_id is not None:
            self.tracker.end_run(self.run_id, status)
            self.run_id = None


def model_tags(prepared: Any) -> dict[str, str]:
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
