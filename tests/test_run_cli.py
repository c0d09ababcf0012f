"""`python -m ember.run` end to end on SmolLM2, checked through the MLflow store it writes.

Most runs go through `ember.run.main(argv)` in this process (the model stays loaded between tests,
as it does between the jobs of a sweep); the README's exact commands, user mistakes, Ctrl-C and the
parallel sweep run as real subprocesses. All runs share one SQLite store (creating a store costs
seconds); each test has its own MLflow experiment.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from run_support import artifact, ctrl_c_as_in_a_terminal, only_run, runs_of
from run_support import store_client as client

from ember import run as runner
from ember.runs import models
from ember.stages import LAYER_NAMES

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.usefixtures("no_outside_store")


def artifact_paths(workdir: Path, run) -> set[str]:
    mlflow = client(workdir)
    out: set[str] = set()

    def walk(path: str | None) -> None:
        for item in mlflow.list_artifacts(run.info.run_id, path):
            if item.is_dir:
                walk(item.path)
            else:
                out.add(item.path)

    walk(None)
    return out


def metric_steps(workdir: Path, run, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client(workdir).get_metric_history(run.info.run_id, key)}


def run_main(*args: str) -> int:
    return runner.main(list(args))


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "HYDRA_FULL_ERROR")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def ember_run(workdir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ember.run", *args], cwd=workdir, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------------ single runs


def test_quick_start_command_runs_the_default_model(workdir):
    done = ember_run(workdir)  # exactly `python -m ember.run`
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("The capital of France is")
    assert "Traceback" not in done.stderr
    run = only_run(workdir, "ember")
    assert run.info.status == "FINISHED" and run.info.run_name == "generate smollm2-135m"
    assert run.data.metrics["tokens.generated"] > 0


def test_zero_layer_run_records_params_tags_metrics_artifacts(workdir):
    assert run_main("experiment=zero_layer", "layer=7", "max_new_tokens=4",
                    "mlflow.experiment_name=t_zero") == 0
    run = only_run(workdir, "t_zero")
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "zero_layer_output[layer=7] smollm2-135m"

    params = run.data.params
    assert params["model.source"] == "smollm2-135m" and params["experiments.0.name"] == "zero_layer_output"
    assert params["experiments.0.layer"] == "7" and params["max_new_tokens"] == "4"
    overrides = "experiment=zero_layer layer=7 max_new_tokens=4 mlflow.experiment_name=t_zero"
    assert params["hydra.overrides"] == overrides

    tags = run.data.tags
    for key in ("ember.version", "ember.git_commit", "ember.git_dirty", "ember.config_digest", "model.sha256",
                "model.size_bytes", "model.architecture", "model.family", "model.quantization_mix",
                "numpy.version", "numpy.blas", "numpy.blas_threads", "ember.threads", "ember.threads_reason",
                "python.version", "platform"):
        assert tags.get(key), key
    assert tags["model.architecture"] == "llama" and tags["model.family"] == "llama"
    assert json.loads(tags["model.quantization_mix"]) == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert len(tags["model.sha256"]) == 64 and len(tags["ember.config_digest"]) == 64
    assert tags["ember.git_dirty"] in ("true", "false")

    metrics = run.data.metrics
    for key in ("model.load_seconds", "tokens.prompt", "tokens.generated", "prefill.tokens_per_second",
                "decode.tokens_per_second", "zero_layer_output.zeroed_tensors"):
        assert key in metrics, key
    assert metrics["tokens.generated"] == 4 and metrics["zero_layer_output.zeroed_tensors"] > 0

    # intervention effect: per-step series (step = generated token index) and a summary
    kl = metric_steps(workdir, run, "effect.kl")
    assert sorted(kl) == [0, 1, 2, 3] and all(v >= 0 for v in kl.values()) and max(kl.values()) > 1e-4
    assert sorted(metric_steps(workdir, run, "effect.top1_agree")) == [0, 1, 2, 3]
    assert "effect.first_divergent_step" in metrics and 0 <= metrics["effect.top1_agreement"] <= 1
    assert tags["ember.intervention_effect"] != "none: logits equal the clean model's"

    paths = artifact_paths(workdir, run)
    assert {"config.yaml", "generation.json", "generation.txt", "intervention_effect.json",
            "experiments/zero_layer_output/zeroed.json"} <= paths
    generation = json.loads(artifact(workdir, run, "generation.json").read_text())
    assert len(generation["token_ids"]) == 4 and generation["complete"] is True
    assert "layer: 7" in artifact(workdir, run, "config.yaml").read_text()


def test_activation_stats_logs_per_layer_series_arrays_and_a_figure(workdir, capsys):
    assert run_main("experiment=activation_stats", "prompt=Hello there", "max_new_tokens=2",
                    "mlflow.experiment_name=t_stats") == 0
    run = only_run(workdir, "t_stats")
    lines = capsys.readouterr().err.splitlines()
    summary = [line for line in lines if line.startswith("ember: activation_stats: ")]
    assert len(summary) == 1 and "residual RMS" in summary[0] and "after layer 29 (prefill)" in summary[0]
    assert summary[0].endswith("no NaN or inf (records: experiments/activation_stats/)")
    assert run.info.status == "FINISHED" and run.data.params["prompt"] == "Hello there"
    rms = metric_steps(workdir, run, "activation_stats.prefill/after_layer/rms")
    assert sorted(rms) == list(range(30)) and all(v > 0 for v in rms.values())
    paths = artifact_paths(workdir, run)
    assert "experiments/activation_stats/rms_by_layer.png" in paths
    assert "experiments/activation_stats/activation_stats.csv" in paths
    png = artifact(workdir, run, "experiments/activation_stats/rms_by_layer.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    array = np.load(artifact(workdir, run, "experiments/activation_stats/prefill/rms.npy"))
    after_layer = LAYER_NAMES.index("after_layer")
    assert array.shape == (len(LAYER_NAMES), 30)
    assert np.allclose(array[after_layer], [rms[i] for i in range(30)], rtol=1e-6)
    # an observer writes nothing: no clean-model comparison is made
    assert not any(k.startswith("effect.") for k in run.data.metrics)


def test_custom_experiment_from_the_experiments_folder(workdir, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    assert run_main("experiment=custom_steering", "max_new_tokens=3", "mlflow.experiment_name=t_steer") == 0
    run = only_run(workdir, "t_steer")
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "steering_vector[layer=6] smollm2-135m"
    assert run.data.metrics["steering_vector.steered_positions"] > 0
    assert run.data.metrics["effect.kl_max"] > 1e-3
    assert run.data.params["experiments.0._target_"] == "experiments.steering_vector.SteeringVector"


def test_vacuous_intervention_is_flagged(workdir):
    assert run_main("experiments=[{_target_:run_support.ScaleByOne,layer:2}]", "max_new_tokens=3",
                    "mlflow.experiment_name=t_vacuous") == 0
    run = only_run(workdir, "t_vacuous")
    assert run.data.tags["ember.intervention_effect"] == "none: logits equal the clean model's"
    assert run.data.metrics["effect.kl_max"] < 1e-6 and run.data.metrics["effect.top1_agreement"] == 1.0
    assert run.data.metrics["effect.first_divergent_step"] == -1


def test_effect_can_be_turned_off(workdir):
    assert run_main("experiment=zero_layer", "layer=7", "max_new_tokens=2", "intervention_effect=false",
                    "mlflow.experiment_name=t_no_effect") == 0
    run = only_run(workdir, "t_no_effect")
    assert not any(k.startswith("effect.") for k in run.data.metrics)


def test_chat_messages_go_through_the_chat_template(workdir):
    assert run_main("messages=[{role:user,content:Hi}]", "max_new_tokens=2",
                    "mlflow.experiment_name=t_chat") == 0
    run = only_run(workdir, "t_chat")
    assert run.data.params["messages.0.role"] == "user" and run.data.params["messages.0.content"] == "Hi"
    generation = json.loads(artifact(workdir, run, "generation.json").read_text())
    # the run's own model (the process-wide cache also holds models other tests loaded)
    recorded = Path(run.data.tags["model.path"]).resolve()
    tokenizer = next(model for (path, _, _), model in models._MODELS.items()
                     if Path(path) == recorded).tokenizer
    prompt = tokenizer.decode(generation["prompt_token_ids"], special=True)
    assert "<|im_start|>user\nHi<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_failing_experiment_gives_a_failed_run_with_its_record(workdir, capsys):
    code = run_main("experiments=[{_target_:run_support.FailAtDecode,layer:3,decode_step:2}]",
                    "max_new_tokens=6", "mlflow.experiment_name=t_fail")
    assert code == 1
    err = capsys.readouterr().err
    assert "experiment 'fail_at_decode' failed in after_mlp (phase=decode, layer=3): planned failure" in err
    run = only_run(workdir, "t_fail")
    assert run.info.status == "FAILED"
    assert err.strip().splitlines()[-1] == (f"ember: recorded as MLflow run {run.info.run_id} (FAILED) in "
                                            f"sqlite:///{workdir.resolve() / 'outputs' / 'mlflow.db'}")
    summary = "ember: fail_at_decode: calls=3; table calls (1 rows) (records: experiments/fail_at_decode/)"
    assert summary in err
    record = json.loads(artifact(workdir, run, "failure.json").read_text())
    assert record["experiment"] == "fail_at_decode" and record["hook"] == "after_mlp"
    assert record["phase"] == "decode" and record["layer"] == 3
    assert "planned failure on decode evaluation 2" in record["message"]
    assert record["generated_token_count"] == 2 and len(record["token_ids"]) == 2
    tags = run.data.tags
    assert tags["ember.failure.hook"] == "after_mlp" and tags["ember.failure.layer"] == "3"
    # what the experiment had recorded before failing is kept
    assert run.data.metrics["fail_at_decode.calls"] == 3  # prefill + 2 decode evaluations
    assert "experiments/fail_at_decode/calls.json" in artifact_paths(workdir, run)
    assert run.data.metrics["tokens.generated"] == 2


def test_a_user_mistake_ends_the_process_with_one_message_and_exit_2(workdir):
    done = ember_run(workdir, "experiment=zero_layer", "layer=30", "mlflow.experiment_name=t_mistakes")
    assert done.returncode == 2
    assert done.stderr.strip() == ("ember: experiments[0] (zero_layer_output).layer=30 is out of range: "
                                   "this model has 30 layers (0..29)")
    assert client(workdir).get_experiment_by_name("t_mistakes") is None, "nothing recorded, nothing loaded"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["max_new_tokens=100000"], "max_new_tokens=100000 cannot fit: the context holds 2048 tokens "
                                    "including the prompt (model.context_length=2048; this model supports "
                                    "up to 8192)"),
        (["sampling.top_p=two"], "sampling.top_p must be a number, got 'two'"),
        (["model.source=no-such-model"], "unknown model 'no-such-model'"),
        (["model=gemma3_270m", "model.source=smollm2-135m"], "model.family is 'gemma3' but"),
        (["experiments=[{name:zero_layer_output,layer:3,strength:2}]"], "has no parameter 'strength'"),
    ],
)
def test_user_mistakes_give_one_message_and_status_2(workdir, capsys, args, message):
    assert run_main(*args, "mlflow.experiment_name=t_mistakes") == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ember: ") and message in lines[0], err
    assert "Traceback" not in err


HYDRA_MISTAKES = [
    (["experiment=zero_layr"], "experiment=zero_layr: no such option (did you mean zero_layer?); experiment "
                               "takes one of: " + ", ".join(sorted(
                                   p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")))),
    (["max_new_token=5"], "unknown config key 'max_new_token' (did you mean max_new_tokens?); known keys: "),
    (["sampling.temprature=1"], "unknown config key 'sampling.temprature' (did you mean temperature?); "
                                "sampling takes: min_p, seed, temperature, top_k, top_p"),
    (["sampling=greeedy"], "sampling=greeedy: no such option (did you mean greedy?); sampling takes one of: "
                           "default, greedy"),
    (["hydra/launcher=jobl"], "hydra/launcher=jobl: no such option (did you mean joblib?)"),
    (["layer=[1,2"], "cannot read the override 'layer=[1,2'"),
    (["max_new_tokens"], "'max_new_tokens' has no value: write max_new_tokens=VALUE"),
    (["experiment="], "experiment= needs an option: experiment takes one of: "),
    (["layer=1,2"], "layer=1,2 gives several values: add -m to run one job per value"),
    (["experiments.0.layer=3"], "experiments.0.layer=3: experiments has no item 0"),
    (["+max_new_tokens=3"], "max_new_tokens is already in the config; set it without the +"),
    (["prompt=${nothing}"], "prompt: Interpolation key 'nothing' not found"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["-m", "layer=0,1", "experiment=none,zero_layr"], "experiment=zero_layr: no such option"),
    (["max_new_tokens=-1"], "max_new_tokens must be at least 0, got -1"),
    (["-m", "--cfg", "hydra", "layer=0,1"], "-m/--multirun and --cfg do not go together"),
]


@pytest.mark.parametrize(("args", "message"), HYDRA_MISTAKES)
def test_hydra_level_mistakes_are_one_line_and_exit_2(workdir, capsys, args, message):
    assert run_main(*args, "mlflow.experiment_name=t_hydra") == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ember: ") and message in lines[0], err
    assert client(workdir).get_experiment_by_name("t_hydra") is None, "nothing recorded"


@pytest.mark.parametrize("front_door", [["-m", "ember.run"], ["-m", "ember.cli", "run"]])
def test_both_front_doors_give_one_line_and_status_2(workdir, front_door):
    for args, message in (HYDRA_MISTAKES[0], HYDRA_MISTAKES[1]):
        done = subprocess.run([sys.executable, *front_door, *args], cwd=workdir, env=subprocess_env(),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("ember: ") and message in done.stderr


def test_hydra_full_error_does_not_bypass_the_one_line(workdir):
    done = subprocess.run([sys.executable, "-m", "ember.run", "max_new_token=5"], cwd=workdir,
                          env=subprocess_env(HYDRA_FULL_ERROR="1"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, "the preflight still refuses it in one line"
    assert done.stderr.startswith("ember: unknown config key 'max_new_token'")


def test_max_new_tokens_0_runs_the_prompt_only(workdir):
    assert run_main("max_new_tokens=0", "experiment=zero_layer", "layer=3",
                    "mlflow.experiment_name=t_prefill_only") == 0
    run = only_run(workdir, "t_prefill_only")
    assert run.data.metrics["tokens.generated"] == 0
    assert json.loads(artifact(workdir, run, "generation.json").read_text())["token_ids"] == []
    assert metric_steps(workdir, run, "effect.kl").keys() == {0}, "the prefill's next-token distribution"


def start_waiting_run(workdir: Path, experiment: str, folder: Path, tokens: int,
                      *experiments: str) -> subprocess.Popen:
    """`python -m ember.run` that checkpoints at every chance and, once it has generated `tokens` tokens,
    waits to be killed (tests/run_support.WaitToBeKilled): what the run holds then does not depend on how
    fast the machine generates. `experiments`: more entries of the run's list, before the waiting one."""
    waiting = f"{{_target_:run_support.WaitToBeKilled,folder:'{folder}',decode_step:{tokens}}}"
    return subprocess.Popen(
        [sys.executable, "-m", "ember.run", "max_new_tokens=64", "stop_at_eog=false",
         f"mlflow.experiment_name={experiment}", f"experiments=[{','.join([*experiments, waiting])}]"],
        cwd=workdir, env=subprocess_env(EMBER_CHECKPOINT_SECONDS="0"), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=ctrl_c_as_in_a_terminal,
    )


