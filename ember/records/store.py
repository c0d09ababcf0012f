"""Which MLflow store a run records in, and whether ember may use it: the URI resolved, credentials in a
URI refused, an unknown scheme refused, the store reached once before anything loads.

Default store: a SQLite database at `outputs/mlflow.db` with artifacts in `outputs/mlartifacts`,
relative to the directory the command is run from, unless `mlflow.tracking_uri` or
`MLFLOW_TRACKING_URI` names another store (e.g. `http://127.0.0.1:5000`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.errors import ConfigError, EmberError


@dataclass(frozen=True, slots=True)
class MlflowSettings:
    """Whether to record, where (None: `MLFLOW_TRACKING_URI`, else the default store), in which experiment."""

    tracking_uri: str | None
    experiment_name: str
    enabled: bool


@dataclass(frozen=True, slots=True)
class Store:
    """Where records go: the tracking URI and, for the embedded default, the artifact folder."""

    tracking_uri: str
    artifact_root: str | None = None


def resolve_store(settings: MlflowSettings, base_dir: str | os.PathLike[str] | None = None, *,
                  handed_over: str | None = None) -> Store:
    """`mlflow.tracking_uri`, else `MLFLOW_TRACKING_URI`, else SQLite + artifacts under `outputs/`.

    `handed_over`: the store of a sweep's parent run, handed to its jobs (`ember.records.sweep`); a job
    of a sweep records there, wherever it runs."""
    uri = handed_over or settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        refuse_credentials(uri)
        return Store(uri)
    outputs = Path(base_dir or os.getcwd()).resolve() / "outputs"
    outputs.mkdir(parents=True, exist_ok=True)
    return Store(f"sqlite:///{outputs / 'mlflow.db'}", (outputs / "mlartifacts").as_uri())


# What ember asks of MLflow unless the environment chose otherwise: no telemetry (records stay where the
# config says), no "View run at" lines (ember names the run itself), and a server that stops answering
# noticed in seconds (MLflow's defaults retry for ~4 minutes per request; the records then go to the
# run's outbox). MLflow reads telemetry's switch when it is imported: the front doors call
# `mlflow_environment()` first thing, and every client made here calls it too.
MLFLOW_DEFAULTS = {"MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
                   "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                   "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


def mlflow_environment() -> None:
    """Set `MLFLOW_DEFAULTS` where the environment has no value of its own."""
    for name, value in MLFLOW_DEFAULTS.items():
        os.environ.setdefault(name, value)


def mlflow_client(tracking_uri: str) -> Any:
    """An `MlflowClient` for the store, with MLflow's chatter quieted and `MLFLOW_DEFAULTS` in force."""
    mlflow_environment()
    from mlflow.tracking import MlflowClient

    from ember.records.store_template import seed_store

    quiet_mlflow_logging()
    seed_store(tracking_uri)  # a new SQLite store copied from a cached empty one, not migrated afresh
    return MlflowClient(tracking_uri=tracking_uri)


