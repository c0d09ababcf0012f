"""Layer and logits dumps of one generation: `.npz` arrays and a JSON index.

`layers.npz` holds, for every evaluation (the prefill, then each decode step), every stage not of
vocabulary width (`ember.stages.STAGES`: every layer's stages, the ones inside attention included, and
`before_logits`); `logits.npz` holds the stages of vocabulary width (`after_logits`) of every
evaluation. The arrays are copies of exactly what the hooks see at those boundaries (same calls, same
buffers). `index.json` lists each array: file, key, evaluation, phase, layer, stage, positions
[start, end) of its rows (before/after_logits: the last position) and shape.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ember.errors import ConfigError
from ember.inspection.recorder import BoundaryRecorder, Record
from ember.stages import BY_NAME, STAGES

LAYERS_FILE, LOGITS_FILE, INDEX_FILE = "layers.npz", "logits.npz", "index.json"
LAYER_FILE_STAGES = tuple(stage.name for stage in STAGES if stage.width != "vocab")
LOGITS_FILE_STAGES = tuple(stage.name for stage in STAGES if stage.width == "vocab")


@dataclass(slots=True)
class DumpResult:
    generation: Any  # ember.model.Generation
    directory: Path
    files: list[Path] = field(default_factory=list)
    index: dict[str, Any] = field(default_factory=dict)


def array_key(record: Record) -> str:
    """`e000.after_layer.07` for layer stages, `e000.before_logits` for model stages, and the argument's
    name for a stage of vocabulary width: `e000.logits`."""
    if record.stage in LOGITS_FILE_STAGES:
        return f"e{record.evaluation:03d}.{BY_NAME[record.stage].argument}"
    if record.layer is None:
        return f"e{record.evaluation:03d}.{record.stage}"
    return f"e{record.evaluation:03d}.{record.stage}.{record.layer:02d}"


def dump_generation(model: Any, prompt: str | Sequence[int], directory: str | os.PathLike[str], *,
                    layers: bool = True, logits: bool = True, compress: bool = False,
                    **generate_options: Any) -> DumpResult:
    """Generate with a recorder attached and write the dumps asked for into `directory`.

    `generate_options` go to `Model.generate` (max_new_tokens, temperature, ..., tracer); experiments
    are not accepted (see ember.inspection.refusal).
    """
    if not (layers or logits):
        raise ConfigError("nothing to dump: ask for layers, logits or both")
    if generate_options.get("experiments"):
        from ember.inspection.refusal import refuse_with_experiments

        refuse_with_experiments("dump_layers" if layers else "dump_logits", generate_options["experiments"])
    stages = (LAYER_FILE_STAGES if layers else ()) + (LOGITS_FILE_STAGES if logits else ())
    recorder = BoundaryRecorder(stages=stages)
    generation = model.generate(prompt, observer=recorder, **generate_options)
    return write_dump(recorder.records, generation, directory, model=model, layers=layers, logits=logits,
                      compress=compress)


def write_dump(records: list[Record], generation: Any, directory: str | os.PathLike[str], *, model: Any,
               layers: bool, logits: bool, compress: bool = False) -> DumpResult:
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    save = np.savez_compressed if compress else np.savez
    requested = ([LAYERS_FILE] if layers else []) + ([LOGITS_FILE] if logits else [])
    entries: list[dict[str, Any]] = []
    files: list[Path] = []
    for name in requested:
        chosen = [r for r in records if (r.stage in LOGITS_FILE_STAGES) == (name == LOGITS_FILE)]
        arrays = {array_key(r): r.array for r in chosen}
        path = folder / name
        save(path, **arrays)
        files.append(path)
        entries += [_entry(name, r) for r in chosen]
    index = {
        "format": "ember.dump/1",
        "model": {"name": model.source.name, "path": str(model.source.path),
                  "architecture": model.config.architecture, "layer_count": model.config.layer_count,
                  "hidden_size": model.config.hidden_size, "vocab_size": model.config.vocab_size},
        "prompt_token_ids": [int(t) for t in generation.prompt_token_ids],
        "token_ids": [int(t) for t in generation.token_ids],
        "text": generation.text,
        "evaluations": 1 + generation.timings.decode_evaluations,
        "arrays": entries,
    }
    index_path = folder / INDEX_FILE
    index_path.write_text(json.dumps(index, indent=1))
    files.append(index_path)
    return DumpResult(generation, folder, files, index)


def _entry(file: str, record: Record) -> dict[str, Any]:
    # Layer stages cover every evaluated token (a pattern: a row per head and token); before/after_logits
    # only the last token's row.
    end = record.start_position + record.token_count
    rows = record.token_count if record.layer is not None else 1
    return {
        "file": file, "key": array_key(record), "evaluation": record.evaluation,
        "phase": record.phase.value, "layer": record.layer, "stage": record.stage,
        "positions": [end - rows, end],
        "shape": list(record.array.shape), "dtype": str(record.array.dtype),
    }


def load_dump(directory: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(index, key -> array) of a dump folder."""
    folder = Path(directory)
    index = json.loads((folder / INDEX_FILE).read_text())
    arrays: dict[str, np.ndarray] = {}
    for name in sorted({entry["file"] for entry in index["arrays"]}):
        with np.load(folder / name) as data:
            arrays.update({key: data[key] for key in data.files})
    return index, arrays