def wait_until_waiting(process: subprocess.Popen, folder: Path) -> None:
    """Until the run says it waits (`folder/pid`); 300 s guard against a hang, not a judgement of speed."""
    deadline = time.monotonic() + 300
    while not (folder / "pid").exists():
        if process.poll() is not None:
            pytest.fail(f"the run ended early ({process.returncode}): {process.communicate()[1]}")
        assert time.monotonic() < deadline, "the run never reached its waiting point"
        time.sleep(0.1)
    assert int((folder / "pid").read_text()) == process.pid


def test_ctrl_c_closes_the_run_as_killed_with_the_text_shown(workdir, tmp_path):
    process = start_waiting_run(workdir, "t_kill", tmp_path, 3)
    try:
        wait_until_waiting(process, tmp_path)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, err
    run = only_run(workdir, "t_kill")
    assert run.info.status == "KILLED"
    record = json.loads(artifact(workdir, run, "generation.json").read_text())
    assert record["stop_reason"] == "interrupted" and record["complete"] is False
    assert out == "The capital of France is" + record["text"], "the run keeps exactly the text shown"
    assert len(record["token_ids"]) == 3
    assert artifact(workdir, run, "generation.txt").read_text() == record["text"]
    lines = err.strip().splitlines()
    assert lines[-2] == "ember: interrupted (after 3 generated tokens, kept in the run)"
    assert lines[-1] == (f"ember: recorded as MLflow run {run.info.run_id} (KILLED) in "
                         f"sqlite:///{workdir.resolve() / 'outputs' / 'mlflow.db'}")
    assert "Traceback" not in err


