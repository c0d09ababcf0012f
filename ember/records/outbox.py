"""A run's records kept on local disk while its tracking server is away, and their upload later.

When a tracking server stops answering during a run (connection refused, timeout, HTTP 5xx after
MLflow's retries), the run's writes from then on go, in order, to `outputs/mlflow-outbox/<run id>/`:
`journal.jsonl` (one operation a line: a batch of params, tags and metrics with their timestamps, an
artifact file, the run's end; or the run's creation for a run started while the server was away) and
`files/` (the artifacts' bytes). `upload` replays the journal against the server, remembering in
`uploaded` how many operations are done, and removes the folder when all are. Every operation is
idempotent on an MLflow store (tags and artifacts overwrite, a param is written with the same value,
a metric with the same key, value, timestamp and step is stored once, a run is created at most once:
it is found again by its `ember.outbox_id` tag), so an upload that is itself interrupted and repeated
neither loses nor duplicates anything.

A folder is locked (`.lock`) by the process writing it until the run ends, and by an upload while it
runs; an upload skips locked folders.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JOURNAL, STORE, UPLOADED, IDS, FILES = "journal.jsonl", "store.json", "uploaded", "ids.json", "files"
PENDING_PREFIX = "pending-"
OUTBOX_ID_TAG = "ember.outbox_id"


def default_root(base_dir: str | os.PathLike[str] | None = None) -> Path:
    return Path(base_dir or os.getcwd()).resolve() / "outputs" / "mlflow-outbox"


def unreachable(error: BaseException, tracking_uri: str) -> bool:
    """Whether an MLflow error means the server is away (not that the request was wrong)."""
    if not tracking_uri.startswith(("http://", "https://")):
        return False
    import requests

    if isinstance(error, requests.exceptions.ConnectionError | requests.exceptions.Timeout):
        return True
    text = str(getattr(error, "message", "") or error)
    return "API request to" in text and (
        "failed with exception" in text or "failed with timeout exception" in text
        or re.search(r"failed with error code 5\d\d", text) is not None)


def new_placeholder() -> str:
    return PENDING_PREFIX + uuid.uuid4().hex


# ------------------------------------------------------------------------------------ writing


class Outbox:
    """One run's journal, held (locked) by the process that writes it."""

    def __init__(self, folder: Path) -> None:
        from filelock import FileLock

        self.folder = folder
        self.lock = FileLock(folder / ".lock")
        self.lock.acquire()
        self.sequence = len(_journal(folder))

    @classmethod
    def create(cls, root: Path, tracking_uri: str, run_id: str, experiment_id: str) -> Outbox:
        folder = root / run_id
        (folder / FILES).mkdir(parents=True, exist_ok=True)
        store = folder / STORE
        if not store.exists():
            _write_atomic(store, json.dumps({"tracking_uri": tracking_uri, "run_id": run_id,
                                             "experiment_id": experiment_id, "created": time.time()}))
        return cls(folder)

    def append(self, op: dict[str, Any], file: Path | None = None) -> None:
        """Journal one operation; `file` (an artifact) is moved into the outbox first."""
        self.sequence += 1
        if file is not None:
            target = self.folder / FILES / f"{self.sequence:06d}" / file.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file, target)
            op = {**op, "file": str(target.relative_to(self.folder))}
        with open(self.folder / JOURNAL, "a") as journal:
            journal.write(json.dumps(op) + "\n")
            journal.flush()
            os.fsync(journal.fileno())

    def release(self) -> None:
        self.lock.release()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _journal(folder: Path) -> list[dict[str, Any]]:
    try:
        lines = (folder / JOURNAL).read_text().splitlines()
    except OSError:
        return []
    ops = []
    for line in lines:
        try:
            ops.append(json.loads(line))
        except ValueError:  # a line cut short by a kill: nothing after it was written either
            break
    return ops


# ------------------------------------------------------------------------------------ operations


def perform(client: Any, op: dict[str, Any], folder: Path | None, ids: dict[str, str]) -> str | None:
    """Carry out one journal operation on the store; returns a new run id for `create_run`."""
    from mlflow.entities import Metric, Param, RunTag

    run_id = ids.get(op["run_id"], op["run_id"])
    kind = op["op"]
    if kind == "create_run":
        return _create_run(client, op)
    if kind == "log_batch":
        client.log_batch(run_id, metrics=[Metric(k, v, t, s) for k, v, t, s in op.get("metrics", [])],
                         params=[Param(k, v) for k, v in op.get("params", [])],
                         tags=[RunTag(k, v) for k, v in op.get("tags", [])])
    elif kind == "artifact":
        assert folder is not None
        client.log_artifact(run_id, str(folder / op["file"]), op.get("dir"))
    elif kind == "terminate":
        client.set_terminated(run_id, status=op["status"], end_time=op.get("end_time"))
    elif kind == "log_inputs":  # dataset inputs (ember.runs.study)
        from mlflow.entities import Dataset, DatasetInput, InputTag

        # each entry: name, digest, source type, source, schema, profile, context
        inputs = [DatasetInput(Dataset(*entry[:6]), [InputTag("mlflow.data.context", entry[6])])
                  for entry in op["datasets"]]
        _log_inputs(client, run_id, inputs)
    else:
        raise ValueError(f"unknown outbox operation {kind!r}")
    return None


