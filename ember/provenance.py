"""Where a result came from: engine version and commit, numerical libraries, machine, config digest."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

import ember


def _git(*args: str) -> str | None:
    root = Path(ember.__file__).resolve().parent.parent
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@functools.cache
def git_state() -> tuple[str, str]:
    """(commit, dirty) of the checkout ember runs from; dirty is "true"/"false" ("unknown" outside git)."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return "unknown", "unknown"
    status = _git("status", "--porcelain", "--untracked-files=no")
    dirty = "unknown" if status is None else ("true" if status else "false")
    return commit, dirty


def blas_description() -> tuple[str, int]:
    """("openblas 0.3.29 (pthreads)", threads) of the BLAS NumPy uses right now."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown", 0
    pools = [p for p in threadpool_info() if p.get("user_api") == "blas"]
    if not pools:
        return "unknown", 0
    pool = pools[0]
    layer = pool.get("threading_layer")
    text = f"{pool.get('internal_api', '?')} {pool.get('version', '?')}"
    if layer:
        text += f" ({layer})"
    return text, int(pool.get("num_threads") or 0)


def environment_tags() -> dict[str, str]:
    """Tags describing the software and machine; the same for every run of one process."""
    commit, dirty = git_state()
    blas, blas_threads = blas_description()
    return {
        "ember.version": ember.__version__,
        "ember.git_commit": commit,
        "ember.git_dirty": dirty,
        "numpy.version": np.__version__,
        "numpy.blas": blas,
        "numpy.blas_threads": str(blas_threads),
        "python.version": platform.python_version(),
        "platform": platform.platform(),
        "machine.cpu_count": str(os.cpu_count() or 0),
        "command": command_line()[:5000],
    }


def command_line() -> str:
    """The command as typed, as far as it can be known (`python -m ember.run ...` for the runner)."""
    program = sys.argv[0] if sys.argv else ""
    if program.endswith(os.path.join("ember", "run.py")):
        program = "python -m ember.run"
    else:
        program = Path(program).name
    return " ".join([program, *sys.argv[1:]])


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str, ensure_ascii=False)


def config_digest(config: Mapping[str, Any]) -> str:
    """sha256 of the resolved config (without the `mlflow` section, which says where records go, not
    what was computed), as canonical JSON: equal digests mean the same computation was asked for."""
    relevant = {k: v for k, v in config.items() if k not in ("mlflow", "hydra")}
    return hashlib.sha256(canonical_json(relevant).encode()).hexdigest()


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings and lists as {"a.b.0.c": leaf}; empty containers are kept as "[]" / "{}"."""
    out: dict[str, Any] = {}
    if isinstance(value, Mapping):
        if not value and prefix:
            out[prefix] = "{}"
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(value, list | tuple):
        if not value and prefix:
            out[prefix] = "[]"
        for i, item in enumerate(value):
            out.update(flatten(item, f"{prefix}.{i}" if prefix else str(i)))
    else:
        out[prefix] = value
    return out
