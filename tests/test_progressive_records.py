"""What a run has so far is in its records while it works: `ember generate` and studies killed mid-way
(SIGKILL, as the OOM killer does, or Ctrl-C) keep the text and the items done so far, and the next
command closes them as KILLED. Real processes, killed while they wait at a known point (tests/run_support),
so what the run must hold does not depend on how fast a busy machine runs; a real SQLite store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_support import artifact, ctrl_c_as_in_a_terminal, only_run
from run_support import store_uri as store

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
PROMPT = "The capital of France is"

pytestmark = pytest.mark.usefixtures("no_outside_store")


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "HYDRA_FULL_ERROR")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def start(workdir: Path, *args: str) -> subprocess.Popen:
    """`python <args>` from `workdir`, checkpointing at every chance (EMBER_CHECKPOINT_SECONDS=0)."""
    env = subprocess_env(EMBER_CHECKPOINT_SECONDS="0")
    return subprocess.Popen([sys.executable, *args], cwd=workdir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=ctrl_c_as_in_a_terminal)


def stop_when_waiting(process: subprocess.Popen, folder: Path, sig: int) -> tuple[str, str]:
    """Once the process says it waits (`folder/pid`, tests/run_support.wait_to_be_killed), send `sig`;
    its stdout and stderr."""
    try:
        deadline = time.monotonic() + 300
        while not (folder / "pid").exists():
            if process.poll() is not None:
                pytest.fail(f"the process ended early ({process.returncode}): {process.communicate()[1]}")
            assert time.monotonic() < deadline, "the process never reached its waiting point"
            time.sleep(0.1)
        assert int((folder / "pid").read_text()) == process.pid
        if sig == signal.SIGKILL:
            os.killpg(process.pid, sig)
        else:
            process.send_signal(sig)
        return process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def repair(workdir: Path) -> str:
    """`ember runs repair` on the store, as a user would run it next; its stderr."""
    command = [sys.executable, "-m", "ember.cli", "runs", "repair", "--mlflow-uri", store(workdir)]
    done = subprocess.run(command, cwd=workdir, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stderr


def generate(workdir: Path, folder: Path, experiment: str, tokens: int) -> subprocess.Popen:
    """`ember generate` that waits to be killed once it has generated `tokens` tokens."""
    return start(workdir, "-m", "ember.cli", "generate", PROMPT, "--max-new-tokens", "64", "--quiet",
                 "--experiment", f"run_support.WaitToBeKilled:folder={folder},decode_step={tokens}",
                 "--mlflow-uri", store(workdir), "--mlflow-experiment", experiment)


def test_a_sigkilled_generate_keeps_its_text_and_the_next_command_closes_it(workdir, tmp_path, smollm2):
    out, _ = stop_when_waiting(generate(workdir, tmp_path, "t_generate_sigkill", 5), tmp_path,
                               signal.SIGKILL)
    assert only_run(workdir, "t_generate_sigkill").info.status == "RUNNING", "nobody closed it yet"

    err = repair(workdir)
    run = only_run(workdir, "t_generate_sigkill")
    assert f"MLflow run {run.info.run_id} (wait_to_be_killed smollm2-135m) was still RUNNING" in err
    assert run.info.status == "KILLED" and run.info.end_time >= run.info.start_time
    record = json.loads(artifact(workdir, run, "generation.json").read_text())
    assert record["stop_reason"] == "in progress" and record["complete"] is False
    assert len(record["token_ids"]) == 5, "every token generated before the kill"
    assert record["prompt_token_ids"] == smollm2.tokenize(PROMPT)
    assert record["text"] == smollm2.tokenizer.decode(record["token_ids"]) and record["text"].strip()
    assert out == PROMPT + record["text"], "the run keeps exactly the text shown"
    assert artifact(workdir, run, "generation.txt").read_text() == record["text"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_in_generate_closes_the_run_as_killed_with_the_text_shown(workdir, tmp_path, sig):
    experiment = f"t_generate_{signal.Signals(sig).name}"
    process = generate(workdir, tmp_path, experiment, 3)
    out, err = stop_when_waiting(process, tmp_path, sig)
    assert process.returncode == (143 if sig == signal.SIGTERM else 130), err  # 128 + the signal
    run = only_run(workdir, experiment)
    assert run.info.status == "KILLED"
    assert err.strip().splitlines()[-2:] == [
        f"ember: recorded as MLflow run {run.info.run_id} (KILLED) in {store(workdir)}", "ember: interrupted"]
    record = json.loads(artifact(workdir, run, "generation.json").read_text())
    assert record["stop_reason"] == "interrupted" and record["complete"] is False
    assert len(record["token_ids"]) == 3
    assert out == PROMPT + record["text"] and record["text"].strip()


def test_a_finished_generate_holds_the_complete_record(workdir, smollm2, monkeypatch, capsys):
    """Checkpoints at every token, then the final record under the same names: nothing stale."""
    import ember.model
    from ember import cli

    monkeypatch.setenv("EMBER_CHECKPOINT_SECONDS", "0")
    monkeypatch.setattr(ember.model, "load_model", lambda *args, **kwargs: smollm2)
    assert cli.main(["generate", PROMPT, "--max-new-tokens", "4", "--quiet", "--mlflow-uri", store(workdir),
                     "--mlflow-experiment", "t_generate_done"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    run = only_run(workdir, "t_generate_done")
    record = json.loads(artifact(workdir, run, "generation.json").read_text())
    assert record["complete"] is True and record["stop_reason"] in ("length", "eog")
    assert out == PROMPT + record["text"] + "\n"
    assert artifact(workdir, run, "generation.txt").read_text() == record["text"]


def test_a_sigkilled_study_keeps_the_items_it_did(workdir, tmp_path):
    process = start(workdir, "-m", "ember.run", "data=capitals", "data.limit=6", "max_new_tokens=1",
                    "threads=1", "mlflow.experiment_name=t_study_sigkill",
                    f"experiments=[{{_target_:run_support.WaitToBeKilledAtItem,folder:'{tmp_path}',items:3}}]")
    stop_when_waiting(process, tmp_path, signal.SIGKILL)
    assert only_run(workdir, "t_study_sigkill").info.status == "RUNNING"

    repair(workdir)
    run = only_run(workdir, "t_study_sigkill")
    assert run.info.status == "KILLED"
    assert run.data.tags["ember.study.items"] == "3"
    logged = json.loads(run.data.tags["mlflow.loggedArtifacts"])
    assert {"path": "study/items.json", "type": "table"} in logged
    items = json.loads(artifact(workdir, run, "study/items.json").read_text())
    rows = [dict(zip(items["columns"], row, strict=True)) for row in items["data"]]
    assert [row["item"] for row in rows] == [0, 1, 2], "the three items done before the kill, once each"
    assert rows[0]["prompt"] == PROMPT and all(row["generated"] for row in rows)
    assert all(0 < row["answer.prob"] <= 1 for row in rows)
