"""What a command tells its user, defined once: exit statuses, and lines on stderr.

Every ember command (`ember ...`, `python -m ember.run`, a sweep's callback) ends with one of these
statuses and speaks through `say`, so a message reads the same wherever it comes from."""

from __future__ import annotations

import sys

# Exit statuses: done; something failed (an experiment, a job of a sweep); the user's input cannot run
# (one `ember: ...` line, nothing loaded); interrupted (Ctrl-C); terminated (SIGTERM, 128 + 15).
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143


def say(message: str) -> None:
    """`message` as it is on stderr, flushed at once (a job's lines interleave with its sweep's)."""
    print(message, file=sys.stderr, flush=True)
