"""Cache-line aligned buffers and the element-wise work split among ember's threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ember import ops, parallel
from ember.buffers import ALIGNMENT, aligned_empty, aligned_zeros
from ember.config import RopeLayout
from ember.families.workspace import Workspace
from ember.kv_cache import KVCache


@pytest.mark.parametrize("shape", [1, 7, 1024, 1 << 16, (3, 5), (2, 300, 64), (1 << 21,)])
def test_aligned_buffers_start_on_a_cache_line(shape):
    for make in (aligned_zeros, aligned_empty):
        buffers = [make(shape) for _ in range(8)]  # the allocator's luck differs call to call
        for buffer in buffers:
            assert buffer.ctypes.data % ALIGNMENT == 0
            assert buffer.dtype == np.float32 and buffer.shape == np.empty(shape).shape
            assert buffer.flags.c_contiguous
    assert not aligned_zeros(shape).any()


def test_engine_buffers_are_aligned(smollm2):
    config = smollm2._forward.config
    workspace = Workspace(config, 3, 16)
    arrays = [value for value in vars(workspace).values() if isinstance(value, np.ndarray)]
    assert arrays and all(array.ctypes.data % ALIGNMENT == 0 for array in arrays)
    cache = KVCache.full(2, 3, 16, 64)
    assert all(array.ctypes.data % ALIGNMENT == 0 for array in cache.keys + cache.values)


@pytest.fixture(autouse=True)
def fresh_backoff(monkeypatch):
    """Each test starts with sharing on (a loss an earlier test saw would make shares serial)."""
    monkeypatch.setattr(parallel, "_backoff", parallel._Backoff())


@pytest.mark.parametrize("count,values", [(1, 1 << 20), (5, 1 << 20), (128, 1 << 20), (128, 1 << 16),
                                          (4096, 1 << 24), (128, 10)])
def test_share_ranges_covers_every_index_once_in_small_pieces(count, values):
    seen = []
    with parallel.use_threads(2):
        parallel.share_ranges(count, values, lambda start, stop: seen.append((start, stop)))
    covered = sorted(i for start, stop in seen for i in range(start, stop))
    assert covered == list(range(count))
    if values < parallel.SPLIT_VALUES or count == 1:
        assert len(seen) == 1
    else:  # pieces of about PIECE_VALUES values, at least one a thread, at most PIECES_PER_THREAD
        expected = min(count, 2 * parallel.PIECES_PER_THREAD, max(2, values // parallel.PIECE_VALUES))
        assert len(seen) == expected and expected >= 2


def test_the_caller_does_not_wait_for_a_helper_that_never_started():
    """Every helper is held by other work (as a thread whose core another process took): the caller
    takes every piece itself and returns while the helpers are still held."""
    release = threading.Event()
    with parallel.use_threads(2):
        parallel.share(lambda index: None, 2)  # the helper thread exists
        helpers = parallel._helper_count
        held = parallel._Job(lambda index: release.wait(120), helpers)  # one blocking piece a helper
        parallel._wake_helpers(held, helpers)
        try:
            done = []
            parallel.share(lambda index: done.append((index, threading.get_ident())), 10)
            returned_while_held = held.all_done.locked()
        finally:
            release.set()
            assert held.all_done.acquire(timeout=120)
    assert returned_while_held
    assert sorted(index for index, _ in done) == list(range(10))
    assert {thread for _, thread in done} == {threading.get_ident()}


def test_share_runs_every_piece_once_on_several_threads_and_raises_the_first_error():
    with parallel.use_threads(3):
        done = []
        parallel.share(lambda index: done.append(index), 200)
        assert sorted(done) == list(range(200))

        def fails(index: int) -> None:
            if index == 7:
                raise ValueError("piece 7")
            done.append(index)

        done.clear()
        with pytest.raises(ValueError, match="piece 7"):
            parallel.share(fails, 50)
        assert sorted(done) == [i for i in range(50) if i != 7]  # the others still ran, each once


def _elementwise(threads: int, x: np.ndarray) -> list[np.ndarray]:
    results = []
    with parallel.use_threads(threads):
        for function in (ops.silu_inplace, ops.gelu_tanh_inplace):
            y = x.copy()
            function(y, np.empty_like(y))
            results.append(y)
        heads = x[:, :1024].reshape(x.shape[0], 16, 64).copy()
        angles = np.linspace(0, 3, x.shape[0] * 32, dtype=np.float32).reshape(x.shape[0], 32)
        for layout in (RopeLayout.NORM, RopeLayout.NEOX):
            rotated = heads.copy()
            scratch = (np.empty((x.shape[0], 16, 32), np.float32), np.empty((x.shape[0], 16, 32), np.float32))
            ops.apply_rope(rotated, np.cos(angles), np.sin(angles), layout, 64, *scratch)
            results.append(rotated)
    return results


def test_split_activations_and_rope_equal_the_single_threaded_values_bit_for_bit():
    x = np.random.default_rng(0).standard_normal((128, 2048)).astype(np.float32) * 4
    assert x.size >= parallel.SPLIT_VALUES  # the split path runs
    for one, two in zip(_elementwise(1, x), _elementwise(2, x), strict=True):
        assert np.array_equal(one, two)


def test_backoff_stops_sharing_when_recent_shares_lost_time_for_a_period_that_doubles_and_halves():
    backoff = parallel._Backoff()
    # (worked, took, mine, count): the caller alone would have taken 0.002 s
    win, small_loss, loss = (0.001, 0.0012, 1, 2), (0.001, 0.0022, 1, 2), (0.001, 0.01, 1, 2)
    for _ in range(20):
        backoff.record(*win)
    backoff.record(*small_loss)  # 10% over the caller alone, after gains: sharing goes on
    assert not backoff.serial()
    backoff.record(*loss)  # a wait of 4 times the work (a helper that lost its core) outweighs the gains
    assert [backoff.serial() for _ in range(backoff.MIN_SERIAL + 1)] == [True] * backoff.MIN_SERIAL + [False]
    backoff.record(*loss)
    assert sum(backoff.serial() for _ in range(10 * backoff.MIN_SERIAL)) == 2 * backoff.MIN_SERIAL
    backoff.record(*win)
    backoff.record(*win)
    assert backoff.period == backoff.MIN_SERIAL  # 4 · MIN after the second stop, halved twice
    for _ in range(5):
        backoff.record(0.001, 0.0012, 2, 2)  # the helpers took nothing: at most 20% over, sharing goes on
    assert not backoff.serial()


def test_a_helper_that_holds_its_piece_makes_the_next_shares_run_in_the_caller_alone():
    """A helper's piece outlasts the caller's own work many times over (as when another process took
    its core): the following shares run in the calling thread alone, with every piece still run once."""
    caller = threading.get_ident()
    helper_started = threading.Event()

    def held(index: int) -> None:
        if threading.get_ident() != caller:
            helper_started.set()
            threading.Event().wait(0.2)  # the helper's piece: waiting, as a preempted thread
        else:
            assert helper_started.wait(120)  # the caller's first piece waits for the helper's

    done = []

    def slow(index: int) -> None:  # long enough that a helper sharing this would take a piece
        done.append((index, threading.get_ident()))
        threading.Event().wait(0.05)

    with parallel.use_threads(2):
        parallel.share(held, 4)  # the first share after a fresh start is shared
        parallel.share(slow, 10)
    assert sorted(index for index, _ in done) == list(range(10))
    assert {thread for _, thread in done} == {caller}
