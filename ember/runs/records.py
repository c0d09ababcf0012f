"""The MLflow side of one job: its run (opened with what the job is: a single run or a sweep's job),
model tags, generation metrics and record."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ember.provenance import canonical_json
from ember.records.run import Record, open_run
from ember.records.store import MlflowSettings
from ember.records.sweep import handed_over_store, parent_run_id
from ember.runs.job import JobInfo


def open_job_record(settings: MlflowSettings | None, job: JobInfo, name: str,
                    tags: Mapping[str, Any]) -> Record:
    """The job's run, tagged with its place in its sweep and its overrides, a child of the sweep's parent
    run in the parent's store; a `NullRecord` when recording is off. Its params come next
    (`job_params`)."""
    job_tags = dict(tags)
    if job.multirun:
        job_tags.update({"ember.job": str(job.number), "ember.sweep_dir": str(job.sweep_dir)})
    job_tags["ember.overrides"] = " ".join(job.overrides)
    if not job.multirun:
        return open_run(settings, name, job_tags)
    return open_run(settings, name, job_tags, parent_run_id=parent_run_id(job.sweep_dir),
                    handed_over=handed_over_store())


def job_params(job: JobInfo, params: Mapping[str, Any]) -> dict[str, Any]:
    return {**params, "hydra.overrides": " ".join(job.overrides)}


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
