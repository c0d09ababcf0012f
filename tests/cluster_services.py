"""Real services for the cluster tests and the sweep benchmark, started on 127.0.0.1 and stopped again.

- `postgres()`: a PostgreSQL server of its own (Debian's `postgresql` package: `initdb` into a fresh
  folder, run as the `postgres` user when we are root), with a password-protected role and databases
  for MLflow's runs and its users.
- `tracking_server(db)`: `mlflow server` on that database, artifacts served through the server, basic
  auth on (`--app-name basic-auth`), an admin and a job user with passwords that only ever travel in
  environment variables.
- `ray_head()`: a Ray head with token auth, every port pinned inside a given range.

Ports come from ranges (`EMBER_TEST_PORTS_*`, defaults: PostgreSQL 5433-5439, MLflow 5200-5299, Ray GCS
6390-6399, Ray's other ports 20000-20999), each checked free before use, so parallel users of one
machine need only disjoint ranges. Each service runs in a process group of its own and is stopped
through it: nothing is left running, whatever the test did.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK = "127.0.0.1"
REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


class ServiceError(RuntimeError):
    """A service did not start; the message holds the end of its log."""


def port_range(name: str, default: str) -> range:
    low, high = os.environ.get(f"EMBER_TEST_PORTS_{name}", default).split("-")
    return range(int(low), int(high) + 1)


def is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port(ports: range) -> int:
    for port in ports:
        if is_free(port):
            return port
    raise ServiceError(f"no free port on {LOOPBACK} in {ports.start}-{ports.stop - 1}")


def _start(command: list[str], log: Path, env: dict[str, str] | None = None,
           cwd: Path | None = None) -> subprocess.Popen:
    with log.open("ab") as sink:
        return subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=cwd, start_new_session=True)


def _stop(process: subprocess.Popen, first: int = signal.SIGTERM, grace: float = 20.0) -> None:
    """Stop a service and everything in its process group: `first`, then SIGKILL after `grace` s."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, first)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):  # children left behind in the group
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def _tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


# ------------------------------------------------------------------------------------ PostgreSQL


@dataclass(frozen=True)
class Postgres:
    port: int
    user: str
    password: str
    pid: int = 0  # the process leading the server's session (see `service_processes`)

    def uri(self, database: str) -> str:
        """A SQLAlchemy URI without the password (it travels as PGPASSWORD)."""
        return f"postgresql://{self.user}@{LOOPBACK}:{self.port}/{database}"


def _postgres_bin() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if not found:
        raise ServiceError("PostgreSQL is not installed (Debian: apt-get install postgresql)")
    return found[-1].parent


