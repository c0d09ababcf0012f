"""Threads that watch a counter before they block (`ember.quant.waiting`, `ember.parallel.use_waiting`)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ember import parallel
from ember.quant import compute_threads, waiting


@pytest.fixture(scope="module", autouse=True)
def watcher():
    waiting.warm_up()
    previous = parallel._waiting
    parallel.use_waiting(waiting.wait_for_change)
    yield
    parallel.use_waiting(previous)


def test_a_watcher_sees_a_change_made_by_another_thread_and_gives_up_without_one():
    counter = np.zeros(1, np.int64)
    assert not waiting.wait_for_change(counter, 0, 200.0)  # nothing changes: it returns, False
    assert waiting.wait_for_change(counter, 5, 10.0)  # already different
    timer = threading.Timer(0.01, lambda: counter.__setitem__(0, 1))
    timer.start()
    assert waiting.wait_for_change(counter, 0, 5e6)  # up to 5 s: the change comes after 10 ms
    timer.join()


_lock = threading.Lock()


def _count(seen: np.ndarray, index: int) -> None:
    with _lock:
        seen[index] += 1


def test_shares_with_watching_threads_run_every_piece_once_and_raise_the_first_error():
    with compute_threads(3):
        for count in (1, 2, 7, 64):
            for pause in (0.0, 0.002):  # helpers still watching, or already blocked on the queue
                seen = np.zeros(count, np.int64)
                time.sleep(pause)
                parallel.share(lambda index, seen=seen: _count(seen, index), count, blas=False, on=3)
                assert (seen == 1).all()

        def failing(index: int) -> None:
            if index == 5:
                raise ValueError("piece 5")

        with pytest.raises(ValueError, match="piece 5"):
            parallel.share(failing, 16, blas=False, on=3)
