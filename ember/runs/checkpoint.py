"""What a run has so far, written into it while it works: a killed run keeps it.

Every `EMBER_CHECKPOINT_SECONDS` (default 5 s; 0: at every chance) of work, a run writes what it has
under the names of its final records, so a finished run holds no stale checkpoint:
- a generation (`python -m ember.run`, `ember generate`): the text and token ids so far in
  `generation.json` / `generation.txt` (with `"complete": false`), and each experiment's results so far
  (`Experiment.results()` is "what the experiment measured so far") in `experiments/<name>/metrics.json`
  and its table files (`Checkpoints`);
- a study: the rows of the items done so far in `study/items.json` (`ember.runs.study`, on `Interval`).
A run killed with SIGKILL (or by the OOM killer) keeps the last checkpoint, and an interrupted one
(Ctrl-C, SIGTERM) gets one more at the moment it stops, with exactly the text already shown on the
console; the next ember command on the store closes the killed run as KILLED (`ember.records.heartbeat`).

The cost is one `results()` call per experiment and a few small artifact writes per interval (measured
on the SQLite store with `activation_stats` after 64 tokens, 2-core machine at load 13: 85 ms median a
checkpoint, of which `results()` 9 ms; under 2% of a job at one checkpoint per 5 s).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from ember.records.run import Record
from ember.records.tracker import experiment_folder
from ember.records.values import table_csv


def interval_seconds() -> float:
    return float(os.environ.get("EMBER_CHECKPOINT_SECONDS", "5"))


class Interval:
    """Whether a checkpoint is due: `EMBER_CHECKPOINT_SECONDS` since the last one (or the start)."""

    def __init__(self) -> None:
        self.seconds = interval_seconds()
        self.last = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self.last >= self.seconds

    def restart(self) -> None:
        self.last = time.monotonic()


class Checkpoints:
    """The text and tokens of one generation as they come, written to the run (`record`; nothing while it
    is not recording) at intervals."""

    def __init__(self, record: Record, prompt_ids: Sequence[int], experiments: Sequence[Any],
                 show: Callable[[str], None] | None = None) -> None:
        self.record = record
        self.prompt_ids = list(prompt_ids)
        self.experiments = list(experiments)
        self.show = show
        self.pieces: list[str] = []
        self.token_ids: list[int] = []
        self.interval = Interval()
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
        if self.interval.due():
            self.write("in progress")

    def write(self, state: str) -> None:
        """The generation and the experiments' results so far, under their final artifact names."""
        self.interval.restart()
        if not self.record.recording:
            return
        self.writes += 1
        # The experiments' results first, generation.json last: a run killed between two writes never
        # holds a generation checkpoint without the experiments' results of the same moment (or later).
        for experiment in self.experiments:
            try:
                result = experiment.results()
            except Exception:  # an experiment that cannot report mid-way: its final results still count
                continue
            write_partial_result(self.record, str(experiment.name), result)
        self.record.log_text(self.text, "generation.txt")
        self.record.log_json({"text": self.text, "prompt_token_ids": self.prompt_ids,
                              "token_ids": self.token_ids, "stop_reason": state, "complete": False},
                             "generation.json")


def write_partial_result(record: Record, name: str, result: Any) -> None:
    """Metrics (as JSON: MLflow metrics cannot be taken back) and tables of a result so far."""
    folder = experiment_folder(name)
    metrics = [{"name": m.name, "value": m.value, "step": m.step} for m in result.metrics]
    record.log_json(metrics, f"{folder}/metrics.json")
    for table, rows in result.tables.items():
        rows = list(rows)
        record.log_json(rows, f"{folder}/{table}.json")
        if rows:
            record.log_text(table_csv(rows), f"{folder}/{table}.csv")
