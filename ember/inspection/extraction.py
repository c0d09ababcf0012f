"""Hidden states of a prompt set at chosen layers and one stage, pooled per prompt.

A prompt set is a text file (one prompt per line; blank lines and lines starting with `#` skipped) or
a JSONL file (one object per line with `prompt` or `text`, and optionally `label`). Each prompt gets one
clean prefill (no sampling) with a recorder at the chosen boundaries; its rows are pooled to one vector
(`last` token or `mean` over tokens), giving `states[prompt, layer, hidden]` float32.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ember.errors import ConfigError
from ember.experiments.context import ExecutionPhase
from ember.inspection.recorder import POOLS, BoundaryRecorder, pool_rows
from ember.progress import Progress
from ember.stages import LAYER_NAMES


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


def extract_hidden_states(model: Any, prompts: Sequence[str], *, layers: str | Sequence[int] | None = None,
                          stage: str = "after_layer", pool: str = "last", add_bos: bool | None = None,
                          progress: bool = True, tracer: Any = None) -> tuple[np.ndarray, list[int]]:
    """(states [prompts, layers, hidden] float32, the layer indices); `tracer` gets one prefill span
    per prompt (and layer spans when it asks for them)."""
    if stage not in LAYER_NAMES:
        raise ConfigError(f"stage must be one of {', '.join(LAYER_NAMES)}, got {stage!r}")
    if pool not in POOLS:
        raise ConfigError(f"pool must be one of {', '.join(POOLS)}, got {pool!r}")
    chosen = resolve_layers(layers, model.config.layer_count)
    position = {layer: i for i, layer in enumerate(chosen)}
    states = np.zeros((len(prompts), len(chosen), model.config.hidden_size), np.float32)
    with Progress("extracting hidden states", total=len(prompts), enabled=progress) as advance:
        for row, prompt in enumerate(prompts):
            recorder = BoundaryRecorder(stages=(stage,), layers=chosen, phases=(ExecutionPhase.PREFILL,),
                                        reduce=lambda array: pool_rows(array, pool))
            model.evaluate(prompt, add_bos=add_bos, observer=recorder, tracer=tracer)
            for record in recorder.records:
                states[row, position[record.layer]] = record.array
            advance(1)
    return states, chosen


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
