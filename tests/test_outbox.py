"""A tracking server that is away: refused at start in one line (exit 2, nothing loaded); away mid-run,
the run's records go to a local outbox and are uploaded later, nothing lost or duplicated. The outbox is
filled by real failed requests (a closed port on 127.0.0.1) and uploaded into real stores; the slow test
starts and kills a real `mlflow server`."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from run_support import prepared_store

from ember import cli
from ember.records import outbox
from ember.records.store import Store, TrackingUnavailableError, check_reachable
from ember.records.tracker import FINISHED, Tracker

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
PORTS = range(5100, 5200)  # this project's range on 127.0.0.1


def closed_port() -> int:
    """A port of the range nothing listens on."""
    for port in PORTS:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                return port
    pytest.skip("every port of the range is in use")


def free_port() -> int:
    for port in PORTS:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip("no free port in the range")


@pytest.fixture(autouse=True)
def _fast_failures(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "HYDRA_FULL_ERROR")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")])
    return {**env, **extra}


# ------------------------------------------------------------------------------------ away at start


@pytest.mark.parametrize("command", [
    ["-m", "ember.run", "max_new_tokens=2"],
    ["-m", "ember.run", "-m", "layer=0,1", "experiment=zero_layer", "max_new_tokens=2"],
    ["-m", "ember.cli", "generate", "Hi", "--max-new-tokens", "2"],
    ["-m", "ember.cli", "runs", "repair"],
])
def test_a_server_away_at_start_is_one_line_and_exit_2_before_loading(tmp_path, command):
    port = closed_port()
    uri = f"http://127.0.0.1:{port}"
    option = ["--mlflow-uri", uri] if "ember.cli" in command else [f"mlflow.tracking_uri={uri}"]
    started = time.monotonic()
    done = subprocess.run([sys.executable, *command, *option], cwd=tmp_path, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    expected = f"ember: the MLflow tracking server at {uri} is not reachable ("
    assert done.stderr.startswith(expected), done.stderr
    assert "Connection refused" in done.stderr and "mlflow=off (--no-mlflow)" in done.stderr
    assert "loading" not in done.stderr and done.stdout == ""
    assert not (tmp_path / "outputs" / "multirun").exists(), "no sweep was started"
    print(f"{command[1]} {command[2]}: refused in {time.monotonic() - started:.1f} s")


@pytest.mark.parametrize(("scheme", "expected"), [
    ("postgresql+pg8000", "the MLflow store {uri} needs the database driver 'pg8000'"),  # not installed
    ("postgresql+nosuchdriver", "cannot read the database URI '{uri}'"),  # no such SQLAlchemy driver
    ("postgresql", "the MLflow store {uri} is not reachable (connection failed"),  # psycopg, no server
])
def test_a_database_store_away_at_start_is_one_line_and_exit_2(tmp_path, scheme, expected):
    if scheme == "postgresql":
        pytest.importorskip("psycopg", reason="the cluster extra's PostgreSQL driver")
    if scheme == "postgresql+pg8000" and importlib.util.find_spec("pg8000") is not None:
        pytest.skip("pg8000 is installed here")
    uri = f"{scheme}://ember@127.0.0.1:{closed_port()}/mlflow"
    expected = expected.format(uri=uri)
    done = subprocess.run([sys.executable, "-m", "ember.run", f"mlflow.tracking_uri={uri}"], cwd=tmp_path,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"ember: {expected}"), done.stderr
    assert "loading" not in done.stderr and not (tmp_path / "outputs").exists()


def test_a_server_refusing_credentials_is_named(tmp_path):
    """A real HTTP server answering 401 to everything (as an MLflow server with basic auth does)."""
    import http.server
    import threading

    class Unauthorized(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.send_response(401)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", free_port()), Unauthorized)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        uri = f"http://127.0.0.1:{server.server_port}"
        refused = r"refused ember's credentials \(HTTP 401\)"
        with pytest.raises(TrackingUnavailableError, match=refused):
            check_reachable(uri)
    finally:
        server.shutdown()


# ------------------------------------------------------------------------------------ the outbox


def open_store(folder: Path) -> tuple[str, object]:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{prepared_store(folder)}"
    return uri, MlflowClient(uri)


def write_a_run_while_away(tmp_path: Path, client, experiment_id: str) -> tuple[str, Path, Tracker]:
    """A run that exists in the store, then written through a tracker whose server refuses connections:
    every write lands in the outbox, in order."""
    run_id = client.create_run(experiment_id, run_name="away").info.run_id
    away = Tracker.attach(Store(f"http://127.0.0.1:{closed_port()}"), experiment_id,
                                   outbox_root=tmp_path / "outbox")
    away.log_params(run_id, {"p": 1, "q": "two"})
    away.set_tags(run_id, {"t": "v"})
    away.log_metrics(run_id, [("series", float(i), i) for i in range(5)] + [("single", 2.5, 0)])
    away.log_json(run_id, {"text": "kept"}, "generation.json")
    away.log_array(run_id, np.arange(6.0).reshape(2, 3), "experiments/x/grid.npy")
    away.log_text(run_id, "a,b\n1,2\n", "experiments/x/table.csv")
    return run_id, away.outbox_of(run_id), away


def test_records_written_while_away_are_journaled_in_order(tmp_path, capsys):
    _, client = open_store(tmp_path / "store")
    experiment = client.create_experiment("away")
    run_id, folder, away = write_a_run_while_away(tmp_path, client, experiment)
    assert folder == tmp_path / "outbox" / run_id
    assert "stopped answering" in capsys.readouterr().err
    ops = [json.loads(line) for line in (folder / "journal.jsonl").read_text().splitlines()]
    assert [op["op"] for op in ops] == ["log_batch"] * 3 + ["artifact"] * 3
    assert ops[3]["file"].endswith("generation.json") and ops[4]["dir"] == "experiments/x"
    away.end_run(run_id, FINISHED)  # the end is journaled too; the server is still away
    assert json.loads((folder / "journal.jsonl").read_text().splitlines()[-1])["op"] == "terminate"
    assert client.get_run(run_id).info.status == "RUNNING", "nothing reached the store"


def test_upload_delivers_everything_once_even_when_repeated(tmp_path):
    uri, client = open_store(tmp_path / "store")
    experiment = client.create_experiment("away")
    run_id, folder, away = write_a_run_while_away(tmp_path, client, experiment)
    away.end_run(run_id, FINISHED)
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns(".lock"))

    uploaded = outbox.upload(folder, client)
    assert uploaded.run_id == run_id and uploaded.operations == 7 and not folder.exists()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"p": "1", "q": "two"}
    assert run.data.tags["t"] == "v" and run.data.metrics["single"] == 2.5
    history = client.get_metric_history(run_id, "series")
    assert [(m.step, m.value) for m in history] == [(i, float(i)) for i in range(5)]
    downloaded = Path(client.download_artifacts(run_id, "", str(tmp_path / "dl")))
    assert json.loads((downloaded / "generation.json").read_text()) == {"text": "kept"}
    assert np.array_equal(np.load(downloaded / "experiments/x/grid.npy"), np.arange(6.0).reshape(2, 3))

    # An upload killed before it could note its progress runs again from the start: nothing doubles.
    again = outbox.upload(copy, client)
    assert again.operations == 7
    assert len(client.get_metric_history(run_id, "series")) == 5
    assert len(client.get_metric_history(run_id, "single")) == 1
    assert client.get_run(run_id).data.params == {"p": "1", "q": "two"}


def test_a_run_started_while_away_is_created_once_at_upload(tmp_path):
    uri, client = open_store(tmp_path / "store")
    experiment = client.create_experiment("away")
    away = Tracker.attach(Store(f"http://127.0.0.1:{closed_port()}"), experiment,
                                   outbox_root=tmp_path / "outbox")
    run_id = away.start_run("started while away", {"k": "v"})
    assert run_id.startswith(outbox.PENDING_PREFIX)
    away.log_metrics(run_id, [("m", 1.0, 0)])
    away.end_run(run_id, FINISHED)
    folder = tmp_path / "outbox" / run_id
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns(".lock"))
    first = outbox.upload(folder, client)
    second = outbox.upload(copy, client)
    runs = client.search_runs([experiment])
    assert len(runs) == 1 and first.run_id == second.run_id == runs[0].info.run_id
    assert runs[0].info.status == "FINISHED" and runs[0].data.metrics["m"] == 1.0
    assert runs[0].data.tags["k"] == "v" and runs[0].info.run_name == "started while away"


@pytest.mark.parametrize("next_command", ["a run", "ember runs upload"])
def test_the_next_command_and_runs_upload_send_kept_records(tmp_path, monkeypatch, capsys, smollm2_path,
                                                            next_command):
    uri, client = open_store(tmp_path / "outputs")
    experiment = client.create_experiment("away")
    monkeypatch.chdir(tmp_path)
    run_id = client.create_run(experiment).info.run_id
    away = Tracker.attach(Store(f"http://127.0.0.1:{closed_port()}"), experiment)
    away.log_metrics(run_id, [("m", 3.0, 0)])
    away.end_run(run_id, FINISHED)
    folder = tmp_path / "outputs" / "mlflow-outbox" / run_id
    store = json.loads((folder / "store.json").read_text())
    store["tracking_uri"] = uri  # as if the store that was away were this one
    (folder / "store.json").write_text(json.dumps(store))
    capsys.readouterr()
    if next_command == "a run":  # an ordinary run on the store (its default one, outputs/mlflow.db)
        from ember import run as runner

        assert runner.main(["max_new_tokens=1", "threads=1", "mlflow.experiment_name=t_next"]) == 0
        [next_run] = client.search_runs([client.get_experiment_by_name("t_next").experiment_id])
        assert next_run.info.status == "FINISHED"
    else:
        assert cli.main(["runs", "upload"]) == 0
    err = capsys.readouterr().err
    assert f"ember: uploaded 2 record(s) of MLflow run {run_id} kept in {folder}" in err
    assert client.get_run(run_id).info.status == "FINISHED" and not folder.exists()
    assert [m.value for m in client.get_metric_history(run_id, "m")] == [3.0], "stored once"
    assert cli.main(["runs", "upload"]) == 0
    assert capsys.readouterr().err.strip() == f"ember: no records waiting for {uri}"


# ------------------------------------------------------------------------------------ a real server


def start_server(tmp_path: Path, port: int) -> subprocess.Popen:
    database = prepared_store(tmp_path / "server")
    log = (tmp_path / "server.log").open("a")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{database}", "--artifacts-destination",
         str(tmp_path / "server" / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return server
        except OSError:
            time.sleep(0.5)
    pytest.fail("mlflow server did not start")


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGKILL)  # as a crash would
        server.wait(timeout=60)


def rest(base: str, path: str, body: dict | None = None, **query: str) -> dict:
    url = f"{base}/api/2.0/mlflow/{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def runs_of(base: str, experiment_name: str) -> list[dict]:
    experiment = rest(base, "experiments/get-by-name", experiment_name=experiment_name)["experiment"]
    return rest(base, "runs/search", {"experiment_ids": [experiment["experiment_id"]]}).get("runs", [])


@pytest.mark.slow
def test_the_next_run_on_the_server_uploads_the_kept_records_once(tmp_path, smollm2_path):
    """A run whose server went away mid-run kept its records (real refused requests to the server's
    address); the next ordinary run, once that server is up, uploads them before its own work:
    everything once, nothing left waiting."""
    from mlflow.tracking import MlflowClient

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    work = tmp_path / "work"
    kept_root = work / "outputs" / "mlflow-outbox"  # where `python -m ember.run` in `work` looks
    # What reached the server before it went away: the run, a first metric (written into its database).
    database = MlflowClient(f"sqlite:///{prepared_store(tmp_path / 'server')}")
    experiment = database.create_experiment("t_kept", artifact_location="mlflow-artifacts:/t_kept")
    run_id = database.create_run(experiment, run_name="kept while away").info.run_id
    database.log_metric(run_id, "before", 1.0, step=0)
    away = Tracker.attach(Store(base), experiment, outbox_root=kept_root)
    away.log_metrics(run_id, [("series", float(i), i) for i in range(5)])
    away.log_json(run_id, {"text": "kept"}, "generation.json")
    away.end_run(run_id, FINISHED)
    kept = kept_root / run_id
    assert len((kept / "journal.jsonl").read_text().splitlines()) == 3, "metrics, artifact, end"

    server = start_server(tmp_path, port)  # back, its store as it was
    try:
        command = ["-m", "ember.run", "max_new_tokens=2", f"mlflow.tracking_uri={base}",
                   "mlflow.experiment_name=t_next"]
        done = subprocess.run([sys.executable, *command], cwd=work, env=subprocess_env(), capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        assert f"ember: uploaded 3 record(s) of MLflow run {run_id} kept in {kept}" in done.stderr
        assert not kept.exists()
        run = rest(base, "runs/get", run_id=run_id)["run"]
        assert run["info"]["status"] == "FINISHED"
        for key, steps in (("before", [0]), ("series", [0, 1, 2, 3, 4])):
            history = rest(base, "metrics/get-history", run_id=run_id, metric_key=key)["metrics"]
            assert sorted(m["step"] for m in history) == steps, f"{key}: each value stored once"
        query = urllib.parse.urlencode({"path": "generation.json", "run_uuid": run_id})
        with urllib.request.urlopen(f"{base}/get-artifact?{query}", timeout=30) as response:
            assert json.loads(response.read()) == {"text": "kept"}
        assert len(runs_of(base, "t_kept")) == 1, "the kept run was not created again"
        [next_run] = runs_of(base, "t_next")
        assert next_run["info"]["status"] == "FINISHED", "the run itself went on as usual"
        again = subprocess.run([sys.executable, "-m", "ember.cli", "runs", "upload", "--mlflow-uri", base],
                               cwd=work, env=subprocess_env(), capture_output=True, text=True, timeout=600)
        assert again.stderr.strip() == f"ember: no records waiting for {base}"
    finally:
        stop_server(server)


@pytest.mark.slow
def test_a_server_that_dies_mid_run_loses_and_duplicates_nothing(tmp_path, smollm2_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(tmp_path, port)
    work = tmp_path / "work"
    work.mkdir()
    tokens = 40  # checkpointed at every one: the journal grows with each (300 took over 13 min here)
    pause = tmp_path / "pause"
    pause.mkdir()
    pausing = f"{{_target_:run_support.PauseAtDecode,folder:'{pause}',decode_step:3}}"
    experiments = f"[{{name:activation_stats}},{pausing}]"
    process = subprocess.Popen(
        [sys.executable, "-m", "ember.run", f"max_new_tokens={tokens}", "stop_at_eog=false",
         f"experiments={experiments}", f"mlflow.tracking_uri={base}", "mlflow.experiment_name=t_outage"],
        cwd=work, env=subprocess_env(EMBER_CHECKPOINT_SECONDS="0", MLFLOW_HTTP_REQUEST_MAX_RETRIES="1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # the run pauses after 3 tokens (checkpointed at each), so the server stops mid-run on any machine;
        # the deadline guards against a hang, it judges no speed
        deadline = time.monotonic() + 600
        run_id = None
        while time.monotonic() < deadline and run_id is None:  # paused, its first checkpoint on the server
            assert process.poll() is None, process.communicate()[1]
            try:
                experiment = rest(base, "experiments/get-by-name", experiment_name="t_outage")["experiment"]
                found = rest(base, "runs/search", {"experiment_ids": [experiment["experiment_id"]]})
                runs = found.get("runs")
                listed = rest(base, "artifacts/list", run_id=runs[0]["info"]["run_id"]) if runs else {}
                if (pause / "paused").exists() and any(f["path"] == "generation.json"
                                                       for f in listed.get("files", [])):
                    run_id = runs[0]["info"]["run_id"]
            except OSError:
                pass
            time.sleep(0.2)
        assert run_id, "no checkpoint reached the server"
        stop_server(server)  # mid-run
        (pause / "resume").touch()
        out, err = process.communicate(timeout=1800)
    finally:
        if process.poll() is None:
            process.kill()
        stop_server(server)
    assert process.returncode == 0, err
    assert f"the tracking server at {base} stopped answering" in err
    kept = work / "outputs" / "mlflow-outbox" / run_id
    assert kept.is_dir() and f"recorded as MLflow run {run_id} (FINISHED) in {base}" in err

    server = start_server(tmp_path, port)  # back, same store
    try:
        done = subprocess.run([sys.executable, "-m", "ember.cli", "runs", "upload", "--mlflow-uri", base],
                              cwd=work, env=subprocess_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        assert f"of MLflow run {run_id} kept in {kept}" in done.stderr and not kept.exists()
        run = rest(base, "runs/get", run_id=run_id)["run"]
        assert run["info"]["status"] == "FINISHED"
        metrics = {m["key"]: m["value"] for m in run["data"]["metrics"]}
        assert metrics["tokens.generated"] == tokens
        for key in [k for k in metrics if k.startswith("activation_stats.")][:20]:
            history = rest(base, "metrics/get-history", run_id=run_id, metric_key=key)["metrics"]
            steps = [m["step"] for m in history]
            assert len(steps) == len(set(steps)), f"{key} was stored twice"
        query = urllib.parse.urlencode({"path": "generation.json", "run_uuid": run_id})
        with urllib.request.urlopen(f"{base}/get-artifact?{query}", timeout=30) as response:
            record = json.loads(response.read())
        assert record["complete"] is True and len(record["token_ids"]) == tokens
        again = subprocess.run([sys.executable, "-m", "ember.cli", "runs", "upload", "--mlflow-uri", base],
                               cwd=work, env=subprocess_env(), capture_output=True, text=True, timeout=600)
        assert again.stderr.strip() == f"ember: no records waiting for {base}"
    finally:
        stop_server(server)