# MLflow's database stores add a dataset's row (one per experiment, name and digest) by looking for it,
# then inserting it: two runs logging the same new dataset at the same moment can both miss it, and the
# second insert fails on the table's key. Seen: the two trials of a Ray search starting together on
# PostgreSQL ('duplicate key value violates unique constraint "dataset_pk"', one trial FAILED), and 1 to 5
# of 6 threads on a SQLite store. The failed call wrote nothing (its transaction was rolled back), so it is
# made again: then it finds the row and only links the run to it.
_DATASET_RACE = re.compile(r"dataset_pk|UNIQUE constraint failed: datasets\.|Duplicate entry .* for key "
                           r"'(datasets\.)?PRIMARY'")
_DATASET_ATTEMPTS = 5


def _log_inputs(client: Any, run_id: str, inputs: list[Any]) -> None:
    """`client.log_inputs`, made again when it lost the race to add the dataset's row (see above)."""
    for attempt in range(1, _DATASET_ATTEMPTS + 1):
        try:
            client.log_inputs(run_id, inputs)
            return
        except Exception as error:
            if attempt == _DATASET_ATTEMPTS or not _DATASET_RACE.search(str(error)):
                raise
            time.sleep(0.05 * attempt)


def _create_run(client: Any, op: dict[str, Any]) -> str:
    """The run a job started while the server was away, created once (found again by its tag)."""
    placeholder = op["run_id"]
    found = client.search_runs([op["experiment_id"]], max_results=1,
                               filter_string=f"tags.`{OUTBOX_ID_TAG}` = '{placeholder}'")
    if found:
        return found[0].info.run_id
    tags = {k: v for k, v in op.get("tags", [])} | {OUTBOX_ID_TAG: placeholder}
    run = client.create_run(op["experiment_id"], start_time=op.get("start_time"), tags=tags,
                            run_name=op.get("run_name"))
    return run.info.run_id


# ------------------------------------------------------------------------------------ upload


@dataclass(frozen=True, slots=True)
class Uploaded:
    folder: Path
    run_id: str
    operations: int


def pending(root: Path, tracking_uri: str) -> list[Path]:
    """The outbox folders under `root` holding records for this store, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for folder in root.iterdir():
        try:
            store = json.loads((folder / STORE).read_text())
        except (OSError, ValueError):
            continue
        if store.get("tracking_uri") == tracking_uri:
            found.append((float(store.get("created", 0)), folder))
    return [folder for _, folder in sorted(found)]


def upload(folder: Path, client: Any) -> Uploaded | None:
    """Replay one outbox; None when another process holds it (still writing, or uploading)."""
    from filelock import FileLock, Timeout

    lock = FileLock(folder / ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return None
    try:
        ops = _journal(folder)
        try:
            done = int((folder / UPLOADED).read_text())
        except (OSError, ValueError):
            done = 0
        try:
            ids = json.loads((folder / IDS).read_text())
        except (OSError, ValueError):
            ids = {}
        for index in range(done, len(ops)):
            created = perform(client, ops[index], folder, ids)
            if created is not None:
                ids[ops[index]["run_id"]] = created
                _write_atomic(folder / IDS, json.dumps(ids))
            _write_atomic(folder / UPLOADED, str(index + 1))
        store = json.loads((folder / STORE).read_text())
        run_id = ids.get(store["run_id"], store["run_id"])
        _clear_repair_mark(client, run_id, ops)
    finally:
        lock.release()
    shutil.rmtree(folder, ignore_errors=True)
    return Uploaded(folder, run_id, len(ops) - done)


def _clear_repair_mark(client: Any, run_id: str, ops: list[dict[str, Any]]) -> None:
    """A run closed as KILLED by a repair while its records waited here ends as its journal says."""
    if not any(op["op"] == "terminate" for op in ops):
        return
    from ember.records.heartbeat import REPAIRED

    if REPAIRED in client.get_run(run_id).data.tags:
        client.delete_tag(run_id, REPAIRED)


def flush(root: Path, tracking_uri: str, client: Any,
          report: Callable[[str], None] | None = None) -> list[Uploaded]:
    """Upload every outbox under `root` for this store; stops at the first that fails (the store is
    away again) and leaves it for later."""
    uploaded = []
    for folder in pending(root, tracking_uri):
        try:
            result = upload(folder, client)
        except Exception as error:
            if report is not None:
                report(f"ember: could not upload the records kept in {folder} yet: "
                       f"{str(getattr(error, 'message', '') or error).splitlines()[0]}")
            break
        if result is not None:
            uploaded.append(result)
            if report is not None:
                report(f"ember: uploaded {result.operations} record(s) of MLflow run {result.run_id} kept in "
                       f"{folder} while {tracking_uri} was away")
    return uploaded