def test_sigkill_keeps_the_last_checkpoint_and_the_next_command_closes_the_run(workdir, tmp_path):
    process = start_waiting_run(workdir, "t_sigkill", tmp_path, 4, "{name:activation_stats}")
    try:
        wait_until_waiting(process, tmp_path)
        os.killpg(process.pid, signal.SIGKILL)  # as the OOM killer would
        process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    run_id = only_run(workdir, "t_sigkill").info.run_id
    assert only_run(workdir, "t_sigkill").info.status == "RUNNING"
    from ember.records.tracker import repair_store

    store = f"sqlite:///{workdir / 'outputs' / 'mlflow.db'}"
    repaired = repair_store(client(workdir), store)
    assert [r.run_id for r in repaired] == [run_id]
    run = only_run(workdir, "t_sigkill")
    assert run.info.status == "KILLED" and run.info.end_time >= run.info.start_time
    record = json.loads(artifact(workdir, run, "generation.json").read_text())
    assert record["stop_reason"] == "in progress" and len(record["token_ids"]) == 4
    assert record["text"] and record["complete"] is False
    metrics = json.loads(artifact(workdir, run, "experiments/activation_stats/metrics.json").read_text())
    assert metrics and {"name", "value", "step"} <= set(metrics[0])
    assert any(path.startswith("experiments/activation_stats/") and path.endswith(".csv")
               for path in artifact_paths(workdir, run))