def quiet_mlflow_logging() -> None:
    """Keep MLflow's and Alembic's INFO chatter (store migrations) out of the run's output."""
    for name in ("alembic", "mlflow", "sqlalchemy", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _http_status(error: Exception) -> int | None:
    try:
        return int(error.get_http_status_code())  # type: ignore[attr-defined]
    except Exception:
        return None


def describe_mlflow_error(error: Exception, uri: str) -> str:
    """One line for an MLflow error: what the server said, and for a refusal what to do (the
    credentials themselves are never shown)."""
    status = _http_status(error)
    if status == 401:
        given = "MLFLOW_TRACKING_USERNAME" in os.environ and "MLFLOW_TRACKING_PASSWORD" in os.environ
        if given:
            return (f"the MLflow server at {uri} refused the credentials in MLFLOW_TRACKING_USERNAME / "
                    f"MLFLOW_TRACKING_PASSWORD (HTTP 401): wrong user name or password")
        return (f"the MLflow server at {uri} asks for credentials (HTTP 401): set MLFLOW_TRACKING_USERNAME "
                f"and MLFLOW_TRACKING_PASSWORD in the environment of every process that records")
    if status == 403:
        return (f"the MLflow server at {uri} does not let this user write here (HTTP 403): ask its admin "
                f"for EDIT permission on the experiment")
    message = getattr(error, "message", None) or str(error)
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    return f"MLflow ({uri}): {lines[0] if lines else type(error).__name__}"


class TrackingUnavailableError(EmberError):
    """The tracking server cannot be reached, or refuses ember, when a command starts."""


class CredentialsInUriError(EmberError):
    """A tracking URI with a user name or password in it."""


def refuse_credentials(uri: str) -> None:
    """Refuse a tracking URI with credentials in it (`http://user:pw@host`): ember records where its
    records go (params, tags, the sweep's files, log lines), and credentials travel only in the
    environment. The message shows the URI without them."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(uri)
        web = parts.scheme in ("http", "https")
        if not (parts.password is not None or (web and parts.username is not None)):
            return
    except ValueError:  # not a URL MLflow could use either: it says so itself
        return
    bare = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
    where = ("MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)" if web
             else "the database's own way (PGPASSWORD or ~/.pgpass for PostgreSQL)")
    raise CredentialsInUriError(f"the tracking URI {bare} has credentials in it, which ember would record "
                                f"with the runs: give the URI without them and the credentials in {where}")


# The stores MLflow 3 builds (mlflow.tracking._tracking_service.utils); plugins add theirs as entry points.
_STORE_SCHEMES = {"", "file", "sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks",
                  "databricks-uc", "uc"}


def check_scheme(tracking_uri: str) -> None:
    """A URI whose scheme no MLflow store takes is a ConfigError before anything loads (found by fuzzing:
    mlflow.tracking_uri=bogus://x failed only when the run started, after the model was loaded)."""
    from importlib.metadata import entry_points
    from urllib.parse import urlparse

    scheme = urlparse(tracking_uri).scheme.lower().split("+")[0]  # postgresql+psycopg2://
    if len(scheme) <= 1 or scheme in _STORE_SCHEMES:  # a path (C:\... parses as scheme "c")
        return
    if scheme in {e.name for e in entry_points(group="mlflow.tracking_store")}:
        return
    raise ConfigError(f"MLflow has no tracking store for {tracking_uri!r} (scheme {scheme}://): give a "
                      "path, sqlite:///..., http(s)://... or a database URI in mlflow.tracking_uri "
                      "(ember commands: --mlflow-uri)")


_DATABASE_SCHEMES = ("postgresql", "mysql", "mssql")


def _check_database(tracking_uri: str, timeout: float) -> None:
    """A database store (PostgreSQL, MySQL, SQL Server): its driver importable and one connection made,
    or a TrackingUnavailable error in one line (the password, if any, comes from the environment)."""
    import sqlalchemy

    try:
        engine = sqlalchemy.create_engine(tracking_uri, connect_args=(
            {"connect_timeout": int(max(1, timeout))} if tracking_uri.startswith(("postgresql", "mysql"))
            else {}))
    except ModuleNotFoundError as error:
        raise TrackingUnavailableError(
            f"the MLflow store {tracking_uri} needs the database driver {error.name!r}, which is not "
            "installed (pip install it, or pip install -e '.[cluster]' for PostgreSQL)") from None
    except Exception as error:  # noqa: BLE001 - SQLAlchemy's errors for a URI it cannot read
        raise ConfigError(f"cannot read the database URI {tracking_uri!r}: {error}") from None
    try:
        with engine.connect():
            pass
    except Exception as error:  # noqa: BLE001 - OperationalError and the drivers' own
        reason = str(getattr(error, "orig", error)).strip().splitlines()[0]
        raise TrackingUnavailableError(
            f"the MLflow store {tracking_uri} is not reachable ({reason}); start the database, record "
            "elsewhere with mlflow.tracking_uri=... (ember commands: --mlflow-uri), or record nothing with "
            "mlflow=off (--no-mlflow)") from None
    finally:
        engine.dispose()


def check_reachable(tracking_uri: str, timeout: float = 5.0) -> None:
    """For an HTTP store: one quick request (no retries) before anything is loaded; a TrackingUnavailable
    error naming the server, what happened and the way out. Other stores (SQLite, files) pass. A URI
    with credentials in it is refused first (`refuse_credentials`)."""
    refuse_credentials(tracking_uri)
    check_scheme(tracking_uri)
    if tracking_uri.startswith(_DATABASE_SCHEMES):
        _check_database(tracking_uri, timeout)
    if not tracking_uri.startswith(("http://", "https://")):
        return
    import base64
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{tracking_uri.rstrip('/')}/api/2.0/mlflow/experiments/search",
                                     data=b'{"max_results": 1}', method="POST",
                                     headers={"Content-Type": "application/json"})
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and password:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    elif os.environ.get("MLFLOW_TRACKING_TOKEN"):
        request.add_header("Authorization", f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}")
    way_out = ("start it, record elsewhere with mlflow.tracking_uri=... (ember commands: --mlflow-uri), "
               "or record nothing with mlflow=off (--no-mlflow)")
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            return
    except urllib.error.HTTPError as error:
        if error.code in (401, 403):
            raise TrackingUnavailableError(
                f"the MLflow tracking server at {tracking_uri} refused ember's credentials (HTTP "
                f"{error.code}): set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD for it") from None
        raise TrackingUnavailableError(
            f"the MLflow tracking server at {tracking_uri} answered HTTP {error.code} "
            f"({error.reason}); {way_out}") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise TrackingUnavailableError(
            f"the MLflow tracking server at {tracking_uri} is not reachable ({reason}); {way_out}") from None


