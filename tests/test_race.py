"""Products shared as races (`ember.parallel.race`, `ember.quant.kernels.OPEN`): the caller takes back
what a helper left unfinished, a late helper's values are dropped, helpers keep off their caller's core.

A helper that lost its core is stood in for by pieces marked taken that nobody computes, or by a helper
thread held on an event: nothing here depends on how fast the machine is."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from test_quant import random_encoded

from ember import parallel
from ember.quant import compute_threads, kernels, matrix, q8, waiting
from ember.quant.matrix import QuantizedActivation, QuantizedMatrix

RNG = np.random.default_rng(25)
ROWS, COLUMNS, PIECE = 80, 512, 16  # 5 pieces


def _weights(qtype: Q) -> QuantizedMatrix:
    return QuantizedMatrix("w", random_encoded(qtype, ROWS, COLUMNS), int(qtype), (ROWS, COLUMNS))


def _kernels() -> dict[str, tuple]:
    """name -> (call(state, out, caller), activation rows) for each product kernel."""
    plain = _weights(Q.Q4_1)
    group = matrix.kernel_groups([plain])[0]
    one = RNG.standard_normal((1, COLUMNS)).astype(np.float32)
    five = RNG.standard_normal((5, COLUMNS)).astype(np.float32)
    calls = {
        "matvec": (lambda state, out, caller: kernels.matvec(
            *group, one[0], out, kernels.F16_TABLE, state, PIECE, caller), 1),
        "matmul_rows": (lambda state, out, caller: kernels.matmul_rows(
            *group, five, out, kernels.F16_TABLE, matrix.HALF, state, PIECE, caller), 5),
    }
    if q8.AVAILABLE:
        for qtype, rounding in ((Q.Q4_K, "q8_k"), (Q.Q8_0, "q8_0")):
            rounded = matrix.kernel_groups([_weights(qtype)])[0]
            activation = QuantizedActivation(five, rounding)
            calls[f"q8 {qtype.name}"] = (lambda state, out, caller, rounded=rounded, activation=activation:
                                         activation.multiply(rounded, out, state, PIECE, caller), 5)
    return calls


KERNELS = _kernels()


def _helper_started() -> None:
    """A helper thread exists and has taken every job handed out so far (a race hands none out while
    one waits: `parallel.race`)."""
    parallel.share(lambda index: None, 2)
    deadline = time.monotonic() + 60
    while parallel._jobs.qsize() and time.monotonic() < deadline:
        time.sleep(0.001)


def _alone(call, tokens: int) -> np.ndarray:
    out = np.full((tokens, ROWS), np.nan, np.float32)
    call(kernels.share_state(ROWS // PIECE, 0), out, True)
    return out


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_the_caller_takes_back_the_pieces_a_helper_took_and_never_finished(name):
    call, tokens = KERNELS[name]
    expected = _alone(call, tokens)
    assert not np.isnan(expected).any()
    state = kernels.share_state(ROWS // PIECE, patience=100)
    state[0] = 2  # pieces 0 and 1 were taken by a helper that lost its core
    out = np.full((tokens, ROWS), np.nan, np.float32)
    call(state, out, True)
    np.testing.assert_array_equal(out, expected)
    assert (state[2:] == kernels.DONE).all()  # taken back, computed, marked done


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_a_helper_that_runs_late_drops_the_pieces_its_caller_took_back(name):
    call, tokens = KERNELS[name]
    expected = _alone(call, tokens)
    state = kernels.share_state(ROWS // PIECE, patience=0)
    state[2 + 1] = kernels.TAKEN  # the caller computed piece 1 itself and returned
    out = np.full((tokens, ROWS), np.nan, np.float32)
    call(state, out, False)  # the helper gets its core back and goes through every piece
    assert np.isnan(out[:, PIECE:2 * PIECE]).all()  # never written
    keep = np.r_[0:PIECE, 2 * PIECE:ROWS]
    np.testing.assert_array_equal(out[:, keep], expected[:, keep])
    assert list(state[2:]) == [kernels.DONE, kernels.TAKEN] + [kernels.DONE] * 3


def test_a_product_returns_complete_while_its_helper_is_held_elsewhere(monkeypatch):
    """The helper is kept busy by another job until after the product: the caller computes every piece
    and returns (waiting for the helper would hang until the event's 120 s)."""
    monkeypatch.setattr(matrix, "SHARED_FROM", 1)
    weights = _weights(Q.Q4_1)
    x = RNG.standard_normal((1, COLUMNS)).astype(np.float32)
    expected = weights.matmul(x, np.empty((1, ROWS), np.float32)).copy()
    release, holding = threading.Event(), threading.Event()

    def held(_: int) -> None:
        holding.set()
        release.wait(120)

    with compute_threads(2):
        parallel.share(lambda index: None, 2)  # the helper thread exists
        job = parallel._Job(held, parallel._helper_count)
        parallel._wake_helpers(job, parallel._helper_count)
        assert holding.wait(60)
        try:
            for _ in range(3):
                out = np.full((1, ROWS), np.nan, np.float32)
                np.testing.assert_array_equal(weights.matmul(x, out), expected)
                assert not release.is_set()
        finally:
            release.set()


def test_a_helper_error_reaches_the_caller_through_the_piece_it_takes_back():
    def work(caller: bool) -> None:
        raise ValueError("caller" if caller else "helper")

    with compute_threads(2), pytest.raises(ValueError, match="caller"):
        parallel.race(work, 2)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores this process may run on")
def test_helpers_keep_off_the_core_their_caller_runs_on():
    """Each helper that ran a piece of a share was, while it ran, on no core its caller was on when it
    handed the share out."""
    seen = []

    def piece(index: int) -> None:
        thread = threading.current_thread()
        if thread.name.startswith("ember-"):
            seen.append((parallel._caller_cpu, os.sched_getaffinity(0)))
        time.sleep(0.001)

    with compute_threads(2):
        deadline = time.monotonic() + 60
        while not seen and time.monotonic() < deadline:  # until a helper takes a piece
            parallel.share(piece, 8)
    assert seen
    for caller, cores in seen:
        assert caller >= 0 and cores and caller not in cores


def test_a_helper_whose_watch_was_spent_off_its_core_blocks_at_once_for_a_while(monkeypatch):
    """A watch that took wall time but no CPU time (here: a sleep; on a busy machine: the other
    process's turn on the core) makes the helper skip its watches for QUIET seconds."""
    watched = []

    def sleeping(counter: np.ndarray, seen: int, microseconds: float) -> bool:
        watched.append(microseconds)
        time.sleep(0.005)
        return False

    monkeypatch.setattr(parallel, "_waiting", sleeping)
    monkeypatch.setattr(parallel._Watching, "QUIET", 3600.0)  # however slowly this test runs
    watching = parallel._Watching()
    started = time.perf_counter()
    watching.watch(0)
    assert len(watched) == 1 and watching.quiet_until >= started + 3600.0
    watching.watch(0)  # quiet: no watch
    assert len(watched) == 1
    watching.quiet_until = 0.0
    watching.watch(0)
    assert len(watched) == 2


def test_patience_is_a_watch_of_about_redo_watch_microseconds():
    waiting.warm_up()
    assert matrix._patience(1) == 0
    assert matrix._patience(2) == waiting.rounds(matrix.REDO_WATCH) >= 1


@pytest.mark.parametrize("transposed_below", [0, 512], ids=["blas", "tile_product"])
def test_prefill_tiles_computed_aside_by_helpers_equal_the_callers_own(monkeypatch, transposed_below):
    """Every tile as a helper computes it (into its scratch, then stored) against every tile straight
    into the output, on BLAS's path and on `kernels.tile_product`'s: bit for bit."""
    monkeypatch.setattr(matrix, "TRANSPOSED_BELOW", transposed_below)
    monkeypatch.setattr(matrix, "MIN_TILE_ROWS", 16)
    monkeypatch.setattr(matrix, "TILE_VALUES", 16 * 256)  # several tiles, the last one short
    parts = [QuantizedMatrix(f"p{i}", random_encoded(qtype, 23, 256), int(qtype), (23, 256))
             for i, qtype in enumerate((Q.Q4_K, Q.Q8_0))]
    stacked = matrix.StackedMatrix(parts)
    x = RNG.standard_normal((40, 256)).astype(np.float32)
    straight = stacked.matmul(x, np.full((40, 46), np.nan, np.float32)).copy()

    def all_by_helpers(count, compute, store, direct=None, blas=True):
        for index in range(count):
            store(index, compute(index))

    monkeypatch.setattr(parallel, "race_pieces", all_by_helpers)
    aside = stacked.matmul(x, np.full((40, 46), np.nan, np.float32))
    np.testing.assert_array_equal(aside, straight)


def test_race_pieces_stores_each_piece_once_and_drops_what_a_late_helper_computed():
    """The helper is held inside the first piece it takes (the caller waits in its own first piece until
    then): the caller takes that piece back after its watch, stores every piece and returns; the
    helper, released, finds its piece taken and stores nothing."""
    release, holding, helper_done = threading.Event(), threading.Event(), threading.Event()
    held_by, stored = [], []

    def by_helper() -> bool:
        return threading.current_thread().name.startswith("ember-")

    def compute(index: int) -> int:
        if by_helper() and not held_by:
            held_by.append(index)
            holding.set()
            release.wait(120)
            helper_done.set()
        elif not by_helper():
            assert holding.wait(60)
        return index * 10

    def store(index: int, value: object) -> None:
        stored.append((index, value, by_helper()))

    with compute_threads(2):
        _helper_started()
        parallel.race_pieces(50, compute, store)
        assert held_by and not release.is_set()  # returned while the helper still held its piece
        release.set()
        assert helper_done.wait(60)
        later = threading.Event()  # the helper takes jobs in order: once in this one, it left the first

        def next_job(index: int) -> None:
            if by_helper():
                later.set()
            else:
                assert later.wait(60)

        parallel.race_pieces(4, next_job, lambda index, value: None)
    assert sorted(index for index, _, _ in stored) == list(range(50))  # each once, the held one too
    assert all(value == index * 10 for index, value, _ in stored)
    assert [helper for index, _, helper in stored if index == held_by[0]] == [False]


def test_piece_states_are_reused_only_once_every_helper_on_them_has_returned():
    pool = matrix._StatePool()
    first = pool.take(5, 7)
    first[2:] = kernels.DONE
    job = parallel._Job(lambda index: None, 1)  # a helper's call not yet returned
    pool.lend([first], job)
    second = pool.take(5, 7)
    assert second is not first  # the helper may still claim pieces of `first`
    pool.lend([second], None)  # no helper was asked
    job.drain()  # the helper's call returns
    again = [pool.take(5, 9), pool.take(5, 9)]
    assert {id(state) for state in again} == {id(first), id(second)}
    for state in again:
        assert state[1] == 9 and not state[0] and not state[2:].any()
    assert len(pool.take(4, 0)) == 6  # another size: a fresh one
