"""Experiments used by the runner tests through `_target_: run_support.<Class>` (tests/ on the path),
and helpers the subprocess tests share."""

from __future__ import annotations

import signal
from pathlib import Path

from ember.experiments import Experiment, ExperimentError, ExperimentResult, Metric
from ember.experiments.context import ExecutionPhase, LayerContext, TensorAccess


class FailAtDecode(Experiment):
    """Observes `after_mlp` at `layer`, and fails there on decode evaluation number `decode_step`."""

    name = "fail_at_decode"
    may_write = False

    def __init__(self, layer: int = 3, decode_step: int = 2) -> None:
        self.layer = layer
        self.decode_step = decode_step
        self.calls = 0
        self.decode_calls = 0

    def after_mlp(self, ctx: LayerContext, mlp_output: TensorAccess) -> None:
        if ctx.layer_index != self.layer:
            return
        self.calls += 1
        if ctx.execution.phase is ExecutionPhase.DECODE:
            self.decode_calls += 1
            if self.decode_calls == self.decode_step:
                raise ExperimentError(f"planned failure on decode evaluation {self.decode_step}")

    def results(self) -> ExperimentResult:
        return ExperimentResult(metrics=[Metric("calls", float(self.calls))],
                                tables={"calls": [{"layer": self.layer, "calls": self.calls}]})


class ScaleByOne(Experiment):
    """Writes, but multiplies by 1.0: an intervention that changes nothing (the effect must say so)."""

    name = "scale_by_one"

    def __init__(self, layer: int = 0) -> None:
        self.layer = layer

    def after_layer(self, ctx: LayerContext, hidden: TensorAccess) -> None:
        if ctx.layer_index == self.layer:
            hidden.values_mut()[...] *= 1.0


_TEMPLATE_STORE: list = []


def prepared_store(outputs: Path) -> Path:
    """An empty, migrated MLflow SQLite store at `outputs/mlflow.db`.

    Creating a store runs MLflow's schema migrations (seconds); this is done once per test session
    and the empty database file is copied for every test module that needs a fresh store.
    """
    import shutil
    import tempfile

    if not _TEMPLATE_STORE:
        from mlflow.tracking import MlflowClient

        folder = Path(tempfile.mkdtemp(prefix="ember_store_template_"))
        MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").search_experiments()
        _TEMPLATE_STORE.append(folder / "mlflow.db")
    outputs.mkdir(parents=True, exist_ok=True)
    target = outputs / "mlflow.db"
    if not target.exists():
        shutil.copyfile(_TEMPLATE_STORE[0], target)
    return target


class HardCrash(Experiment):
    """Ends its process at once (no exception, no cleanup): a worker that dies mid-job."""

    name = "hard_crash"
    may_write = False

    def before_prefill(self, ctx: object) -> None:
        import os

        os._exit(3)


class InterruptAfterItems(Experiment):
    """Raises KeyboardInterrupt (as Ctrl-C would) when the study reaches item number `items`."""

    name = "interrupt_after_items"
    may_write = False
    started = 0  # instances are made per item: count across them

    def __init__(self, items: int = 2) -> None:
        self.items = items

    def before_prefill(self, ctx: object) -> None:
        type(self).started += 1
        if type(self).started > self.items:
            raise KeyboardInterrupt


def wait_to_be_killed(folder: Path, seconds: float) -> None:
    """Write this process's pid to `folder/pid` (atomically) and wait, at most `seconds`, to be killed."""
    import os
    import time

    (folder / "pid.tmp").write_text(str(os.getpid()))
    (folder / "pid.tmp").rename(folder / "pid")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.1)
    raise ExperimentError(f"waited {seconds} s and nobody killed this process")


