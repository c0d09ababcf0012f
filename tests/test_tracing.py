"""Structured tracing: Chrome trace-event JSON with the expected spans; its state in the contexts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_support import prepared_store

import ember
from ember.experiments import Experiment, TracingState, ZeroLayerOutput
from ember.tracing import Tracer

PROMPT = "The capital of France is"


class SeesTracing(Experiment):
    name = "sees_tracing"

    def __init__(self) -> None:
        self.states: set[TracingState] = set()

    def before_prefill(self, ctx) -> None:
        self.states.add(ctx.tracing)

    def after_layer(self, ctx, hidden) -> None:
        self.states.add(ctx.execution.tracing)

    def on_generation_complete(self, ctx) -> None:
        self.states.add(ctx.tracing)


def _check_chrome_trace(path: Path) -> list[dict]:
    document = json.loads(path.read_text())
    assert document["displayTimeUnit"] == "ms"
    events = document["traceEvents"]
    for event in events:
        assert event["ph"] in ("X", "M")
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if event["ph"] == "X":
            assert event["ts"] >= 0 and event["dur"] >= 0 and event["name"] and event["cat"]
    return [e for e in events if e["ph"] == "X"]


def test_trace_file_has_load_tokenize_prefill_decode_and_layer_spans(tmp_path: Path) -> None:
    tracer = Tracer(layers=True)
    model = ember.load_model("smollm2-135m", context_length=64, tracer=tracer)
    generation = model.generate(PROMPT, max_new_tokens=4, tracer=tracer)
    spans = _check_chrome_trace(tracer.write(tmp_path / "trace.json"))
    names = [e["name"] for e in spans]
    for name in ("load", "resolve", "gguf", "tokenizer", "weights", "generate", "tokenize", "prefill"):
        assert names.count(name) == 1, name
    steps = generation.timings.decode_evaluations
    assert steps == 3 and names.count("decode") == steps
    layers = model.config.layer_count
    evaluations = 1 + steps
    assert sum(e["cat"] == "layer" for e in spans) == layers * evaluations
    assert names.count("lm_head") == evaluations
    assert generation.trace is tracer

    by_name = {e["name"]: e for e in spans}
    load, prefill, generate = by_name["load"], by_name["prefill"], by_name["generate"]
    for child in ("resolve", "gguf", "tokenizer", "weights"):
        assert load["ts"] <= by_name[child]["ts"] <= by_name[child]["ts"] + by_name[child]["dur"] <= (
            load["ts"] + load["dur"] + 1)
    assert generate["ts"] >= load["ts"] + load["dur"]
    # the prefill's layer spans lie inside the prefill span, in layer order
    prefill_layers = [e for e in spans if e["cat"] == "layer" and e["args"]["phase"] == "prefill"]
    assert [e["args"]["layer"] for e in prefill_layers] == list(range(layers))
    assert all(prefill["ts"] <= e["ts"] and e["ts"] + e["dur"] <= prefill["ts"] + prefill["dur"] + 1
               for e in prefill_layers)
    positions = [e["args"]["position"] for e in spans if e["name"] == "decode"]
    prompt_length = len(generation.prompt_token_ids)
    assert positions == list(range(prompt_length, prompt_length + steps))
    summary = tracer.summary()
    assert summary["layer"]["count"] == layers * evaluations and summary["decode"]["count"] == steps


def test_tracing_state_shows_in_every_context_and_runs_with_an_intervention(smollm2) -> None:
    quiet = SeesTracing()
    smollm2.generate(PROMPT, max_new_tokens=2, experiments=[quiet])
    assert quiet.states == {TracingState.DISABLED}

    seen = SeesTracing()
    tracer = Tracer()
    generation = smollm2.generate(PROMPT, max_new_tokens=2, tracer=tracer,
                                  experiments=[ZeroLayerOutput(layer=3), seen])
    assert seen.states == {TracingState.ENABLED}
    assert generation.complete and [e["name"] for e in tracer.spans("prefill")] == ["prefill"]

    made = SeesTracing()
    generation = smollm2.generate(PROMPT, max_new_tokens=2, tracing=TracingState.ENABLED, experiments=[made])
    assert made.states == {TracingState.ENABLED}
    assert isinstance(generation.trace, Tracer) and generation.trace.spans("decode")


def test_tracing_off_makes_no_tracer(smollm2, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a tracer was created or called with tracing off")

    monkeypatch.setattr(Tracer, "__init__", refuse)
    monkeypatch.setattr(Tracer, "complete", refuse)
    generation = smollm2.generate(PROMPT, max_new_tokens=3)
    assert generation.trace is None and len(generation.token_ids) == 3


def test_tracing_does_not_change_the_tokens(smollm2) -> None:
    plain = smollm2.generate(PROMPT, max_new_tokens=4)
    traced = smollm2.generate(PROMPT, max_new_tokens=4, tracer=Tracer(layers=True))
    assert plain.token_ids == traced.token_ids


def test_hydra_front_door_logs_the_trace_with_an_experiment(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    from ember import run

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{prepared_store(tmp_path)}"
    code = run.main(["tracing=true", "trace_layers=true", "max_new_tokens=2", "experiment=zero_layer",
                     "layer=3", "intervention_effect=false", "model.context_length=128",
                     f"mlflow.tracking_uri={uri}"])
    assert code == 0
    client = MlflowClient(uri)
    [found] = client.search_runs([client.get_experiment_by_name("ember").experiment_id])
    local = client.download_artifacts(found.info.run_id, "trace.json", str(tmp_path))
    spans = _check_chrome_trace(Path(local))
    names = [e["name"] for e in spans]
    assert names.count("prefill") == 1 and names.count("decode") == 1 and "layer 3" in names
    assert run.main(["trace_layers=true", "mlflow=off"]) == 2