# ------------------------------------------------------------------------------------ sweeps


def sweep_runs(workdir: Path, experiment: str):
    runs = runs_of(workdir, experiment)
    parents = [r for r in runs if r.data.tags.get("ember.sweep") == "true"]
    assert len(parents) == 1
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == len(runs) - 1, "every run of the sweep is a child of its parent"
    return parent, sorted(children, key=lambda r: int(r.data.tags["ember.job"]))


def test_sweep_is_one_parent_run_and_reuses_the_loaded_model(workdir, capsys):
    models.clear()
    assert run_main("-m", "experiment=zero_layer", "layer=0,1,2,3", "max_new_tokens=2",
                    "mlflow.experiment_name=t_sweep") == 0
    err = capsys.readouterr().err
    progress = [line for line in err.splitlines() if line.startswith("ember: sweep job ")]
    assert progress == [f"ember: sweep job {i + 1}/4: experiment=zero_layer layer={i} max_new_tokens=2 "
                        "mlflow.experiment_name=t_sweep" for i in range(4)]
    parent, children = sweep_runs(workdir, "t_sweep")
    assert parent.info.status == "FINISHED" and len(children) == 4
    store = f"sqlite:///{workdir.resolve() / 'outputs' / 'mlflow.db'}"
    assert err.strip().splitlines()[-1].endswith(f"; parent MLflow run {parent.info.run_id} in {store}")
    for child in children:
        assert f"recorded as MLflow run {child.info.run_id} (FINISHED) in {store}" in err
    assert {r.data.tags["mlflow.source.name"] for r in [parent, *children]} == {"ember.run"}
    experiment = client(workdir).get_experiment_by_name("t_sweep")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert [c.data.params["experiments.0.layer"] for c in children] == ["0", "1", "2", "3"]
    assert all(c.info.status == "FINISHED" for c in children)
    assert [c.data.tags["ember.model_cache"] for c in children] == ["miss", "hit", "hit", "hit"]
    assert children[0].data.metrics["model.load_seconds"] > 0
    assert all(c.data.metrics["model.load_seconds"] == 0 for c in children[1:])
    assert parent.data.tags["ember.sweep.failed_jobs"] == "none"


