"""Hidden states of a prompt set at chosen layers and one stage, pooled per prompt.

A prompt set is a text file (one prompt per line; blank lines and lines starting with `#` skipped) or
a JSONL file (one object per line with `prompt` or `text`, and optionally `label`). Each prompt gets one
clean prefill (no sampling) observed at the chosen boundaries; its rows are pooled to one vector (`last`
token or `mean` over tokens), giving `states[prompt, layer, hidden]` float32. The prompts are evaluated
in batches (`Model.evaluate_batch`), each prompt's rows attending to its own only: its vectors are what
evaluating it alone gives (within 1e-5: the stacked products add in another order).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ember.errors import ConfigError
from ember.experiments.context import BatchLayout, ExecutionPhase
from ember.inspection.recorder import POOLS, batch_layout, pool_rows
from ember.progress import Progress
from ember.rows import BatchEntry
from ember.stages import BY_NAME, LAYER_NAMES, Scope, Stage, define_stage_methods, model_layer_names
from ember.tracing import TracingHooks


@dataclass(frozen=True, slots=True)
class PromptSet:
    prompts: tuple[str, ...]
    labels: tuple[str, ...] | None  # one per prompt, when every JSONL line had a label
    source: str

    def __len__(self) -> int:
        return len(self.prompts)


def read_prompt_set(path: str | os.PathLike[str]) -> PromptSet:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"prompt set {file} does not exist or is not a file")
    lines = file.read_text(encoding="utf-8").splitlines()
    prompts: list[str] = []
    labels: list[str | None] = []
    if file.suffix.lower() in (".jsonl", ".ndjson"):
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError as error:
                raise ConfigError(f"{file}:{number}: not valid JSON ({error})") from None
            text = item.get("prompt", item.get("text")) if isinstance(item, dict) else None
            if not isinstance(text, str) or not text:
                raise ConfigError(f'{file}:{number}: each line needs a non-empty "prompt" (or "text") string')
            label = item.get("label")
            prompts.append(text)
            labels.append(None if label is None else str(label))
    else:
        prompts = [line for line in lines if line.strip() and not line.lstrip().startswith("#")]
        labels = [None] * len(prompts)
    if not prompts:
        raise ConfigError(f"prompt set {file} holds no prompts")
    labelled = [label for label in labels if label is not None]
    if labelled and len(labelled) != len(labels):
        missing = labels.index(None) + 1
        raise ConfigError(f"{file}: some prompts have a label and some do not (prompt {missing} has none)")
    return PromptSet(tuple(prompts), tuple(labelled) if labelled else None, str(file))


def resolve_layers(layers: str | Sequence[int] | None, layer_count: int) -> list[int]:
    """`None`/"all" -> every layer; "0,5,-1" or [0, 5, -1] -> those (negative counts from the end)."""
    if layers is None or layers == "all":
        return list(range(layer_count))
    items = [int(part) for part in layers.split(",")] if isinstance(layers, str) else [int(i) for i in layers]
    chosen = []
    for item in items:
        index = item + layer_count if item < 0 else item
        if not 0 <= index < layer_count:
            raise ConfigError(f"layer {item} is out of range: the model has layers 0…{layer_count - 1}")
        if index not in chosen:
            chosen.append(index)
    return chosen


# Prompts go to the engine in groups of about this many tokens (`Model.evaluate_batch`, which splits a
# group further by `Model.batch_memory`); progress is reported per group, and a group's activations and
# logits are all that is held (SmolLM2: ~40 MB of workspace and ~30 MB of logits for 1,024 tokens of
# short prompts). Measured with benchmarks/bench_extract.py (SmolLM2, 2 threads, 1,000 prompts of 5-12
# tokens, busy shared machine, medians of 3): groups of 256 tokens 60 tok/s, 1,024 218 tok/s, 2,048 161.
GROUP_TOKENS = 1024


class StatePooler:
    """A hooks adapter pooling one stage's rows of the chosen layers into `states[prompt, layer]` as
    they come, per sequence of a batch (`begin_batch`) or for one sequence (`begin_evaluation`): each
    prompt's vector is `pool_rows` of its own rows, what evaluating it alone records."""

    def __init__(self, states: np.ndarray, stage: str, layers: Sequence[int], pool: str) -> None:
        self.states = states
        self.stage = stage
        self.column = {layer: i for i, layer in enumerate(layers)}
        self.pool = pool
        self.prompts: Sequence[int] = ()  # the prompt (row of `states`) of each sequence, caller's order
        self._batch: BatchLayout | None = None
        self.listening = frozenset({stage})  # the engine forms an on-demand stage only where one listens

    def begin_evaluation(self, phase: ExecutionPhase, start_position: int, token_count: int) -> None:
        self._batch = None  # one sequence: prompts[0]

    def begin_batch(self, rows: Any) -> None:
        self._batch = batch_layout(rows)

    def _pool(self, stage: str, layer: int, array: np.ndarray) -> None:
        column = self.column.get(layer)
        if stage != self.stage or column is None:
            return
        if self._batch is None:
            self.states[self.prompts[0], column] = pool_rows(array, self.pool)
            return
        for span in self._batch.spans(layer):
            self.states[self.prompts[span.index], column] = pool_rows(array[span.rows], self.pool)


