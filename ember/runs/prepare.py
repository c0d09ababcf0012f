"""Everything a user can get wrong about a job, checked before any weight is read."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ember.errors import EmberError
from ember.experiments import BUILTIN_EXPERIMENTS
from ember.experiments.context import ModelContext
from ember.provenance import canonical_json
from ember.runconfig import (
    ExperimentSpec,
    RunConfig,
    build_experiments,
    check_model_fit,
    parse_run_config,
    to_plain,
)
from ember.runs import models
from ember.runs.study_plan import plan_study

# Built-in experiments that only observe; any other experiment may write, unless its class says
# `may_write = False`.
OBSERVING_BUILTINS = frozenset({"activation_stats"})


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
    study: Any = None  # ember.runs.study_plan.StudyPlan: the prompt set this job evaluates item by item


def prepare(cfg: DictConfig) -> Prepared:
    """Validate everything a user can get wrong, reading only the model file's metadata."""
    from ember.families import config_from_gguf
    from ember.gguf_file import GGUFFile
    from ember.sources import resolve_model

    run = parse_run_config(cfg)
    plain = to_plain(cfg)
    model_file = resolve_model(run.model.source)
    loaded = models.cached(model_file, run.model.context_length, run.model.weights)
    if loaded is not None:
        gguf, model_config, tokenizer = loaded.gguf, loaded.config, loaded.tokenizer
    else:
        from ember.tokenizer import Tokenizer

        gguf = GGUFFile.open(model_file.path)
        model_config = config_from_gguf(gguf)
        tokenizer = Tokenizer.from_gguf(gguf)
    family = getattr(model_config.family, "value", str(model_config.family))
    experiments = build_experiments(run.experiments, BUILTIN_EXPERIMENTS, model_config.layer_count)
    check_against_model(experiments, ModelContext.from_config(model_config, model_id=model_file.name))
    context = min(run.model.context_length or model_config.context_length, model_config.context_length)
    study = plan_study(run, experiments, tokenizer, model_config.layer_count, context)
    prompt_ids = study.items[0].token_ids if study is not None else prompt_token_ids(run, tokenizer)
    check_model_fit(
        run,
        path=str(model_file.path),
        architecture=model_config.architecture,
        family=family,
        layer_count=model_config.layer_count,
        context_length=model_config.context_length,
        prompt_token_count=len(prompt_ids),
    )
    if loaded is None:  # refuse what cannot fit before the run is recorded or anything is allocated
        from ember.families import FAMILIES
        from ember.memory import check_memory, estimate_memory

        context = run.model.context_length or model_config.context_length
        specs = FAMILIES[model_config.architecture].cache_specs(model_config)
        needed = estimate_memory(gguf, model_config, specs, context, run.model.weights)
        check_memory(needed, model_file.name or Path(model_file.path).name, run.model.weights,
                     context_option="model.context_length=", weights_option="model.weights=quantized")
    label = model_label(run.model.source, model_file)
    name = run_name(run.experiments, experiments, label)
    if study is not None and run.data is not None:  # e.g. "ablation[layer=3] capitals×54 smollm2-135m"
        head, _, tail = name.rpartition(" ")
        name = f"{head} {study.prompt_set.name}×{len(study.items)} {tail}"
    effect_wanted = run.intervention_effect and any(may_write(e) for e in experiments)
    return Prepared(run, plain, model_file, gguf, model_config, tokenizer, experiments, list(prompt_ids),
                    label, name, effect_wanted, study=study)


def check_against_model(experiments: Sequence[Any], ctx: ModelContext) -> None:
    """Let each experiment with a `check_model(ctx)` refuse, before the model is loaded, parameters the
    model cannot take (e.g. a head index past its heads): a ConfigError, one line."""
    for experiment in experiments:
        check = getattr(experiment, "check_model", None)
        if callable(check):
            check(ctx)


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
