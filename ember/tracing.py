"""Structured tracing: timed spans written as Chrome trace-event JSON (open in https://ui.perfetto.dev).

    tracer = Tracer(layers=True)
    model = load_model("smollm2-135m", tracer=tracer)   # spans: load, resolve, gguf, tokenizer, weights
    model.generate("Hello", tracer=tracer)              # spans: generate, tokenize, prefill, decode (each
    tracer.write("trace.json")                          #   step), "layer N" per layer when layers=True

Spans are "complete" events (`"ph": "X"`) with microsecond timestamps from a shared origin. Tracing off
costs nothing: without a tracer the engine never calls into this module (one `is not None` test per
decode step), and per-layer spans exist only through `TracingHooks`, which is wrapped around the hooks
adapter only when a tracer asks for layers.

A tracer is a recorder, not a hook: experiments see `TracingState.ENABLED` in their contexts while a
tracer is attached, and cannot reach or change it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ember.phases import ExecutionPhase
from ember.stages import HEAD_STAGES, LAYER_STAGES, STAGES, Scope, Stage, define_stage_methods, listened

SPAN_NAMES = ("load", "resolve", "gguf", "tokenizer", "weights", "generate", "tokenize", "prefill", "decode")


class Tracer:
    """Collects spans of one process; `write(path)` saves them as Chrome trace-event JSON."""

    def __init__(self, *, layers: bool = False, name: str = "ember") -> None:
        self.layers = layers
        self.name = name
        self.events: list[dict[str, Any]] = []
        self._origin = time.perf_counter()
        self._pid = os.getpid()

    def _us(self, seconds: float) -> float:
        return round((seconds - self._origin) * 1e6, 3)

    def complete(self, name: str, start: float, end: float, *, cat: str = "ember",
                 args: dict[str, Any] | None = None) -> None:
        """Record a span from two `time.perf_counter()` readings."""
        event: dict[str, Any] = {
            "name": name, "cat": cat, "ph": "X", "ts": self._us(start),
            "dur": round(max(end - start, 0.0) * 1e6, 3), "pid": self._pid, "tid": threading.get_native_id(),
        }
        if args:
            event["args"] = args
        self.events.append(event)

    @contextmanager
    def span(self, name: str, *, cat: str = "ember", **args: Any) -> Iterator[dict[str, Any]]:
        """Time the block as one span; the yielded dict's entries become the span's `args`."""
        details = dict(args)
        start = time.perf_counter()
        try:
            yield details
        finally:
            self.complete(name, start, time.perf_counter(), cat=cat, args=details)

    def spans(self, name: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e["ph"] == "X" and (name is None or e["name"] == name)]

    def summary(self) -> dict[str, dict[str, float]]:
        """Span name -> count, total and mean milliseconds (per-layer spans grouped as `layer`)."""
        totals: dict[str, list[float]] = {}
        for event in self.spans():
            key = "layer" if event["cat"] == "layer" else event["name"]
            totals.setdefault(key, []).append(event["dur"] / 1000.0)
        return {key: {"count": len(values), "total_ms": float(np.sum(values)),
                      "mean_ms": float(np.mean(values))} for key, values in totals.items()}

    def to_json(self) -> dict[str, Any]:
        metadata = [
            {"name": "process_name", "ph": "M", "pid": self._pid, "tid": 0, "args": {"name": self.name}},
        ]
        for tid in sorted({e["tid"] for e in self.events}):
            metadata.append({"name": "thread_name", "ph": "M", "pid": self._pid, "tid": tid,
                             "args": {"name": "engine"}})
        return {"traceEvents": metadata + self.events, "displayTimeUnit": "ms",
                "otherData": {"producer": "ember", "clock": "perf_counter, microseconds"}}

    def write(self, path: str | os.PathLike[str]) -> Path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(self.to_json()))
        return target


class TracingHooks:
    """A hooks adapter that times every layer (`layer N` spans) and the LM head, around another adapter.

    The wrapped adapter (experiments, an observer, or the disabled one) is called exactly as without
    tracing; a layer's span runs from before its first layer stage's hooks (`before_layer`) to after its
    last's (`after_layer`), the `lm_head` span likewise over the stages after the layers
    (`before_logits` to `after_logits`). The per-stage methods are made from `ember.stages.STAGES`.
    """

    __slots__ = ("inner", "tracer", "_phase", "_start_position", "_layer_started", "_head_started",
                 "_inner_stages")

    def __init__(self, inner: Any, tracer: Tracer) -> None:
        self.inner = inner
        self.tracer = tracer
        self._phase = ExecutionPhase.PREFILL
        self._start_position = 0
        self._layer_started = 0.0
        self._head_started = 0.0
        self._inner_stages = tuple(getattr(inner, s.name) for s in STAGES)  # bound once, indexed like STAGES

    @property
    def listening(self) -> frozenset[str]:
        return listened(self.inner)

    def begin_evaluation(self, phase: ExecutionPhase, start_position: int, token_count: int) -> None:
        self._phase = ExecutionPhase(phase)
        self._start_position = int(start_position)
        self.inner.begin_evaluation(phase, start_position, token_count)

    def begin_batch(self, rows: Any) -> None:
        self._phase = ExecutionPhase.PREFILL
        self._start_position = 0
        self.inner.begin_batch(rows)

    def _end_layer(self, layer_index: int) -> None:
        self.tracer.complete(f"layer {layer_index}", self._layer_started, time.perf_counter(), cat="layer",
                             args={"layer": layer_index, "phase": self._phase.value,
                                   "start_position": self._start_position})

    def _end_head(self) -> None:
        self.tracer.complete("lm_head", self._head_started, time.perf_counter(), cat="lm_head",
                             args={"phase": self._phase.value})


def _traced(stage: Stage) -> Callable[..., None]:
    """Call the wrapped adapter's method of this stage; open or close a span where the stage does."""
    index = STAGES.index(stage)
    if stage.scope is Scope.LAYER:
        opens, closes = stage is LAYER_STAGES[0], stage is LAYER_STAGES[-1]

        def layer_stage(self: TracingHooks, layer_index: int, array: np.ndarray) -> None:
            if opens:
                self._layer_started = time.perf_counter()
            self._inner_stages[index](layer_index, array)
            if closes:
                self._end_layer(layer_index)

        return layer_stage

    opens, closes = stage is HEAD_STAGES[0], stage is HEAD_STAGES[-1]

    def model_stage(self: TracingHooks, array: np.ndarray) -> None:
        if opens:
            self._head_started = time.perf_counter()
        self._inner_stages[index](array)
        if closes:
            self._end_head()

    return model_stage


define_stage_methods(TracingHooks, _traced)