def _pools(stage: Stage) -> Callable[..., None]:
    name = stage.name
    if stage.scope is Scope.LAYER:
        def layer_stage(self: StatePooler, layer_index: int, array: np.ndarray) -> None:
            self._pool(name, layer_index, array)

        return layer_stage

    def model_stage(self: StatePooler, array: np.ndarray) -> None:
        pass

    return model_stage


define_stage_methods(StatePooler, _pools)


def stage_width(stage: Stage, config: Any) -> int:
    """The columns of a layer stage's rows in a model of `config` (a pattern's vary: the hidden size)."""
    widths = {"heads × head_dim": config.head_count * config.head_dim,
              "kv_heads × head_dim": config.head_count_kv * config.head_dim,
              "experts": getattr(config, "expert_count", 0)}
    return widths.get(stage.width, config.hidden_size)


def extract_hidden_states(model: Any, prompts: Sequence[str], *, layers: str | Sequence[int] | None = None,
                          stage: str = "after_layer", pool: str = "last", add_bos: bool | None = None,
                          progress: bool = True, tracer: Any = None) -> tuple[np.ndarray, list[int]]:
    """(states [prompts, layers, hidden] float32, the layer indices). The prompts are evaluated in
    batches (each one's rows attending to its own only) and pooled as each layer's rows come; `tracer`
    gets one prefill span per batch (and layer spans when it asks for them)."""
    if stage not in LAYER_NAMES:
        raise ConfigError(f"stage must be one of {', '.join(LAYER_NAMES)}, got {stage!r}")
    config = model.config
    if stage not in model_layer_names(config):
        raise ConfigError(f"a {config.family.value} model has no {stage!r} stage (its layer stages: "
                          f"{', '.join(model_layer_names(config))})")
    if pool not in POOLS:
        raise ConfigError(f"pool must be one of {', '.join(POOLS)}, got {pool!r}")
    chosen = resolve_layers(layers, model.config.layer_count)
    entries = []
    for prompt in prompts:
        ids = model.tokenize(prompt, add_bos)
        model.check_fits(len(ids), 0)
        entries.append(BatchEntry(np.asarray(ids, np.int64)))
    states = np.zeros((len(prompts), len(chosen), stage_width(BY_NAME[stage], config)), np.float32)
    pooler = StatePooler(states, stage, chosen, pool)
    observer = TracingHooks(pooler, tracer) if tracer is not None and tracer.layers else pooler
    with Progress("extracting hidden states", total=len(prompts), enabled=progress) as advance:
        for group in _groups(entries, GROUP_TOKENS):
            pooler.prompts = group
            started = time.perf_counter()
            model.evaluate_batch([entries[i] for i in group], observer=observer)
            if tracer is not None:
                tracer.complete("prefill", started, time.perf_counter(), cat="prefill",
                                args={"sequences": len(group), "tokens": sum(entries[i].rows for i in group)})
            advance(len(group))
    return states, chosen


def _groups(entries: Sequence[BatchEntry], tokens: int) -> list[list[int]]:
    """The entries' indices in consecutive groups of at most `tokens` rows (a longer entry alone)."""
    groups: list[list[int]] = [[]]
    used = 0
    for index, entry in enumerate(entries):
        if groups[-1] and used + entry.rows > tokens:
            groups.append([])
            used = 0
        groups[-1].append(index)
        used += entry.rows
    return [group for group in groups if group]


def save_states(path: str | os.PathLike[str], states: np.ndarray, layers: Sequence[int], *, stage: str,
                pool: str, prompt_set: PromptSet, model: Any) -> Path:
    """One `.npz`: states, layers, labels (when given), prompts, and a JSON `meta` string."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": "ember.states/1", "stage": stage, "pool": pool, "model": model.source.name,
            "architecture": model.config.architecture, "source": prompt_set.source,
            "shape": ["prompt", "layer", "hidden"]}
    arrays: dict[str, Any] = {"states": states, "layers": np.asarray(layers, np.int64),
                              "prompts": np.asarray(prompt_set.prompts), "meta": np.asarray(json.dumps(meta))}
    if prompt_set.labels is not None:
        arrays["labels"] = np.asarray(prompt_set.labels)
    np.savez(target, **arrays)
    return target if target.suffix == ".npz" else target.with_name(target.name + ".npz")
