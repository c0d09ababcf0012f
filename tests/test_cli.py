"""The `ember` command: v0.1 refusals before loading, and each subcommand end to end on SmolLM2."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from run_support import prepared_store

import ember.model
import ember.sources
from ember import cli
from ember.stages import layer_names

DATA = Path(__file__).parent / "data"

# (arguments without --experiment, the surface named in the message)
SURFACE_COMMANDS = [
    (["generate", "Hi", "--dump-layers"], "--dump-layers"),
    (["generate", "Hi", "--dump-logits"], "--dump-logits"),
    (["generate", "Hi", "--dump-layers", "--dump-logits"], "--dump-layers"),
    (["extract", str(DATA / "probe_prompts.jsonl")], "hidden-state extraction"),
    (["probe", str(DATA / "probe_prompts.jsonl")], "probes"),
    (["interactive"], "the interactive command"),
    (["chat"], "the interactive command"),
    (["demo"], "the demo command"),
    (["benchmark"], "the benchmark command"),
]


@pytest.fixture()
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the model was resolved or loaded before the refusal")

    monkeypatch.setattr(ember.model, "load_model", refuse)
    monkeypatch.setattr(ember.model, "resolve_model", refuse)
    monkeypatch.setattr(ember.sources, "resolve_model", refuse)


@pytest.fixture()
def fixture_model(smollm2, monkeypatch: pytest.MonkeyPatch):
    """`ember` subcommands get the session's SmolLM2 instead of loading their own."""
    monkeypatch.setattr(ember.model, "load_model", lambda *args, **kwargs: smollm2)
    return smollm2


def no_records(arguments: list[str]) -> list[str]:
    """`--no-mlflow` for a command that records (interactive and demo take no such option)."""
    return ["--no-mlflow"] if arguments[0] in cli.RECORDING_COMMANDS else []


@pytest.mark.parametrize("experiments", [["zero_layer_output:layer=3"],
                                         ["activation_stats", "experiments.steering_vector.SteeringVector"]])
@pytest.mark.parametrize(("arguments", "surface"), SURFACE_COMMANDS)
def test_every_surface_with_an_experiment_is_refused_before_loading(
        no_loading, capsys: pytest.CaptureFixture[str], arguments: list[str], surface: str,
        experiments: list[str]) -> None:
    flags = [part for name in experiments for part in ("--experiment", name)]
    assert cli.main([*arguments, *flags, *no_records(arguments)]) == cli.EXIT_USAGE
    message = capsys.readouterr().err
    assert f"{surface}" in message and "cannot run with active experiments" in message
    assert experiments[0].partition(":")[0] in message
    assert "before/after-intervention" in message or "which model is talking" in message \
        or "unmodified model" in message or "engine's figures" in message


def test_the_same_commands_without_experiments_are_not_refused(no_loading) -> None:
    from ember.inspection.refusal import refuse_with_experiments

    for arguments, _ in SURFACE_COMMANDS:
        args = cli.build_parser().parse_args(arguments)
        cli.check_combination(args)  # no error
    refuse_with_experiments("demo", [])
    # tracing is not a value surface: allowed with experiments
    args = cli.build_parser().parse_args(
        ["generate", "Hi", "--experiment", "activation_stats", "--trace", "t"])
    cli.check_combination(args)


