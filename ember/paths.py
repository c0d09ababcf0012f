"""Where ember keeps files of its own on this machine (the bottom layer: imports nothing of ember)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def ember_cache_dir() -> Path:
    """The ember cache root: `$EMBER_CACHE`, else `ember` in the platform's user cache directory."""
    env = os.environ.get("EMBER_CACHE")
    if env:
        return Path(env).expanduser()
    home = Path.home()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or home / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = home / "Library" / "Caches"
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = Path(xdg) if xdg and os.path.isabs(xdg) else home / ".cache"
    return base / "ember"
