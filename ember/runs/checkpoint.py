"""What a job has so far, written into its run while it generates: a killed run keeps it.

Every `EMBER_CHECKPOINT_SECONDS` (default 5 s) of generation, the text and token ids produced so far go
to `generation.json` / `generation.txt` (with `"complete": false`), and each experiment's results so far
(`Experiment.results()` is "what the experiment measured so far") to `experiments/<name>/metrics.json`
and its table files. The run's final records are written under the same names, so a finished run holds
no stale checkpoint; a run killed with SIGKILL (or by the OOM killer) keeps the last checkpoint, and an
interrupted one (Ctrl-C, SIGTERM) gets one more checkpoint at the moment it stops, with exactly the text
already shown on the console.

The cost is one `results()` call per experiment and a few small artifact writes per interval (measured
on the SQLite store with `activation_stats` after 64 tokens, 2-core machine at load 13: 85 ms median a
checkpoint, of which `results()` 9 ms; under 2% of a job at one checkpoint per 5 s).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from ember import tracking
from ember.runs.records import Recorder


def interval_seconds() -> float:
    return float(os.environ.get("EMBER_CHECKPOINT_SECONDS", "5"))


class Checkpoints:
    """The text and tokens of one generation as they come, written to the run at intervals."""

    def __init__(self, recorder: Recorder, prompt_ids: Sequence[int], experiments: Sequence[Any],
                 show: Callable[[str], None] | None = None) -> None:
        self.recorder = recorder
        self.prompt_ids = list(prompt_ids)
        self.experiments = list(experiments)
        self.show = show
        self.pieces: list[str] = []
        self.token_ids: list[int] = []
        self.interval = interval_seconds()
        self.last_write = time.monotonic()
        self.writes = 0

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def on_text(self, piece: str) -> None:
        self.pieces.append(piece)
        if self.show is not None:
            self.show(piece)

    def on_token(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))
        if time.monotonic() - self.last_write >= self.interval:
            self.write("in progress")

    def write(self, state: str) -> None:
        """The generation and the experiments' results so far, under their final artifact names."""
        self.last_write = time.monotonic()
        if self.recorder.run_id is None:
            return
        self.writes += 1
        self.recorder.log_json({"text": self.text, "prompt_token_ids": self.prompt_ids,
                                "token_ids": self.token_ids, "stop_reason": state, "complete": False},
                               "generation.json")
        self.recorder.log_text(self.text, "generation.txt")
        for experiment in self.experiments:
            try:
                result = experiment.results()
            except Exception:  # an experiment that cannot report mid-way: its final results still count
                continue
            write_partial_result(self.recorder, str(experiment.name), result)


def experiment_folder(name: str) -> str:
    return f"experiments/{tracking.metric_key(name).replace(' ', '_').replace('/', '_')}"


def write_partial_result(recorder: Recorder, name: str, result: Any) -> None:
    """Metrics (as JSON: MLflow metrics cannot be taken back) and tables of a result so far."""
    folder = experiment_folder(name)
    metrics = [{"name": m.name, "value": m.value, "step": m.step} for m in result.metrics]
    recorder.log_json(metrics, f"{folder}/metrics.json")
    for table, rows in result.tables.items():
        rows = list(rows)
        recorder.log_json(rows, f"{folder}/{table}.json")
        if rows:
            recorder.log_text(tracking.table_csv(rows), f"{folder}/{table}.csv")