def test_usage_mistakes_exit_2(no_loading, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == cli.EXIT_USAGE
    assert cli.main(["generate", "Hi", "--trace-layers"]) == cli.EXIT_USAGE
    assert "--trace-layers needs --trace" in capsys.readouterr().err
    assert cli.main(["generate", "Hi", "--experiment", ":layer=3"]) == cli.EXIT_USAGE
    assert "give a name" in capsys.readouterr().err
    assert cli.main(["nonsense"]) == cli.EXIT_USAGE


@pytest.fixture()
def no_weights(smollm2_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model file (already in the cache) may be resolved and its metadata read, but nothing may
    load the model."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the mistake was reported")

    monkeypatch.setattr(ember.model, "load_model", refuse)


@pytest.mark.parametrize(("arguments", "message"), [
    (["generate", "Hi", "--max-new-tokens", "-3"], "--max-new-tokens must be at least 0, got -3"),
    (["generate", "Hi", "--experiment", "nope"], "unknown experiment 'nope' in experiments[0]; built-in"),
    (["generate", "Hi", "--experiment", "zero_layer_output:layer=99"],
     "experiments[0] (zero_layer_output).layer=99 is out of range: this model has 30 layers (0..29)"),
    (["generate", "Hi", "--experiment", "zero_layer_output:layer=3,strength=2"],
     "has no parameter 'strength'"),
    (["generate", "Hi", "--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["generate", "Hi", "--temperature", "-1"], "--temperature must be in [0, inf), got -1.0"),
    (["generate", "Hi", "--threads", "0"], "--threads must be at least 1, got 0"),
    (["generate", "Hi", "--context-length", "100000"], "--context-length 100000 is longer than"),
    (["generate", "Hi", "--max-new-tokens", "3000", "--context-length", "2048"],
     "the prompt (1 tokens) plus --max-new-tokens 3000 is more than the context holds (2048 tokens"),
    (["generate", "Hi", "--max-new-tokens", "abc"], "argument --max-new-tokens: invalid int value: 'abc'"),
    (["generate", "Hi", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["extract", str(DATA / "probe_prompts.jsonl"), "--layers", "0,99"], "layer 99 is out of range"),
    (["probe", str(DATA / "probe_prompts.jsonl"), "--folds", "1"], "--folds must be at least 2, got 1"),
    (["interactive", "--max-new-tokens", "-1"], "--max-new-tokens must be at least 0"),
    (["demo", "--max-new-tokens", "-1"], "--max-new-tokens must be at least 0"),
    (["benchmark", "--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["generate", "Hi", "--bogus"], "unrecognized arguments: --bogus (ember --help"),
    (["nonsense"], "argument COMMAND: invalid choice: 'nonsense'"),
])
def test_every_mistake_is_one_line_before_loading(no_weights, capsys: pytest.CaptureFixture[str],
                                                   arguments: list[str], message: str) -> None:
    assert cli.main([*arguments, *no_records(arguments)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ember: ") and message in lines[0], err


def test_max_new_tokens_0_is_prefill_only_everywhere(smollm2, fixture_model,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    generation = smollm2.generate("Hi", max_new_tokens=0)
    assert generation.token_ids == [] and generation.text == ""
    assert generation.timings.prompt_tokens == len(smollm2.tokenize("Hi"))
    assert generation.timings.decode_evaluations == 0
    assert cli.main(["generate", "Hi", "--max-new-tokens", "0", "--no-mlflow"]) == 0
    assert "0 tokens" in capsys.readouterr().err


def test_experiment_specs() -> None:
    specs = cli.experiment_specs(["zero_layer_output:layer=3,target=mlp", "pkg.mod.Class:scale=0.5"])
    assert specs[0].name == "zero_layer_output" and specs[0].params == {"layer": 3, "target": "mlp"}
    assert specs[1].target == "pkg.mod.Class" and specs[1].params == {"scale": 0.5}


def _mlflow(tmp_path: Path) -> list[str]:
    prepared_store(tmp_path)  # a migrated empty store (migrations run once per session)
    return ["--mlflow-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--quiet"]


def _runs(tmp_path: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("ember")
    return client, client.search_runs([experiment.experiment_id])


def test_generate_with_experiment_and_trace(fixture_model, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.json"
    code = cli.main(["generate", "The capital of France is", "--max-new-tokens", "3", "--experiment",
                     "activation_stats", "--trace", str(trace), "--trace-layers", *_mlflow(tmp_path)])
    assert code == cli.EXIT_OK
    captured = capsys.readouterr()
    assert captured.out.startswith("The capital of France is")
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"prefill", "decode", "layer 0", "generate"} <= names
    client, runs = _runs(tmp_path)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    lines = captured.err.strip().splitlines()
    assert lines[-1] == (f"ember: recorded as MLflow run {runs[0].info.run_id} (FINISHED) in "
                         f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert any(line.startswith("ember: activation_stats: residual RMS") for line in lines)
    assert runs[0].data.tags["mlflow.source.name"] == "ember generate"
    assert client.get_experiment_by_name("ember").tags["mlflow.experimentKind"] == "custom_model_development"
    artifacts = {f.path for f in client.list_artifacts(runs[0].info.run_id)}
    assert {"generation.json", "trace", "experiments"} <= artifacts
    assert "activation_stats.prefill/after_layer/rms" in runs[0].data.metrics


def test_generate_dumps_layers_and_logits(fixture_model, tmp_path: Path) -> None:
    folder = tmp_path / "dump"
    code = cli.main(["generate", "Hello", "--max-new-tokens", "2", "--dump-layers", "--dump-logits",
                     "--dump-dir", str(folder), *_mlflow(tmp_path)])
    assert code == cli.EXIT_OK
    index = json.loads((folder / "index.json").read_text())
    assert index["evaluations"] == 2
    with np.load(folder / "layers.npz") as layers:
        config = fixture_model.config
        assert len(layers.files) == 2 * (len(layer_names(config.family)) * config.layer_count + 1)
    client, runs = _runs(tmp_path)
    assert {f.path for f in client.list_artifacts(runs[0].info.run_id, "dump")} == {
        "dump/index.json", "dump/layers.npz", "dump/logits.npz"}


def test_extract_writes_states(fixture_model, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\nGood morning\n")
    out = tmp_path / "states.npz"
    trace = tmp_path / "trace.json"
    code = cli.main(["extract", str(prompts), "--layers", "0,-1", "--stage", "after_attention", "--pool",
                     "mean", "--out", str(out), "--trace", str(trace), *_mlflow(tmp_path)])
    assert code == cli.EXIT_OK
    prefills = [e for e in json.loads(trace.read_text())["traceEvents"] if e["name"] == "prefill"]
    assert [e["args"]["sequences"] for e in prefills] == [2]  # the two prompts in one batch
    with np.load(out) as saved:
        assert saved["states"].shape == (2, 2, fixture_model.config.hidden_size)
        assert list(saved["layers"]) == [0, fixture_model.config.layer_count - 1]
        assert json.loads(str(saved["meta"]))["stage"] == "after_attention"
        assert "labels" not in saved.files


def test_probe_needs_labels(fixture_model, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\nGood morning\n")
    assert cli.main(["probe", str(prompts), "--no-mlflow"]) == cli.EXIT_USAGE
    assert "probes need a label per prompt" in capsys.readouterr().err


@pytest.mark.slow
def test_probe_command(fixture_model, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["probe", str(DATA / "probe_prompts.jsonl"), "--layers", "0,10,20", "--pool", "mean",
                     *_mlflow(tmp_path)])
    assert code == cli.EXIT_OK
    assert "layer  test_acc" in capsys.readouterr().out
    client, runs = _runs(tmp_path)
    assert len(client.get_metric_history(runs[0].info.run_id, "probe.test_accuracy")) == 3


def test_interactive_reads_stdin(fixture_model, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi!\nHow are you?\n/exit\n"))
    assert cli.main(["interactive", "--max-new-tokens", "4", "--quiet"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert out.count("reused from the cache") == 2 and "0 reused" not in out.splitlines()[-1]


def test_demo(fixture_model, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--max-new-tokens", "3", "--quiet"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert out.count("── ") == len(cli.DEMO_PROMPTS) and "tok/s" in out


def test_benchmark_json_and_mlflow(fixture_model, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    code = cli.main(["benchmark", "--prompt-tokens", "16", "--new-tokens", "3", "--repeats", "1", "--json",
                     str(out), *_mlflow(tmp_path)])
    assert code == cli.EXIT_OK
    figures = json.loads(out.read_text())
    results = figures["results"]
    assert figures["settings"]["prompt_tokens"] == 16
    assert results["decode_steps"] == 2 and results["decode_tokens_per_second"] > 0
    assert results["prefill_tokens_per_second"] > 0 and results["peak_rss_bytes"] > 50_000_000
    client, runs = _runs(tmp_path)
    assert runs[0].data.metrics["benchmark.peak_rss_bytes"] == results["peak_rss_bytes"]
    assert "benchmark.json" in {f.path for f in client.list_artifacts(runs[0].info.run_id)}


def test_run_is_the_hydra_front_door(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--cfg", "job", "mlflow=off"]) == 0
    assert "max_new_tokens" in capsys.readouterr().out


def test_a_failed_experiment_ends_a_failed_run(fixture_model, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["generate", "Hello", "--max-new-tokens", "4", "--experiment",
                     "run_support.FailAtDecode:layer=2,decode_step=1", *_mlflow(tmp_path)])
    assert code == cli.EXIT_FAILED
    err = capsys.readouterr().err
    assert "experiment 'fail_at_decode' failed in after_mlp (phase=decode, layer=2)" in err
    _, runs = _runs(tmp_path)
    assert runs[0].info.status == "FAILED" and "ember.failure" in runs[0].data.tags