@contextlib.contextmanager
def postgres(databases: tuple[str, ...] = ("mlflow", "mlflow_auth")) -> Iterator[Postgres]:
    """A PostgreSQL server on a free port, with role `ember` owning `databases`."""
    bin_dir = _postgres_bin()
    root = Path(tempfile.mkdtemp(prefix="ember-pg-"))
    as_postgres: list[str] = []
    if os.geteuid() == 0:  # initdb and postgres refuse to run as root
        shutil.chown(root, "postgres", "postgres")
        as_postgres = ["runuser", "-u", "postgres", "--"]
    root.chmod(0o700)
    log_dir = Path(tempfile.mkdtemp(prefix="ember-pg-log-"))
    log = log_dir / "postgres.log"
    superuser_password, password = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    pwfile = root / "pw"
    pwfile.write_text(superuser_password)
    if as_postgres:
        shutil.chown(pwfile, "postgres")
    init = subprocess.run([*as_postgres, str(bin_dir / "initdb"), "-D", str(root / "data"), "-U", "postgres",
                           "--auth-local=peer", "--auth-host=scram-sha-256", f"--pwfile={pwfile}",
                           "-E", "UTF8"], capture_output=True, text=True)
    pwfile.unlink()
    if init.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(log_dir, ignore_errors=True)
        raise ServiceError(f"initdb failed: {init.stderr[-2000:]}")
    port = free_port(port_range("POSTGRES", "5433-5439"))
    server = _start([*as_postgres, str(bin_dir / "postgres"), "-D", str(root / "data"), "-p", str(port),
                     "-c", f"listen_addresses={LOOPBACK}", "-k", str(root), "-c", "fsync=off"], log)
    try:
        env = {**os.environ, "PGPASSWORD": superuser_password}
        psql = ["psql", "-h", LOOPBACK, "-p", str(port), "-U", "postgres", "-v", "ON_ERROR_STOP=1", "-q"]
        deadline = time.monotonic() + 300  # a hang guard: PostgreSQL starts in seconds
        while subprocess.run([*psql, "-c", "SELECT 1"], env=env, capture_output=True).returncode != 0:
            if server.poll() is not None or time.monotonic() > deadline:
                raise ServiceError(f"PostgreSQL did not start on port {port}:\n{_tail(log)}")
            time.sleep(0.3)
        statements = [f"CREATE ROLE ember LOGIN PASSWORD '{password}'"]
        statements += [f"CREATE DATABASE {name} OWNER ember" for name in databases]
        for statement in statements:
            subprocess.run([*psql, "-c", statement], env=env, check=True, capture_output=True)
        yield Postgres(port, "ember", password, server.pid)
    finally:
        _stop(server, signal.SIGINT)  # fast shutdown
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(log_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------ MLflow


@dataclass(frozen=True)
class TrackingServer:
    url: str
    admin: tuple[str, str]
    user: tuple[str, str]
    artifacts: Path
    log: Path
    pid: int = 0

    def credentials(self, user: tuple[str, str] | None = None) -> dict[str, str]:
        """The environment variables a job needs to log as `user` (default: the job user)."""
        name, password = user or self.user
        return {"MLFLOW_TRACKING_USERNAME": name, "MLFLOW_TRACKING_PASSWORD": password}


def wait_until_healthy(url: str, process: subprocess.Popen, log: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServiceError(f"mlflow server exited with {process.returncode}:\n{_tail(log)}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        time.sleep(0.5)
    raise ServiceError(f"mlflow server did not answer within {seconds:.0f} s:\n{_tail(log)}")


@contextlib.contextmanager
def tracking_server(db: Postgres, folder: Path, startup_seconds: float = 300) -> Iterator[TrackingServer]:
    """`mlflow server` with basic auth on `db`, artifacts under `folder`; yields once a job user exists."""
    folder.mkdir(parents=True, exist_ok=True)
    auth_ini = folder / "basic_auth.ini"
    auth_ini.write_text("[mlflow]\ndefault_permission = READ\n"
                        f"database_uri = {db.uri('mlflow_auth')}\nadmin_username = admin\n"
                        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    admin = ("admin", secrets.token_urlsafe(18))
    user = ("ember-jobs", secrets.token_urlsafe(18))
    port = free_port(port_range("MLFLOW", "5200-5299"))
    url = f"http://{LOOPBACK}:{port}"
    env = {**os.environ, "PGPASSWORD": db.password, "MLFLOW_AUTH_CONFIG_PATH": str(auth_ini),
           "MLFLOW_AUTH_ADMIN_PASSWORD": admin[1], "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(24),
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = folder / "server.log"
    server = _start([sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth",
                     "--host", LOOPBACK, "--port", str(port), "--workers", "2",
                     "--backend-store-uri", db.uri("mlflow"), "--serve-artifacts",
                     "--artifacts-destination", str(folder / "artifacts")], log, env=env, cwd=folder)
    try:
        wait_until_healthy(url, server, log, startup_seconds)
        with _env(MLFLOW_TRACKING_USERNAME=admin[0], MLFLOW_TRACKING_PASSWORD=admin[1]):
            from mlflow.server.auth.client import AuthServiceClient

            AuthServiceClient(url).create_user(*user)
        yield TrackingServer(url, admin, user, folder / "artifacts", log, server.pid)
    finally:
        _stop(server)


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# ------------------------------------------------------------------------------------ Ray


@dataclass(frozen=True)
class RayHead:
    address: str
    token: str
    log: Path
    pid: int = 0
    ports: dict[str, int] = field(default_factory=dict)  # `ray start` option -> the port pinned

    def client_env(self) -> dict[str, str]:
        """What a driver needs to join this head (and nothing else: no ~/.ray token file)."""
        return {"RAY_ADDRESS": self.address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def _ray_ports() -> dict[str, int]:
    """Ray's own ports and a block of worker ports, all free, inside the 20000-20999 default range."""
    ports = port_range("RAY", "20000-20999")
    names = ("node-manager-port", "object-manager-port", "metrics-export-port",
             "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port")
    for base in range(ports.start, ports.stop - 100 + 1, 100):
        if all(is_free(p) for p in range(base, base + len(names))) and is_free(base + 10):
            chosen = {name: base + i for i, name in enumerate(names)}
            chosen.update({"min-worker-port": base + 10, "max-worker-port": base + 99})
            return chosen
    raise ServiceError(f"no free block of 100 ports in {ports.start}-{ports.stop - 1}")


@contextlib.contextmanager
def ray_head(cpus: int, folder: Path, env: dict[str, str] | None = None,
             startup_seconds: float = 120) -> Iterator[RayHead]:
    """`ray start --head` with `cpus` CPUs, token auth and every address on 127.0.0.1.

    `env` is added to the head's environment, which its workers inherit: the jobs' PYTHONPATH and, for
    a shared tracking server, MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD."""
    token = secrets.token_hex(32)
    gcs_port = free_port(port_range("RAY_GCS", "6390-6399"))
    # Ray binds the machine's network address unless told this is a single-machine cluster.
    head_env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN": token, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
    temp = Path(tempfile.mkdtemp(prefix="ember-ray-"))  # short: Ray's socket paths must fit
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "ray-head.log"
    ports = _ray_ports()
    options = [f"--{name}={port}" for name, port in ports.items()]
    ray = [sys.executable, "-m", "ray.scripts.scripts"]
    head = _start([*ray, "start", "--head", "--block", f"--port={gcs_port}", f"--num-cpus={cpus}",
                   "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}", *options],
                  log, env=head_env, cwd=folder)
    address = f"{LOOPBACK}:{gcs_port}"
    try:
        deadline = time.monotonic() + startup_seconds
        while "Ray runtime started" not in _tail(log, 100000):
            if head.poll() is not None or time.monotonic() > deadline:
                raise ServiceError(f"the Ray head did not start:\n{_tail(log)}")
            time.sleep(0.5)
        yield RayHead(address, token, log, head.pid, ports)
    finally:
        _stop(head, grace=15)
        shutil.rmtree(temp, ignore_errors=True)


def service_processes(leader: int) -> set[int]:
    """Every process of a service started by `_start`: its leader, all its descendants, and whatever
    still runs in its session (a daemon that left the tree)."""
    import psutil

    found = {leader}
    with contextlib.suppress(psutil.NoSuchProcess):
        found |= {child.pid for child in psutil.Process(leader).children(recursive=True)}
    for process in psutil.process_iter():
        with contextlib.suppress(OSError):
            if os.getsid(process.pid) == leader:
                found.add(process.pid)
    return found


def listening_addresses(pids: set[int]) -> set[str]:
    """Every local address:port the given processes listen on (TCP) or receive on (UDP), from `ss`."""
    done = subprocess.run(["ss", "-Hltunp"], capture_output=True, text=True, check=True)
    found = set()
    for line in done.stdout.splitlines():
        owners = {int(pid) for pid in re.findall(r"pid=(\d+),", line)}
        if owners & pids:
            found.add(line.split()[4])  # netid, state, recv-q, send-q, local address:port, ...
    return found
