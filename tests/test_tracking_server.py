"""A sweep recorded over HTTP by a real `mlflow server` on 127.0.0.1, checked through its REST API."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from run_support import prepared_store

from ember import run as runner

STARTUP_SECONDS = 180


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url: str, **query: str) -> dict:
    with urllib.request.urlopen(f"{url}?{urllib.parse.urlencode(query)}", timeout=30) as response:
        return json.loads(response.read())


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def wait_until_healthy(base: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"mlflow server exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"mlflow server did not answer within {STARTUP_SECONDS} s:\n{log.read_text()[-3000:]}")


def stop(server: subprocess.Popen) -> None:
    """Stop the server and the workers it started (its own process group)."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


@contextmanager
def mlflow_server(folder: Path) -> Iterator[str]:
    """A real `mlflow server` on 127.0.0.1 (a free port) with its store and artifacts under `folder`;
    yields its base URL once healthy, and stops it (and its workers) afterwards."""
    database = prepared_store(folder / "server")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = folder / "server.log"
    with log.open("w") as sink:
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{database}",
             "--artifacts-destination", str(folder / "server" / "artifacts")],
            stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, cwd=folder,
        )
    try:
        wait_until_healthy(base, server, log)
        yield base
    finally:
        stop(server)
    assert server.poll() is not None, "the server is still running"


@pytest.mark.slow
def test_sweep_recorded_by_a_real_mlflow_server(tmp_path, monkeypatch, smollm2_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with mlflow_server(tmp_path) as base:
        monkeypatch.chdir(tmp_path)
        code = runner.main(["-m", "experiment=zero_layer", "layer=0,1", "max_new_tokens=2",
                            f"mlflow.tracking_uri={base}", "mlflow.experiment_name=t_server"])
        assert code == 0

        api = f"{base}/api/2.0/mlflow"
        experiment = get(f"{api}/experiments/get-by-name", experiment_name="t_server")["experiment"]
        runs = post(f"{api}/runs/search", {"experiment_ids": [experiment["experiment_id"]],
                                           "max_results": 100})["runs"]
        tags = {r["info"]["run_id"]: {t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in runs}
        parents = [r for r in runs if tags[r["info"]["run_id"]].get("ember.sweep") == "true"]
        assert len(parents) == 1 and len(runs) == 3
        parent_id = parents[0]["info"]["run_id"]
        assert parents[0]["info"]["status"] == "FINISHED"
        children = [r for r in runs if tags[r["info"]["run_id"]].get("mlflow.parentRunId") == parent_id]
        assert len(children) == 2 and all(c["info"]["status"] == "FINISHED" for c in children)

        layers = set()
        for child in children:
            run_id = child["info"]["run_id"]
            params = {p["key"]: p["value"] for p in child["data"]["params"]}
            layers.add(params["experiments.0.layer"])
            metrics = {m["key"] for m in child["data"]["metrics"]}
            assert {"tokens.generated", "model.load_seconds", "effect.kl_mean"} <= metrics
            assert tags[run_id]["model.sha256"] and tags[run_id]["ember.config_digest"]
            history = get(f"{api}/metrics/get-history", run_id=run_id, metric_key="effect.kl")["metrics"]
            assert sorted(m["step"] for m in history) == [0, 1]
            listed = {f["path"] for f in get(f"{api}/artifacts/list", run_id=run_id).get("files", [])}
            assert {"config.yaml", "generation.json", "intervention_effect.json"} <= listed
            query = urllib.parse.urlencode({"path": "generation.json", "run_uuid": run_id})
            with urllib.request.urlopen(f"{base}/get-artifact?{query}", timeout=30) as response:
                assert len(json.loads(response.read())["token_ids"]) == 2
        assert layers == {"0", "1"}
        assert not (tmp_path / "outputs" / "mlflow.db").exists(), "records went to the server only"