def test_sweep_with_a_failed_job_runs_the_others_and_names_it(workdir, capsys):
    code = run_main("-m", "experiments=[{_target_:run_support.FailAtDecode,layer:1,decode_step:1}],[]",
                    "max_new_tokens=2", "layer=0,99", "mlflow.experiment_name=t_sweep_fail")
    assert code == 1
    err = capsys.readouterr().err
    assert "failed job(s) of 4" in err
    parent, children = sweep_runs(workdir, "t_sweep_fail")
    assert len(children) == 4 and parent.info.status == "FAILED"
    statuses = {c.data.tags["ember.overrides"]: c.info.status for c in children}
    assert sorted(statuses.values()) == ["FAILED", "FAILED", "FAILED", "FINISHED"]
    assert [o for o, s in statuses.items() if s == "FINISHED"] == ["experiments=[] max_new_tokens=2 layer=0 "
                                                                    "mlflow.experiment_name=t_sweep_fail"]
    failed_tag = parent.data.tags["ember.sweep.failed_jobs"]
    assert "layer=99" in failed_tag and "planned failure" in failed_tag
    assert failed_tag.count("job #") == 3


@pytest.mark.slow
def test_parallel_sweep_of_8_jobs_with_4_workers_leaves_8_child_runs(workdir):
    started = time.perf_counter()
    done = ember_run(workdir, "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=4",
                     "experiment=zero_layer", "layer=0,1,2,3,4,5,6,7", "max_new_tokens=2",
                     "mlflow.experiment_name=t_parallel", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    parent, children = sweep_runs(workdir, "t_parallel")
    assert len(children) == 8 and parent.info.status == "FINISHED"
    assert sorted(int(c.data.params["experiments.0.layer"]) for c in children) == list(range(8))
    assert all(c.info.status == "FINISHED" for c in children)
    cores = len(os.sched_getaffinity(0))
    assert {c.data.tags["ember.workers"] for c in children} == {"4"}
    assert {c.data.tags["ember.threads"] for c in children} == {str(max(1, cores // 4))}
    assert {c.data.tags["numpy.blas_threads"] for c in children} == {str(max(1, cores // 4))}
    print(f"parallel sweep of 8 jobs: {time.perf_counter() - started:.1f} s")


@pytest.mark.slow
def test_a_worker_that_dies_is_named_and_its_run_closed(workdir):
    done = ember_run(workdir, "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                     "experiments=[{_target_:run_support.HardCrash}],[]", "max_new_tokens=2",
                     "mlflow.experiment_name=t_crash", timeout=600)
    assert done.returncode == 1
    assert "job #0 (experiments=[{_target_:run_support.HardCrash}]" in done.stderr
    assert "died" in done.stderr
    # loky stops its whole pool when a worker dies: the other job may die with it, and is counted then
    ended = re.search(r"ember: the sweep stopped before its end, with (\d) failed job\(s\) of 2", done.stderr)
    assert ended is not None, done.stderr
    named = [line for line in done.stderr.splitlines() if line.startswith("  job #")]
    assert int(ended.group(1)) == len(named) and named[0].startswith("  job #0 ("), done.stderr
    parent, children = sweep_runs(workdir, "t_crash")
    assert parent.info.status == "FAILED" and "job #0" in parent.data.tags["ember.sweep.failed_jobs"]
    statuses = {c.data.tags["ember.job"]: c.info.status for c in children}
    assert statuses["0"] == "KILLED", "the dead worker's run is closed for it"
    assert all(s != "RUNNING" for s in statuses.values())
