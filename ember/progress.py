"""Progress for long work: a rich bar on a terminal, plain lines otherwise (CI logs), or nothing.

    with Progress("extracting hidden states", total=len(prompts)) as advance:
        for prompt in prompts:
            ...
            advance(1)

    with Progress.status("loading smollm2-135m"):   # a step without a count: spinner or two lines
        model = load_model(...)

Plain mode prints a start line, about ten evenly spaced `i/total, ETA ...` lines and an end line with
the elapsed time, all on stderr, so logs stay short. With `delay=SECONDS` a counted piece of work shows
nothing until it has lasted that long (checked at each advance): work that ends sooner leaves no line.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """A context manager for one piece of work; entering it gives `advance(n=1)`."""

    def __init__(self, description: str, total: int | None = None, *, enabled: bool = True,
                 stream: TextIO | None = None, rich: bool | None = None, delay: float = 0.0) -> None:
        self.description = description
        self.total = total
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.rich = enabled and (_is_terminal(self.stream) if rich is None else rich)
        self.done = 0
        self._bar: Any = None
        self._task: Any = None
        self._started = 0.0
        self._next_line = 0
        # A status has no advance to show itself at: on a terminal its spinner shows at once (it goes
        # away at the end), in plain lines only its end line, when the step lasted `delay`.
        self.delay = delay if total is not None or not self.rich else 0.0
        self._shown = False

    @classmethod
    def status(cls, description: str, *, enabled: bool = True, stream: TextIO | None = None,
               delay: float = 0.0) -> Progress:
        return cls(description, None, enabled=enabled, stream=stream, delay=delay)

    def __enter__(self) -> Callable[[int], None]:
        self._started = time.perf_counter()
        if self.enabled and self.delay <= 0:
            self._show()
        return self.advance

    def _show(self) -> None:
        self._shown = True
        if self.rich:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            columns: list[Any] = [SpinnerColumn(), TextColumn("{task.description}")]
            if self.total is not None:
                columns += [BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()]
            columns.append(TimeElapsedColumn())
            console = Console(file=self.stream)
            self._bar = RichProgress(*columns, console=console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total, completed=self.done)
        elif self.done == 0:
            self._line(f"{self.description} ..." if self.total is None
                       else f"{self.description}: 0/{self.total}")
            self._next_line = self._step()
        else:  # shown late: the next advance prints where the work stands
            self._next_line = self.done

    def _step(self) -> int:
        return max(1, -(-(self.total or 0) // 10))  # about ten lines: 16 items print every 2nd

    def advance(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if not self._shown:
            if time.perf_counter() - self._started < self.delay:
                return
            self.done -= n  # the bar and the plain line start from where the work stood before
            self._show()
            self.advance(n)
            return
        if self._bar is not None:
            self._bar.advance(self._task, n)
        elif self.total is not None and self.done >= self._next_line and self.done < self.total:
            elapsed = time.perf_counter() - self._started
            eta = elapsed / self.done * (self.total - self.done)
            self._line(f"{self.description}: {self.done}/{self.total}, ETA {_duration(eta)}")
            self._next_line = self.done + self._step()

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        if not self._shown:
            elapsed = time.perf_counter() - self._started
            if self.enabled and self.total is None and kind is None and elapsed >= self.delay:
                self._line(f"{self.description}: done in {elapsed:.1f} s")
            return
        if self._bar is not None:
            self._bar.stop()
        elapsed = time.perf_counter() - self._started
        if kind is None:
            counted = f" {self.done}/{self.total}" if self.total is not None else ""
            self._line(f"{self.description}:{counted} done in {elapsed:.1f} s")
        elif not issubclass(kind, KeyboardInterrupt):
            self._line(f"{self.description}: failed after {elapsed:.1f} s")

    def _line(self, text: str) -> None:
        print(f"ember: {text}", file=self.stream, flush=True)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, seconds = divmod(int(seconds + 0.5), 60)
    return f"{minutes} min {seconds:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"
