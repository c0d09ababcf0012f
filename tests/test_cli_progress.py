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


@pytest.mark.parametrize("total", [7, 16, 25, 100, 1000])
def test_plain_mode_prints_about_ten_lines_whatever_the_count(total: int) -> None:
    stream = io.StringIO()
    with Progress("items", total=total, stream=stream) as advance:
        for _ in range(total):
            advance(1)
    assert len(stream.getvalue().splitlines()) <= 12


def test_work_shorter_than_the_delay_prints_nothing() -> None:
    stream = io.StringIO()
    with Progress("a quick study", total=16, stream=stream, delay=3600) as advance:
        for _ in range(16):
            advance(1)
    assert stream.getvalue() == ""
    stream = io.StringIO()
    with pytest.raises(ValueError), Progress("quick failure", total=3, stream=stream, delay=3600) as advance:
        advance(1)
        raise ValueError("boom")
    assert stream.getvalue() == ""


def test_work_that_outlasts_the_delay_shows_where_it_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember import progress

    now = [100.0]  # a clock the test moves: the verdict does not depend on the machine's speed
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    stream = io.StringIO()
    with Progress("a long study", total=20, stream=stream, delay=5) as advance:
        for _ in range(20):
            advance(1)
            now[0] += 1.0
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("ember: a long study: 6/20, ETA ")  # the first advance after 5 s
    assert lines[-1] == "ember: a long study: 20/20 done in 20.0 s"
    assert len(lines) <= 12


def test_a_late_rich_bar_starts_where_the_work_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember import progress

    now = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    stream = io.StringIO()
    bar = Progress("late bar", total=4, stream=stream, rich=True, delay=1)
    with bar as advance:
        advance(1)
        now[0] = 2.0
        advance(1)
        assert bar._bar.tasks[0].completed == 2
        advance(2)
    assert "late bar: 4/4 done in" in stream.getvalue()


def test_a_quick_status_with_a_delay_prints_nothing_and_a_long_one_its_end(monkeypatch: pytest.MonkeyPatch):
    from ember import progress

    stream = io.StringIO()
    with Progress.status("preparing", stream=stream, delay=3600):
        pass
    assert stream.getvalue() == ""
    now = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    with Progress.status("preparing", stream=stream, delay=3):
        now[0] = 4.0
    assert stream.getvalue() == "ember: preparing: done in 4.0 s\n"