class WaitToBeKilled(Experiment):
    """In the job whose `layer` is `victim`: at decode evaluation number `decode_step` (by then that many
    tokens were generated), writes this process's pid to `folder/pid` and waits (at most `wait_seconds`)
    to be killed from outside; a job started again after that (`folder/killed` exists) runs through.
    Only the first job to get there waits (it claims `folder/claimed`), so with the defaults any one job
    of a sweep can be the victim. Every other job runs through at once."""

    name = "wait_to_be_killed"
    may_write = False

    def __init__(self, folder: str, layer: int = 0, victim: int = 0, wait_seconds: float = 300.0,
                 decode_step: int = 1) -> None:
        self.folder = Path(folder)
        self.waits = layer == victim
        self.wait_seconds = wait_seconds
        self.decode_step = decode_step
        self.decodes = 0

    def after_layer(self, ctx: LayerContext, hidden: TensorAccess) -> None:
        if not self.waits or ctx.execution.phase is not ExecutionPhase.DECODE or ctx.layer_index != 0:
            return
        self.decodes += 1
        if self.decodes < self.decode_step:
            return
        self.waits = False
        if not (self.folder / "killed").exists() and claim(self.folder / "claimed"):
            wait_to_be_killed(self.folder, self.wait_seconds)


def claim(path: Path) -> bool:
    """True for the one process that creates `path` first, however many try at once."""
    import os

    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class WaitToBeKilledAtItem(Experiment):
    """In a study: when item number `items` (0-based) starts, the items before it done, writes this
    process's pid to `folder/pid` and waits (at most `wait_seconds`) to be killed from outside."""

    name = "wait_to_be_killed_at_item"
    may_write = False
    started = 0  # instances are made per item: count across them

    def __init__(self, folder: str, items: int = 2, wait_seconds: float = 300.0) -> None:
        self.folder = Path(folder)
        self.items = items
        self.wait_seconds = wait_seconds

    def before_prefill(self, ctx: object) -> None:
        type(self).started += 1
        if type(self).started > self.items:
            wait_to_be_killed(self.folder, self.wait_seconds)


def ctrl_c_as_in_a_terminal() -> None:
    """`preexec_fn` of a child a test interrupts with SIGINT: Ctrl-C's default action in the child.
    A test run started in the background (a shell's `&`, nohup, some CI runners) hands its children
    SIGINT ignored, and Python then installs no KeyboardInterrupt handler: the interrupt would never
    arrive (seen: the suite run from a background script failed every Ctrl-C test)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class PauseAtDecode(Experiment):
    """At decode evaluation number `decode_step` (by then that many tokens were generated), creates
    `folder/paused` and waits until `folder/resume` exists (at most `wait_seconds`), then goes on: a test
    acts on the run at a known point (stops a server, say) however fast the machine generates."""

    name = "pause_at_decode"
    may_write = False

    def __init__(self, folder: str, decode_step: int = 1, wait_seconds: float = 300.0) -> None:
        self.folder = Path(folder)
        self.decode_step = decode_step
        self.wait_seconds = wait_seconds
        self.decodes = 0

    def after_layer(self, ctx: LayerContext, hidden: TensorAccess) -> None:
        if ctx.execution.phase is not ExecutionPhase.DECODE or ctx.layer_index != 0:
            return
        self.decodes += 1
        if self.decodes != self.decode_step:
            return
        import time

        (self.folder / "paused").touch()
        deadline = time.monotonic() + self.wait_seconds
        while not (self.folder / "resume").exists():
            if time.monotonic() > deadline:
                raise ExperimentError(f"waited {self.wait_seconds} s and nobody let this run resume")
            time.sleep(0.05)


# ------------------------------------------------------------------------------------ the store of `workdir`


def store_uri(workdir: Path) -> str:
    return f"sqlite:///{workdir / 'outputs' / 'mlflow.db'}"


def store_client(workdir: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(store_uri(workdir))


def runs_of(workdir: Path, experiment: str) -> list:
    mlflow = store_client(workdir)
    found = mlflow.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r}"
    return mlflow.search_runs([found.experiment_id], max_results=1000)


def only_run(workdir: Path, experiment: str):
    runs = runs_of(workdir, experiment)
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return runs[0]


def artifact(workdir: Path, run, path: str) -> Path:
    target = workdir / "downloads" / run.info.run_id
    target.mkdir(parents=True, exist_ok=True)
    return Path(store_client(workdir).download_artifacts(run.info.run_id, path, str(target)))
