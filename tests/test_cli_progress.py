"""Progress output: plain lines when not on a terminal (CI logs), a rich bar on one."""

from __future__ import annotations

import io

import pytest

from ember.progress import Progress


def test_plain_lines_when_not_a_terminal() -> None:
    stream = io.StringIO()
    with Progress("extracting", total=100, stream=stream) as advance:
        for _ in range(100):
            advance(1)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "ember: extracting: 0/100"
    assert lines[-1].startswith("ember: extracting: 100/100 done in ")
    assert 5 <= len(lines) <= 12  # about ten lines, not one per item
    assert all(", ETA " in line for line in lines[1:-1])  # each intermediate line says what is left
    assert "\x1b[" not in stream.getvalue()


def test_status_without_total_and_failure_line() -> None:
    stream = io.StringIO()
    with Progress.status("loading model", stream=stream):
        pass
    assert stream.getvalue().splitlines()[0] == "ember: loading model ..."
    stream = io.StringIO()
    with pytest.raises(ValueError), Progress("work", total=3, stream=stream):
        raise ValueError("boom")
    assert "work: failed after" in stream.getvalue()


def test_disabled_prints_nothing_but_counts() -> None:
    stream = io.StringIO()
    progress = Progress("quiet", total=3, enabled=False, stream=stream)
    with progress as advance:
        advance(2)
    assert stream.getvalue() == "" and progress.done == 2


def test_rich_bar_on_a_terminal() -> None:
    stream = io.StringIO()
    with Progress("on a terminal", total=4, stream=stream, rich=True) as advance:
        for _ in range(4):
            advance(1)
    assert "on a terminal: 4/4 done in" in stream.getvalue()
