"""What a user sees on the console (issue 29, "The console" and "One vocabulary"): each check runs the real
command in a subprocess and reads its stdout, stderr and exit status (and the MLflow store it wrote)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_support import ctrl_c_as_in_a_terminal, prepared_store

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, smollm2_path):
    path = tmp_path_factory.mktemp("console")
    prepared_store(path / "outputs")
    return path


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "HYDRA_FULL_ERROR")}
    out["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), out.get("PYTHONPATH", "")])
    out.update(extra)
    return out


def run(workdir: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """`python -m ember.run ARGS` or, with "cli" first, `python -m ember.cli ARGS`."""
    module = ["-m", "ember.cli", *args[1:]] if args and args[0] == "cli" else ["-m", "ember.run", *args]
    return subprocess.run([sys.executable, *module], cwd=workdir, env=env(), capture_output=True, text=True,
                          timeout=timeout)


def runs_of(workdir: Path, experiment: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir / 'outputs' / 'mlflow.db'}")
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r}"
    return client.search_runs([found.experiment_id])


# ------------------------------------------------------------------------------------ the kernels' compile


def test_a_compile_is_announced_once_with_its_duration():
    from ember.quant.jit import announce_compilation, njit

    stream = io.StringIO()
    with announce_compilation(stream):
        first = njit(lambda a: a + 1)
        second = njit(lambda a: a * 2)
        assert first(1) + second(2) == 6  # two functions compile: one notice
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("ember: compiling ember's kernels") and "about 20 s" in lines[0]
    assert lines[1].startswith("ember: kernels compiled in ")
    stream = io.StringIO()
    with announce_compilation(stream):
        assert first(3) == 4  # already compiled: nothing to say
    assert stream.getvalue() == ""


def test_a_load_from_the_warm_cache_says_nothing_about_compiling(workdir):
    code = "import ember; ember.load_model('smollm2-135m', context_length=256)"
    for _ in range(2):  # the first may compile (a cold cache on this machine); the second must not
        done = subprocess.run([sys.executable, "-c", code], cwd=workdir, env=env(), capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr
    assert "compiling" not in done.stderr, done.stderr


# ------------------------------------------------------------------------------------ a sweep's output


def test_a_parallel_study_sweep_says_each_thing_once(workdir):
    done = run(workdir, "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "data=capitals",
               "data.limit=4", "experiment=ablation", "max_new_tokens=1", "layer=0,1",
               "mlflow.experiment_name=t_console_sweep")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "", "a sweep's stdout holds nothing but generated text, and a sweep shows none"
    lines = done.stderr.splitlines()
    assert not [line for line in lines if "[HYDRA]" in line or "Parallel(" in line], done.stderr
    assert "\x1b[" not in done.stderr
    recorded = [line for line in lines if "recorded as MLflow run" in line]
    assert len(recorded) == 2 and all(line.startswith("ember: job #") for line in recorded), recorded
    progress = [line for line in lines if line.startswith("ember: capitals: 4 items")]
    assert len(progress) <= 2 * 6, "progress lines only for items that take long, at most ~5 a job"
    assert not [line for line in lines if "preparing" in line and "0/" in line]
    assert lines[-1].startswith("ember: sweep of 2 job(s) finished in ")
    # Each job: its start, loading (start and end), preparing (its end line, when it took 3 s), summary
    # (1 + 3 key metrics), recorded; then the sweep's last line.
    assert len(lines) - len(progress) <= 2 * 9 + 1, done.stderr


def test_inline_prompts_print_their_text_and_metrics(workdir):
    done = run(workdir, "data=inline", "data.items=[Once upon a time,The weather today is]",
               "max_new_tokens=2", "mlflow.experiment_name=t_console_inline")
    assert done.returncode == 0, done.stderr
    shown = done.stdout.splitlines()
    assert len(shown) == 2 and shown[0].startswith("Once upon a time") and len(shown[0]) > 16
    assert shown[1].startswith("The weather today is")
    assert "  tokens.generated: 2 " in done.stderr
    [record] = runs_of(workdir, "t_console_inline")
    assert record.data.metrics["tokens.generated"] == 2.0


# ------------------------------------------------------------------------------------ the ember command


def test_benchmark_with_json_prints_one_line_and_writes_the_file(workdir):
    done = run(workdir, "cli", "benchmark", "--json", "bench/b.json", "--prompt-tokens", "4", "--new-tokens",
               "2", "--repeats", "1", "--no-mlflow")
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    assert line.startswith("smollm2-135m: load ") and "prefill of 4 tokens" in line and "MiB" in line
    figures = json.loads((workdir / "bench" / "b.json").read_text())
    assert figures["settings"]["prompt_tokens"] == 4 and figures["settings"]["repeats"] == 1


def test_every_benchmark_option_has_help():
    from ember.cli import build_parser

    parser = build_parser()
    bench = parser._subparsers._group_actions[0].choices["benchmark"]
    for action in bench._actions:
        assert action.help, f"{action.option_strings} has no help"


def test_only_the_commands_that_record_take_mlflow_options():
    """`interactive` and `demo` record no run, so they offer no `--mlflow-*` option that would do nothing."""
    from ember.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    for name, parser in commands.items():
        options = {o for action in parser._actions for o in action.option_strings}
        if name in ("interactive", "chat", "demo"):
            assert not {"--mlflow-uri", "--mlflow-experiment", "--no-mlflow"} & options, name
        elif name in ("generate", "extract", "probe", "benchmark"):
            assert {"--mlflow-uri", "--mlflow-experiment", "--no-mlflow"} <= options, name


def test_the_config_s_experiment_names_work_in_the_cli(workdir):
    done = run(workdir, "cli", "generate", "Hi", "--experiment", "zero_layer:layer=3",
               "--max-new-tokens", "1", "--no-mlflow", "--quiet")
    assert done.returncode == 0, done.stderr
    assert "zero_layer_output: zeroed" in done.stderr
    done = run(workdir, "cli", "generate", "Hi", "--experiment", "zero_layr:layer=3", "--no-mlflow")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "ember: unknown experiment 'zero_layr' in experiments[0] (did you mean zero_layer?); built-in "
        "experiments: ablation, activation_patching, activation_stats, attention_patterns, "
        "direct_logit_attribution, expert_ablation, expert_usage, head_patching, logit_lens, path_patching, "
        "steering, zero_layer (alias zero_layer_output); or a class by its dotted path, package.module.Class"]
    assert "_target_" not in done.stderr


# ------------------------------------------------------------------------------------ mistakes


@pytest.mark.parametrize(("args", "message"), [
    (["experiment=ablation", "layer=3", "experiments.0.mdoe=mean"],
     "ember: unknown config key 'experiments[0].mdoe' (did you mean mode?); an experiment takes its class's "
     "parameters (python -m ember.run --cfg job shows the config)"),
    (["experiment=ablation", "layer=3", "+experiments.0.mdoe=mean"],
     "ember: experiments[0] (ablation) has no parameter 'mdoe' (did you mean mode?); its parameters: layer, "
     "target, mode, phases, name"),
    (["layer=[1,2"], "ember: cannot read the override 'layer=[1,2' (no viable alternative at input '[1,2');"),
])
def test_mistakes_are_named_with_a_suggestion(workdir, args, message):
    for extra in ([], ["--config-dir", str(TESTS / "data")]):  # Hydra's --config-dir: the same checks
        done = run(workdir, *extra, *args)
        assert done.returncode == 2, done.stderr
        [line] = done.stderr.splitlines()
        assert line.startswith(message), line


def test_config_dir_does_not_skip_the_checks_before_hydra(workdir, tmp_path):
    extra = tmp_path / "conf" / "experiment"
    extra.mkdir(parents=True)
    (extra / "my_ablation.yaml").write_text("# @package _global_\nexperiments:\n  - name: ablation\n"
                                            "    layer: ${layer}\n")
    unreachable = "mlflow.tracking_uri=http://127.0.0.1:9"
    plain = run(workdir, unreachable, "max_new_tokens=1")
    with_dir = run(workdir, "--config-dir", str(tmp_path / "conf"), unreachable, "max_new_tokens=1")
    assert plain.returncode == with_dir.returncode == 2
    assert plain.stderr == with_dir.stderr and "is not reachable" in plain.stderr
    assert "loading" not in with_dir.stderr, "refused before anything loads"
    done = run(workdir, "--config-dir", str(tmp_path / "conf"), "experiment=my_ablaton", "layer=1")
    assert done.returncode == 2
    assert "experiment=my_ablaton: no such option (did you mean my_ablation?)" in done.stderr


def test_a_cluster_plugin_option_says_how_to_install_it():
    from hydra.errors import MissingConfigException

    from ember.runs.overrides import describe_hydra_error

    missing = MissingConfigException("not found", missing_cfg_file="hydra/sweeper/optuna", options=["basic"])
    assert describe_hydra_error(missing, ["hydra/sweeper=optuna"]) == (
        "hydra/sweeper=optuna: not installed (hydra-optuna-sweeper comes with ember's cluster extra: "
        "pip install -e '.[cluster]'); hydra/sweeper takes one of: basic")


# ------------------------------------------------------------------------------------ SIGTERM


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["ctrl-c", "sigterm"])
def test_the_exit_status_names_the_signal(workdir, tmp_path, sig, status):
    experiment = f"t_console_{signal.Signals(sig).name}"
    process = subprocess.Popen(
        [sys.executable, "-m", "ember.run", "max_new_tokens=8", "threads=1", "stop_at_eog=false",
         f"mlflow.experiment_name={experiment}",
         f"experiments=[{{_target_:run_support.WaitToBeKilled,folder:'{tmp_path}'}}]"],
        cwd=workdir, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=ctrl_c_as_in_a_terminal)  # a suite started in the background hands SIGINT ignored
    try:
        deadline = time.monotonic() + 600
        while not (tmp_path / "pid").exists():
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "never reached its waiting point"
            time.sleep(0.1)
        process.send_signal(sig)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == status, err
    [record] = runs_of(workdir, experiment)
    assert record.info.status == "KILLED"


# ------------------------------------------------------------------------------------ an HTTP server


@pytest.mark.slow
def test_a_run_on_a_server_prints_only_ember_s_line_about_it(workdir, tmp_path):
    from test_tracking_server import mlflow_server

    with mlflow_server(tmp_path) as base:
        done = run(workdir, "max_new_tokens=2", f"mlflow.tracking_uri={base}",
                   "mlflow.experiment_name=t_console_server")
    assert done.returncode == 0, done.stderr
    assert "View experiment" not in done.stdout + done.stderr and "View run" not in done.stdout
    assert done.stdout.startswith("The capital of France is") and len(done.stdout.splitlines()) == 1
    [recorded] = [line for line in done.stderr.splitlines() if "recorded as MLflow run" in line]
    assert recorded.endswith(f"(FINISHED) in {base}")


def test_no_colours_when_stderr_is_not_a_terminal():
    """Optuna's and colorlog's ANSI codes honour NO_COLOR, which the runner sets for a log or a pipe when
    it runs (importing ember.run sets nothing: a notebook keeps its colours), with MLflow's defaults."""
    code = ("import os, sys, ember.run\n"
            "imported = os.environ.get('NO_COLOR'), os.environ.get('MLFLOW_DISABLE_TELEMETRY')\n"
            "code = ember.run.main(['--cfg', 'job'])\n"
            "print(imported, os.environ.get('NO_COLOR'), os.environ.get('MLFLOW_DISABLE_TELEMETRY'), code,"
            " file=sys.stderr)\n")
    plain = {k: v for k, v in env().items() if k not in ("NO_COLOR", "MLFLOW_DISABLE_TELEMETRY")}
    done = subprocess.run([sys.executable, "-c", code], env=plain, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "(None, None) 1 true 0", done.stderr
